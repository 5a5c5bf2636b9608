"""Models built on the meta device: parameters materialized into the flat buffers, this rank's
rows only, and the ``.to()``/``.to_empty()`` conversions of wrapped modules.

[Note: meta materialization]
``fully_shard`` accepts a unit whose parameters are on the ``meta`` device. It allocates the
group's persistent buffers (this rank's extents, see the plan) on the mesh's device, zeroed, and
marks the unit *pending*; no value exists yet and no broadcast runs (``sync_module_states`` has
nothing to send: every rank must initialize with the same seed, as in torchtitan's flow).

Materialization runs once, at the first of: the root's first forward (its lazy init), any
``state_dict()``/``load_state_dict()`` of a unit, or a full-state-dict call. It walks
``root.modules()`` in order -- the order of ordinary construction, not the children-first order
of wrapping -- and, for each module that has a parameter of a pending unit in one of its own
slots (``module._parameters``, not its children's) or a meta buffer:

1. puts fresh, uninitialized full-size tensors on the buffers' device in those slots (meta
   buffers are replaced for good);
2. calls ``param_init_fn(module)`` if the unit was wrapped with one, else
   ``module.reset_parameters()`` (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``,
   ``nn.BatchNorm*`` (running stats too), ...). Both must initialize the module's *own*
   parameters and buffers, like ``reset_parameters`` does;
3. copies each parameter's rows that this rank's buffers hold (``write_full_param``) and puts
   the DTensor parameters back, dropping the full-size tensors.

So the random stream is consumed module by module in construction order, and with the same seed
the values equal, bitwise, those of the model built on the device, as long as construction
initializes each module's parameters by its ``reset_parameters`` (true of torch's layers; a
custom module whose ``__init__`` draws for its parameters after building its children would
differ). A parameter tied between modules takes its value from the first module in order that
holds it; later holders still run their init on a scratch copy that is dropped, which is what
construction followed by tying (``head.weight = tok.weight``) consumes. Peak memory: this
rank's buffers plus one module's full parameters.

Before anything is written, the pass checks that every such module has ``reset_parameters``
(or that ``param_init_fn`` is given), else a ``RuntimeError`` names the first parameter or buffer
that would be left without a value (nothing changed, nothing consumed from the random stream).
This is not checked at wrap time on purpose: torchtitan's flow wraps a meta model whose root
holds a buffer (``freqs_cis``) no ``reset_parameters`` covers, then calls ``to_empty`` and its
own init, and never materializes. Anything still on ``meta`` in the pending units after the pass
(e.g. a meta parameter passed in ``ignored_params``) raises a ``RuntimeError`` naming it.

[Note: conversions after wrapping]
``nn.Module._apply`` (behind ``.to()``, ``.float()``, ``.cuda()``, ``.to_empty()``...) would
replace the DTensor parameters that view the flat buffers. ``FSDPModule._apply`` first applies
the conversion to every managed parameter and classifies the result (``classify``): the same
object (a no-op ``.to``) changes nothing; a new tensor of the same kind, placements, shape,
dtype and device (``to_empty(device=<the buffers' device>)``, or any value-only map) is copied
into this rank's main weights, which are then marked updated (compute weights are refreshed
before the next forward), and clears a pending meta init: ``to_empty`` means the user
initializes (torchtitan: ``init_weights()`` writing in place through the DTensor parameters, or
``checkpoint.load_full_state_dict(..., broadcast_from_rank0=True)``). Anything else (another
dtype or device) raises ``NotImplementedError`` before anything changed. Non-managed tensors
(buffers, ignored parameters) go through ``nn.Module._apply`` as usual.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import _registry
from ._flat_param_group import FlatParamGroup
from ._slots import owned_modules

__all__ = [
    "ParamInitFn", "adopt_meta_unit", "classify", "is_pending", "materialize",
    "materialize_hook", "mark_initialized_by_user",
]

ParamInitFn = Callable[[nn.Module], None]


@dataclass(eq=False)
class _PendingUnit:
    groups: list[FlatParamGroup]
    device: torch.device
    param_init_fn: ParamInitFn | None


# Wrapped modules whose meta parameters or buffers have no values yet.
_pending: weakref.WeakKeyDictionary[nn.Module, _PendingUnit] = weakref.WeakKeyDictionary()


def has_meta_state(module: nn.Module) -> bool:
    """Whether the unit ``module`` would own a meta parameter or buffer."""
    return any(
        t is not None and t.device.type == "meta"
        for _, m in owned_modules(module)
        for t in (*m._parameters.values(), *m._buffers.values())
    )


def adopt_meta_unit(
    module: nn.Module, groups: list[FlatParamGroup], device: torch.device,
    param_init_fn: ParamInitFn | None,
) -> None:
    """Wrap time, after every group of ``module`` was built: put the groups' compute
    placeholders in the slots of the meta parameters they replace (tied slots included) and
    record the unit as pending. A unit with neither meta parameters nor meta buffers is left
    alone."""
    meta_groups = [g for g in groups if g.pending_init]
    if not meta_groups and not has_meta_state(module):
        return
    replacement = {}
    for group in meta_groups:
        for record, original in zip(group.records, group.original_params):
            replacement[id(original)] = record.compute_param
        group.original_params = []  # drop the meta parameters
    for _, submodule in owned_modules(module):
        for name, param in submodule._parameters.items():
            if param is not None and id(param) in replacement:
                submodule._parameters[name] = replacement[id(param)]
    _pending[module] = _PendingUnit(groups, device, param_init_fn)


def is_pending(module: nn.Module) -> bool:
    return module in _pending


def mark_initialized_by_user(module: nn.Module) -> None:
    """``to_empty`` after wrapping: the user initializes ``module``'s unit (no materialization)."""
    unit = _pending.pop(module, None)
    if unit is not None:
        for group in unit.groups:
            group.finish_materialization()


def materialize_hook(module: nn.Module, *args: Any) -> None:
    """State-dict and load-state-dict pre-hook of every unit."""
    materialize(module)


def materialize(root: nn.Module) -> None:
    """Give every pending unit in ``root``'s tree its values (see [Note: meta materialization]).
    Local: no collective. Cheap when nothing is pending."""
    if not _pending:
        return
    units = {id(m): (m, _pending[m]) for m in root.modules() if m in _pending}
    if not units:
        return
    owner: dict[int, _PendingUnit] = {}
    for module, unit in units.values():
        for _, submodule in owned_modules(module):
            owner[id(submodule)] = unit
    pending_groups = {id(g) for _, unit in units.values() for g in unit.groups if g.pending_init}
    work = []
    for name, module in root.named_modules():
        holder = owner.get(id(module))
        if holder is not None:
            slots = _pending_slots(module, pending_groups)
            if slots:
                _check_initializer(name, module, holder, slots[0])
                work.append((name, module, holder))
    written: set[int] = set()  # records that got their value in this pass
    for name, module, holder in work:
        _materialize_module(name, module, holder, pending_groups, written)
    for module, unit in units.values():
        for group in unit.groups:
            group.finish_materialization()
        del _pending[module]
        _check_nothing_left(module)


def _pending_slots(module: nn.Module, pending_groups: set[int]) -> list[tuple[str, str]]:
    """(kind, slot) of ``module``'s own parameters of pending groups and meta buffers."""
    slots = [
        ("parameter", slot) for slot, p in module._parameters.items()
        if p is not None and (record := _registry.record_of(p)) is not None
        and id(record.group) in pending_groups
    ]
    return slots + [
        ("buffer", slot) for slot, b in module._buffers.items()
        if b is not None and b.device.type == "meta"
    ]


def _check_initializer(
    name: str, module: nn.Module, unit: _PendingUnit, first: tuple[str, str]
) -> None:
    if unit.param_init_fn is not None or callable(getattr(module, "reset_parameters", None)):
        return
    kind, slot = first
    raise RuntimeError(
        f"{kind} '{_join(name, slot)}' was built on the meta device and its module "
        f"({type(module).__name__}) has no reset_parameters() to initialize it; nothing was "
        "materialized. Pass param_init_fn=fn to fully_shard (fn(module) initializes that "
        "module's own parameters and buffers in place; called in module order), or call "
        "model.to_empty(device=...) after fully_shard and initialize the model yourself (in "
        "place through its parameters, or with checkpoint.load_full_state_dict)"
    )


def _materialize_module(
    name: str, module: nn.Module, unit: _PendingUnit, pending_groups: set[int],
    written: set[int],
) -> None:
    temporaries: dict[str, tuple[Any, bool]] = {}  # slot -> (record, first holder)
    for slot, param in module._parameters.items():
        record = _registry.record_of(param) if param is not None else None
        if record is None or id(record.group) not in pending_groups:
            continue
        temporaries[slot] = (record, id(record) not in written)
        written.add(id(record))
    meta_buffers = [
        slot for slot, b in module._buffers.items() if b is not None and b.device.type == "meta"
    ]
    if not temporaries and not meta_buffers:
        return
    for slot in meta_buffers:
        buffer = module._buffers[slot]
        assert buffer is not None
        module._buffers[slot] = torch.empty_like(buffer, device=unit.device)
    saved = {slot: module._parameters[slot] for slot in temporaries}
    try:
        for slot, (record, _) in temporaries.items():
            group = record.group
            module._parameters[slot] = nn.Parameter(
                torch.empty(record.item.shape, dtype=group.param_dtype, device=group.device),
                requires_grad=record.dist_param.requires_grad,
            )
        with torch.no_grad():
            if unit.param_init_fn is not None:
                unit.param_init_fn(module)
            else:
                module.reset_parameters()  # type: ignore[operator]
        for slot, (record, first) in temporaries.items():
            value = module._parameters[slot]
            if value is None or value.shape != record.item.shape or value.device.type == "meta":
                what = "param_init_fn" if unit.param_init_fn is not None else "reset_parameters"
                raise RuntimeError(
                    f"materializing '{_join(name, slot)}': {what} of {type(module).__name__} "
                    f"left it as {_describe(value)}, expected a tensor of shape "
                    f"{tuple(record.item.shape)} on {record.group.device}; initialize the "
                    "parameter in place (nn.init.*, .copy_) instead of replacing it"
                )
            if first:
                record.group.write_full_param(record.index, value)
    finally:
        module._parameters.update(saved)


def _check_nothing_left(module: nn.Module) -> None:
    for prefix, submodule in owned_modules(module):
        for kind, tensors in (("parameter", submodule._parameters), ("buffer", submodule._buffers)):
            for slot, t in tensors.items():
                if t is not None and t.device.type == "meta":
                    raise RuntimeError(
                        f"{kind} '{_join(prefix, slot)}' of the fully_shard unit "
                        f"{type(module).__name__} is still on the meta device after "
                        "materialization (e.g. it is in ignored_params, or the module's "
                        "initializer did not set it); move it to the device yourself (e.g. "
                        "model.to_empty(device=...) after fully_shard) and initialize it"
                    )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} on {value.device}"
    return repr(value)


# ---------------------------------------------------------------------- conversions (_apply)

_applying = [0]  # depth of FSDPModule._apply calls in progress


def applying() -> bool:
    """Inside a unit's ``_apply``, which already handled every unit below it."""
    return _applying[0] > 0


@contextlib.contextmanager
def applying_conversion() -> Iterator[None]:
    _applying[0] += 1
    try:
        yield
    finally:
        _applying[0] -= 1


def classify(fn: Callable[[torch.Tensor], Any], param: nn.Parameter) -> str | None:
    """What ``fn`` (an ``nn.Module._apply`` conversion) does to the managed DTensor parameter
    ``param``: ``"same"`` (returns it), ``"copy"`` (a new value of the same kind, placements,
    shape, dtype and device: its values can be copied into the buffers), or ``None`` (anything
    else: not supported). See [Note: conversions after wrapping]."""
    try:
        out = fn(param)
    except Exception:  # noqa: BLE001 - any failure means it cannot be applied in place
        return None
    if out is param:
        return "same"
    local = param._local_tensor  # type: ignore[attr-defined]
    if (
        isinstance(out, DTensor)
        and isinstance(param, DTensor)
        and out.placements == param.placements
        and out.device_mesh == param.device_mesh
        and out.shape == param.shape
        and out.dtype == param.dtype
        and out._local_tensor.device == local.device
        and out._local_tensor.shape == local.shape
    ):
        return "copy"
    return None


@torch.no_grad()
def copy_converted(fn: Callable[[torch.Tensor], Any], group: FlatParamGroup, index: int) -> None:
    """Apply ``fn`` (classified ``"copy"``) to parameter ``index`` of ``group`` again and write
    the result into this rank's main weights; the caller marks the group updated."""
    param = group.records[index].dist_param
    out = fn(param)
    param._local_tensor.copy_(out._local_tensor)  # type: ignore[attr-defined]
