"""Models built on the meta device: parameters materialized into the flat buffers, this rank's
rows only. (The ``.to()``/``.to_empty()`` conversions of wrapped modules, which also end a
pending materialization, are in ``_conversions.py``.)

[Note: meta materialization]
``fully_shard`` accepts a unit whose parameters are on the ``meta`` device. It allocates the
group's persistent buffers (this rank's extents, see the plan) on the mesh's device, zeroed, and
marks the unit *pending*; no value exists yet and no broadcast runs (``sync_module_states`` has
nothing to send: every rank must initialize with the same seed, as in torchtitan's flow).

Materialization runs once, at the first of: the root's first forward (its lazy init), any
``state_dict()``/``load_state_dict()`` of a unit, or a full-state-dict call. It walks
``root.modules()`` in order -- the order of ordinary construction, not the children-first order
of wrapping (a unit wrapped from a list, ``fully_shard([norm, head])``, is in the pass when any
of its members is in ``root``'s tree; members outside it are walked after it) -- and, for each
module that has a parameter of a pending unit in one of its own
entries (``module._parameters``, not its children's) or a meta buffer:

1. puts fresh, uninitialized full-size tensors on the buffers' device in those entries (meta
   buffers are replaced for good);
2. calls ``param_init_fn(module)`` if the unit was wrapped with one, else
   ``module.reset_parameters()`` (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``,
   ``nn.BatchNorm*`` (running stats too), ...). Both must initialize the module's *own*
   parameters and buffers, like ``reset_parameters`` does;
3. copies each parameter's rows that this rank's buffers hold (``write_full_param``) and puts
   the DTensor parameters back, dropping the full-size tensors.

A module whose ``reset_parameters`` covers a subtree (a parent that re-initializes its
children) is called after that subtree instead, and initializers that cannot be reproduced are
refused: see [Note: initializers that cover a subtree] in ``_init_order.py``, which plans the
calls. So the random stream is consumed module by module in construction order, and with the
same seed the values equal, bitwise, those of the model built on the device, as long as
construction initializes each module's parameters by its ``reset_parameters`` (true of torch's
layers; a custom module whose ``__init__`` draws for its parameters inline, without an
initializer method, would differ). A parameter tied between modules takes its value from the
first module in order that holds it; later holders still run their init on a scratch copy that
is dropped, which is what construction followed by tying (``head.weight = tok.weight``)
consumes. Peak memory: this rank's buffers plus one module's full parameters (or the largest
covered subtree's).

Before anything is written, the pass checks that every such module has ``reset_parameters``
(or that ``param_init_fn`` is given), else a ``RuntimeError`` names the first parameter or buffer
that would be left without a value (nothing changed, nothing consumed from the random stream).
This is not checked at wrap time on purpose: torchtitan's flow wraps a meta model whose root
holds a buffer (``freqs_cis``) no ``reset_parameters`` covers, then calls ``to_empty`` and its
own init, and never materializes. Anything still on ``meta`` in the pending units after the pass
(e.g. a meta parameter passed in ``ignored_params``) raises a ``RuntimeError`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .. import _registry
from ._init_order import InitCall, plan_init_calls, refuse_unreproducible_inits

if TYPE_CHECKING:
    from .._runtime._flat_param_group import FlatParamGroup

__all__ = [
    "ParamInitFn", "adopt_meta_unit", "has_meta_state", "materialize", "materialize_hook",
    "mark_initialized_by_user",
]

ParamInitFn = Callable[[nn.Module], None]


@dataclass(eq=False)
class PendingUnit:
    """A wrapped module whose meta parameters or buffers have no values yet (kept in
    ``_registry.pending_meta_units`` until materialized or initialized by the user)."""

    groups: list[FlatParamGroup]
    device: torch.device
    param_init_fn: ParamInitFn | None
    # The modules of a unit wrapped from a list (its module is their internal holder, never in
    # a model's tree; see [Note: several modules as one unit]); empty for one module.
    members: tuple[nn.Module, ...] = ()


def has_meta_state(module: nn.Module) -> bool:
    """Whether the unit ``module`` would own a meta parameter or buffer."""
    return any(
        t is not None and t.device.type == "meta"
        for _, m in _registry.owned_modules(module)
        for t in (*m._parameters.values(), *m._buffers.values())
    )


def adopt_meta_unit(
    module: nn.Module, groups: list[FlatParamGroup], device: torch.device,
    param_init_fn: ParamInitFn | None, members: list[nn.Module] | None = None,
) -> None:
    """Wrap time, after every group of ``module`` was built: put the groups' compute
    placeholders in the entries of the meta parameters they replace (tied entries included) and
    record the unit as pending. A unit with neither meta parameters nor meta buffers is left
    alone. ``members``: the modules of a unit wrapped from a list (``module`` holds them)."""
    meta_groups = [g for g in groups if g.pending_init]
    if not meta_groups and not has_meta_state(module):
        return
    replacement = {}
    for group in meta_groups:
        for index, (record, original) in enumerate(zip(group.records, group.original_params)):
            replacement[id(original)] = record.compute_param
            if group.extension is not None:  # the object the entry holds now (RegisteredParams)
                group.extension.original_ids[index] = id(record.compute_param)
        group.original_params = []  # drop the meta parameters
    for _, submodule in _registry.owned_modules(module):
        for name, param in submodule._parameters.items():
            if param is not None and id(param) in replacement:
                submodule._parameters[name] = replacement[id(param)]
    _registry.pending_meta_units[module] = PendingUnit(
        groups, device, param_init_fn, tuple(members or ())
    )


def mark_initialized_by_user(module: nn.Module) -> None:
    """``to_empty`` after wrapping: the user initializes ``module``'s unit (no materialization)."""
    unit = _registry.pending_meta_units.pop(module, None)
    if unit is not None:
        for group in unit.groups:
            group.finish_materialization()


def materialize_hook(module: nn.Module, *args: Any) -> None:
    """State-dict and load-state-dict pre-hook of every unit."""
    materialize(module)


def materialize(root: nn.Module) -> None:
    """Give every pending unit in ``root``'s tree its values (see [Note: meta materialization]
    and [Note: initializers that cover a subtree]). Local: no collective. Cheap when nothing is
    pending."""
    pending = _registry.pending_meta_units
    if not pending:
        return
    roots, units = _pass_roots(root, pending)
    if not units:
        return
    owner: dict[int, PendingUnit] = {}
    for module, unit in units.values():
        for _, submodule in _registry.owned_modules(module):
            owner[id(submodule)] = unit
    pending_groups = {id(g) for _, unit in units.values() for g in unit.groups if g.pending_init}
    _refuse_tensor_parallel(units)
    pending_of: dict[int, list[tuple[str, str]]] = {}
    for module in (m for r in roots for m in r.modules()):
        if id(module) in owner:
            entries = _pending_entries(module, pending_groups)
            if entries:
                pending_of[id(module)] = entries

    def has_pending(module: nn.Module) -> bool:
        return id(module) in pending_of

    def may_cover(module: nn.Module) -> bool:
        unit = owner.get(id(module))
        return unit is not None and unit.param_init_fn is None

    # Everything that can refuse runs before anything is drawn or written.
    for walk_root in roots:
        refuse_unreproducible_inits(walk_root, has_pending, may_cover)
    calls = [c for r in roots for c in plan_init_calls(r, has_pending, may_cover)]
    covered = _covered_modules(calls)
    for call in calls:
        if has_pending(call.module) and id(call.module) not in covered:
            _check_initializer(call.name, call.module, owner[id(call.module)],
                               pending_of[id(call.module)][0])
    written: set[int] = set()  # records that got their value in this pass
    installed: list[_Installed] = []  # full-size values not yet written (see _Installed)
    try:
        for call in calls:
            unit = owner[id(call.module)]
            _install_module(call.name, call.module, unit, pending_groups, installed)
            if call.covering:
                _share_tied(installed)
            _run_initializer(call.module, unit)
            if call.commit:
                _commit(installed, written)
                installed.clear()
    finally:
        for entry in reversed(installed):  # an initializer raised: put the placeholders back
            entry.restore()
    for module, unit in units.values():
        for group in unit.groups:
            group.finish_materialization()
        del _registry.pending_meta_units[module]
        _check_nothing_left(module)


def _pass_roots(
    root: nn.Module, pending: Any
) -> tuple[list[nn.Module], dict[int, tuple[nn.Module, PendingUnit]]]:
    """The trees one pass walks, in order, and the pending units it materializes.

    A unit is in the pass when its module is in ``root``'s tree, or, for a unit wrapped from a
    list (its module is the internal holder, never in a model's tree), when any of its members
    is: then its members outside ``root``'s tree (a state dict of one member) are walked
    after ``root``, in the list's order, so the whole unit gets its values at once (a unit is
    materialized all or nothing: its members share one flat buffer)."""
    in_tree = {id(m) for m in root.modules()}
    roots = [root]
    units: dict[int, tuple[nn.Module, PendingUnit]] = {}
    for module, unit in list(pending.items()):
        if id(module) in in_tree:
            units[id(module)] = (module, unit)
        elif any(id(m) in in_tree for m in unit.members):
            units[id(module)] = (module, unit)
            roots.extend(m for m in unit.members if id(m) not in in_tree)
    return roots, units


def _refuse_tensor_parallel(units: dict[int, tuple[nn.Module, PendingUnit]]) -> None:
    """Tensor-parallel parameters built on meta are initialized by the user (``to_empty``, then
    the model's init through the DTensor parameters or a checkpoint load), as with FSDP2: a
    module's ``reset_parameters`` on a rank's TP-local piece would draw other values (and
    another fan-in) than on the whole parameter. Refused before anything is drawn or written."""
    for _, unit in units.values():
        for group in unit.groups:
            face_index = next((i for i, f in enumerate(group.tp_faces) if f is not None), None)
            if group.pending_init and face_index is not None:
                raise RuntimeError(
                    f"parameter '{group.fqns[face_index]}' is tensor-parallel and was built on "
                    "the meta device: fully_shard does not initialize tensor-parallel "
                    "parameters itself (reset_parameters on one rank's piece would not give "
                    "the whole parameter's values). Call model.to_empty(device=...) after "
                    "fully_shard and initialize the model (its init through the parameters, "
                    "or a checkpoint load), as with FSDP2; nothing was materialized"
                )


def _covered_modules(calls: list[InitCall]) -> set[int]:
    """Modules below a covering module: their parameters may be set by its ``reset_parameters``
    alone (checked after it ran, see ``_commit``)."""
    covered: set[int] = set()
    for call in calls:
        if call.covering:
            covered.update(id(m) for m in call.module.modules() if m is not call.module)
    return covered


def _pending_entries(module: nn.Module, pending_groups: set[int]) -> list[tuple[str, str]]:
    """(kind, key) of ``module``'s own parameters of pending groups and meta buffers."""
    entries = [
        ("parameter", key) for key, p in module._parameters.items()
        if p is not None and (record := _registry.record_of(p)) is not None
        and id(record.group) in pending_groups
    ]
    return entries + [
        ("buffer", key) for key, b in module._buffers.items()
        if b is not None and b.device.type == "meta"
    ]


def _check_initializer(
    name: str, module: nn.Module, unit: PendingUnit, first: tuple[str, str]
) -> None:
    if unit.param_init_fn is not None or callable(getattr(module, "reset_parameters", None)):
        return
    kind, key = first
    raise RuntimeError(
        f"{kind} '{_join(name, key)}' was built on the meta device and its module "
        f"({type(module).__name__}) has no reset_parameters() to initialize it; nothing was "
        "materialized. Pass param_init_fn=fn to fully_shard (fn(module) initializes that "
        "module's own parameters and buffers in place; called in module order), or call "
        "model.to_empty(device=...) after fully_shard and initialize the model yourself (in "
        "place through its parameters, or with checkpoint.load_full_state_dict)"
    )


@dataclass(eq=False)
class _Installed:
    """A full-size tensor put in a parameter entry for an initializer to write, until its value
    is written to the flat buffers (``_commit``) and ``placeholder`` (the unit's compute
    parameter) goes back in the entry. ``version``: the tensor's version counter when
    installed, to tell whether an initializer wrote it. A buffer materialized in a module
    without an initializer is tracked too (``record`` and ``placeholder`` None: it stays)."""

    name: str
    module: nn.Module
    key: str
    record: Any
    placeholder: nn.Parameter | None
    value: torch.Tensor
    version: int
    has_initializer: bool

    def current(self) -> torch.Tensor | None:
        entries = self.module._parameters if self.record is not None else self.module._buffers
        return entries[self.key]

    def restore(self) -> None:
        if self.placeholder is not None:
            self.module._parameters[self.key] = self.placeholder


def _install_module(
    name: str, module: nn.Module, unit: PendingUnit, pending_groups: set[int],
    installed: list[_Installed],
) -> None:
    """Replace ``module``'s meta buffers for good and put fresh full-size tensors in the entries of
    its pending parameters (entries that already hold one are left as they are)."""
    has_initializer = unit.param_init_fn is not None or callable(
        getattr(module, "reset_parameters", None)
    )
    for key, buffer in list(module._buffers.items()):
        if buffer is not None and buffer.device.type == "meta":
            value = torch.empty_like(buffer, device=unit.device)
            module._buffers[key] = value
            if not has_initializer:  # a covering module above must set it: checked
                installed.append(_Installed(_join(name, key), module, key, None, None, value,
                                            value._version, has_initializer))
    for key, param in module._parameters.items():
        record = _registry.record_of(param) if param is not None else None
        if record is None or id(record.group) not in pending_groups:
            continue
        group = record.group
        value = nn.Parameter(
            torch.empty(record.item.shape, dtype=group.param_dtype, device=group.device),
            requires_grad=record.dist_param.requires_grad,
        )
        assert param is not None
        installed.append(_Installed(_join(name, key), module, key, record, param, value,
                                    value._version, has_initializer))
        module._parameters[key] = value


def _share_tied(installed: list[_Installed]) -> None:
    """Before a covering ``reset_parameters``: a parameter tied between modules of its subtree
    is one tensor there, as after construction's tying, holding the first holder's value."""
    first: dict[int, _Installed] = {}
    for entry in installed:
        if entry.record is None:
            continue
        holder = first.setdefault(id(entry.record), entry)
        if holder is not entry and entry.current() is entry.value:
            entry.module._parameters[entry.key] = holder.value  # type: ignore[assignment]


def _run_initializer(module: nn.Module, unit: PendingUnit) -> None:
    with torch.no_grad():
        if unit.param_init_fn is not None:
            unit.param_init_fn(module)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()  # type: ignore[operator]
        # else: a module below a covering one, initialized by that one's reset_parameters


def _commit(installed: list[_Installed], written: set[int]) -> None:
    """Write each installed parameter's value to the flat buffers (the first holder of a tied
    parameter wins, as construction followed by tying) and put the placeholders back."""
    try:
        for entry in installed:
            value = entry.current()
            record = entry.record
            unwritten = value is entry.value and value._version == entry.version
            if record is None:  # a buffer of a module without an initializer
                if unwritten:
                    raise RuntimeError(
                        f"materializing buffer '{entry.name}': its module "
                        f"({type(entry.module).__name__}) has no reset_parameters() and the "
                        "reset_parameters() of the module above it that covers its subtree "
                        "did not write it. Initialize it there, give "
                        f"{type(entry.module).__name__} a reset_parameters(), or pass "
                        "param_init_fn"
                    )
                continue
            if value is None or value.shape != record.item.shape or value.device.type == "meta":
                raise RuntimeError(
                    f"materializing '{entry.name}': the initializer of "
                    f"{type(entry.module).__name__} left it as {_describe(value)}, expected a "
                    f"tensor of shape {tuple(record.item.shape)} on {record.group.device}; "
                    "initialize the parameter in place (nn.init.*, .copy_) instead of "
                    "replacing it"
                )
            if unwritten and not entry.has_initializer:
                raise RuntimeError(
                    f"materializing '{entry.name}': its module ({type(entry.module).__name__}) "
                    "has no reset_parameters() and the reset_parameters() of the module above "
                    "it that covers its subtree did not write it; nothing of that subtree was "
                    "materialized. Initialize it in that reset_parameters(), give "
                    f"{type(entry.module).__name__} a reset_parameters(), or pass param_init_fn"
                )
            if id(record) not in written:
                written.add(id(record))
                record.group.write_full_param(record.index, value)
    finally:
        for entry in reversed(installed):
            entry.restore()


def _check_nothing_left(module: nn.Module) -> None:
    for prefix, submodule in _registry.owned_modules(module):
        for kind, tensors in (("parameter", submodule._parameters), ("buffer", submodule._buffers)):
            for key, t in tensors.items():
                if t is not None and t.device.type == "meta":
                    raise RuntimeError(
                        f"{kind} '{_join(prefix, key)}' of the fully_shard unit "
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
