"""State-dict plumbing behind ``checkpoint.py``: chunk metadata for uneven ``Shard(0)`` DTensors,
the ``state_dict``/``load_state_dict`` hooks every unit registers, and shape/key validation. No
collectives (full state dicts: ``_full_state_dict.py``; agreement: ``_checkpoint_group.py``).

[Note: uneven shards in state dicts]
A unit's DTensor parameters are ``Shard(0)`` over rows that follow the flat-buffer layout, not
``torch.chunk``: rank ``r`` holds rows ``group.local_row_range(i)`` of parameter ``i``, possibly
none. DTensor's own offset math (``compute_local_shape_and_global_offset``) would assume
``torch.chunk`` rows, so a DCP save or load through it would write or read the wrong rows
silently. ``torch.distributed.checkpoint`` asks a DTensor's *local tensor* for
``__create_chunk_list__`` / ``__create_write_items__`` first, so we attach those to the local
tensor of every such DTensor in a state dict (:func:`attach_chunk_metadata`): one chunk at row
offset ``lo``, or no chunk at all for an empty shard (an empty chunk inside another rank's range
would trip DCP's overlap check). ``Replicate()`` DTensors (``no_shard``) need nothing: DTensor's
default (one full chunk at offset 0, deduplicated on save) is right.

On a 2-D (HSDP) mesh with outer ``no_shard`` the DTensors are ``(Replicate(), Shard(0))`` and
every replica along the outer axis holds the same inner rows ``local_row_range(i)``, so the R
replicas of a chunk carry the same offsets: DCP's save planner de-duplicates write items by
(key, offset), so each chunk is written once, and on load every replica plans a read of its
rows. ``(Replicate(), Replicate())`` (inner ``no_shard``) needs nothing, as on a 1-D mesh.
With outer ``optim`` the DTensors are ``(Shard(0), Shard(0))`` and rank (outer ``r``, inner
``s``) holds the rows of its own sub-shard ``s * R + r`` of the flat buffer
(``local_row_range(i)``, from the plan's ``main_weight_span``): every chunk is distinct, so each
rank writes and reads its own rows (none for an empty sub-shard), exactly as on a 1-D mesh of
``R * S`` ranks; DTensor's offset math (outer-then-inner ``torch.chunk``) is wrong here too.

Only state-dict tensors are marked, never live parameters or optimizer states: state dicts hold
detached aliases. The module side is the units' ``state_dict`` post-hook; the optimizer side is
a ``state_dict`` post-hook on every optimizer that holds managed parameters
(:func:`optimizer_state_dict_post_hook`, installed by ``_optimizer_hooks.py``), and its
``load_state_dict`` post-hook strips what the optimizer adopts on load. So torch's own
``torch.distributed.checkpoint.state_dict`` API gives DCP-ready state dicts, and
``checkpoint.get_state_dict`` is a thin wrapper over it. The attached callables are module-level
classes; a marked tensor also gets an instance ``__getstate__`` that leaves them out, so
``torch.save`` of a state dict writes none of them (``torch.load(weights_only=True)`` works) and
DCP, which detaches tensors before serializing them, writes none either.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import _registry
from .._buffers._plan import Extent
from .._runtime._flat_param_group import FlatParamGroup

__all__ = [
    "ROWS_ATTR",
    "attach_chunk_metadata",
    "make_picklable",
    "mark_rows",
    "dist_param_slots",
    "expected_entries",
    "first_mismatch",
    "is_row_sharded",
    "load_state_dict_pre_hook",
    "local_rows_dtensor",
    "param_slot",
    "mark_all_loaded",
    "optimizer_load_state_dict_post_hook",
    "optimizer_state_dict_post_hook",
    "skip_on_save",
    "strip_metadata",
    "state_dict_post_hook",
]

# Set on the local tensor of a state-dict DTensor: the global rows (lo, hi) it holds.
ROWS_ATTR = "_mfsdp_rows"


# ---------------------------------------------------------------------- chunk metadata

class _ChunkList:
    """``__create_chunk_list__`` of a local tensor holding rows ``[offsets[0], +sizes[0])``."""

    def __init__(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
        self.offsets = offsets
        self.sizes = sizes

    def __call__(self) -> list[ChunkStorageMetadata]:
        if self.sizes[0] == 0:
            return []
        offsets, sizes = torch.Size(self.offsets), torch.Size(self.sizes)
        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes)]


class _WriteItems(_ChunkList):
    """``__create_write_items__(fqn, dtensor)``: one shard write item at the true row offset."""

    def __call__(self, fqn: str, obj: Any) -> list[WriteItem]:  # type: ignore[override]
        if self.sizes[0] == 0:
            return []
        offsets, sizes = torch.Size(self.offsets), torch.Size(self.sizes)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=TensorProperties.create_from_tensor(obj.to_local()),
                    size=obj.size(),
                ),
            )
        ]


class _NoWriteItems:
    """``__create_write_items__`` of a tensor this rank must not write (see
    :func:`skip_on_save`)."""

    def __call__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return []


class _Unsupported:
    """``__create_chunk_list__`` / ``__create_write_items__`` of an optimizer state that does not
    follow its parameter's row sharding: DCP cannot place its rows, so DCP (and only DCP) gets
    the error; a plain ``optimizer.state_dict()`` stays usable."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __call__(self, *args: Any) -> list[Any]:
        raise ValueError(self.message)


class _PickleWithout:
    """Instance ``__getstate__`` of a marked tensor (see [Note: uneven shards in state dicts]):
    ``Tensor.__reduce_ex__`` pickles what ``__getstate__`` returns, so ``torch.save`` of a
    state dict writes the tensor without our attributes, and ``torch.load(weights_only=True)``
    never meets our classes. Weak, so a state dict does not keep its aliases in a cycle."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = weakref.ref(tensor)

    def __call__(self) -> dict[str, Any]:
        tensor = self.tensor()
        if tensor is None:
            return {}
        return {k: v for k, v in tensor.__dict__.items() if k not in _METADATA_ATTRS}


class _ReduceAsWrapper:
    """Instance ``__reduce_ex__`` of a state-dict DTensor whose local tensor views a flat buffer
    at a non-zero offset. DTensor's wrapper copies that offset, so ``Tensor.__reduce_ex__`` sees
    a non-zero ``data_ptr()`` and pickles it as a plain tensor, which fails ("invalid python
    storage"): ``torch.save(model.state_dict())`` would raise. This is torch's own reduction of
    wrapper subclasses at offset 0; the local tensor and spec go in the state unchanged. Weak,
    like :class:`_PickleWithout`."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = weakref.ref(tensor)

    def __call__(self, protocol: int) -> tuple[Any, ...]:
        tensor = self.tensor()
        assert tensor is not None  # it is being pickled
        args = (type(tensor), tensor.dtype, tuple(tensor.size()), tensor.stride(), 0,
                tensor.layout, tensor.device, tensor.requires_grad)
        # (__dict__, slots) for DTensor (its local tensor and spec are slots), or __dict__.
        state = torch._utils._get_obj_state(tensor)
        if isinstance(state, tuple):
            state = ({k: v for k, v in state[0].items() if k != "__reduce_ex__"}, *state[1:])
        else:
            state = {k: v for k, v in state.items() if k != "__reduce_ex__"}
        tensor._clear_non_serializable_cached_data()  # as Tensor.__reduce_ex__ does
        return (torch._tensor._rebuild_from_type_v2,
                (torch._utils._rebuild_wrapper_subclass, type(tensor), args, state))


def make_picklable(value: DTensor) -> None:
    """Let ``torch.save`` pickle ``value`` (a detached state-dict DTensor) although its local
    tensor views a flat buffer at an offset (see :class:`_ReduceAsWrapper`)."""
    if value.storage_offset() != 0 and "__reduce_ex__" not in value.__dict__:
        value.__reduce_ex__ = _ReduceAsWrapper(value)  # type: ignore[method-assign]


_METADATA_ATTRS = ("__create_chunk_list__", "__create_write_items__", ROWS_ATTR, "__getstate__")


def _mark(tensor: torch.Tensor, **attrs: Any) -> None:
    """Set our attributes on ``tensor``, keeping them out of its pickles."""
    for name, value in attrs.items():
        setattr(tensor, name, value)
    if not isinstance(tensor.__dict__.get("__getstate__"), _PickleWithout):
        tensor.__getstate__ = _PickleWithout(tensor)  # type: ignore[attr-defined]


def mark_rows(tensor: torch.Tensor, rows: tuple[int, int]) -> None:
    """Mark the local tensor of a state-dict DTensor as holding global rows ``rows``: load
    pre-hooks and DTensor ``copy_`` then take it as the model's own layout."""
    _mark(tensor, **{ROWS_ATTR: rows})


def skip_on_save(value: torch.Tensor) -> None:
    """Make ``dcp.save`` skip this rank's copy of a plain (replicated) tensor; it still loads."""
    _mark(value, __create_write_items__=_NoWriteItems())


def strip_metadata(tensors: Any) -> None:
    """Remove what this module attached from every tensor (and DTensor's local tensor) in a
    nested container, e.g. an optimizer's ``state`` after it adopted loaded tensors, so live
    tensors never carry our attributes (which ``torch.load(weights_only=True)`` would reject)."""
    if isinstance(tensors, dict):
        for value in tensors.values():
            strip_metadata(value)
    elif isinstance(tensors, (list, tuple)):
        for value in tensors:
            strip_metadata(value)
    elif isinstance(tensors, torch.Tensor):
        targets = [tensors] + ([tensors._local_tensor] if isinstance(tensors, DTensor) else [])
        for target in targets:
            for attr in _METADATA_ATTRS:
                ours = attr != "__getstate__" or isinstance(
                    target.__dict__.get(attr), _PickleWithout
                )
                if attr in target.__dict__ and ours:
                    delattr(target, attr)


def is_row_sharded(group: FlatParamGroup) -> bool:
    # SHARD (1-D, HSDP outer no_shard) or SUB_SHARD (HSDP outer optim).
    return group.plan.optimizer_placement is not Extent.FULL


def _row_mismatch(value: DTensor, group: FlatParamGroup, index: int, key: str) -> str | None:
    """Why ``value`` does not follow the row sharding of parameter ``index``, or None."""
    shape = group.layout.items[index].shape
    lo, hi = group.local_row_range(index)
    local = value._local_tensor
    if (
        tuple(value.placements) != tuple(group._placements)
        or value.dim() == 0
        or value.shape[0] != shape[0]
        or local.dim() != value.dim()
        or local.shape[0] != hi - lo
    ):
        return (
            f"state-dict entry '{key}' is a DTensor of shape {tuple(value.shape)} (local "
            f"{tuple(local.shape)}, placements {value.placements}) that does not follow the "
            f"row sharding of its parameter (shape {tuple(shape)}, local rows {lo}..{hi}); "
            "megatron_fsdp_v2 can only checkpoint optimizer states shaped like their parameter "
            "in the first dimension"
        )
    return None


def attach_chunk_metadata(value: DTensor, group: FlatParamGroup, index: int, key: str) -> None:
    """Give ``value`` (a ``Shard(0)`` DTensor shaped like parameter ``index`` of ``group`` in its
    first dimension) chunk metadata at this rank's true row offset. No-op for ``Replicate()``."""
    if not is_row_sharded(group) or not any(isinstance(p, Shard) for p in value.placements):
        return
    error = _row_mismatch(value, group, index, key)
    if error is not None:
        raise ValueError(error)
    lo, hi = group.local_row_range(index)
    local = value._local_tensor
    offsets = (lo,) + (0,) * (value.dim() - 1)
    sizes = tuple(local.shape)
    _mark(
        local,
        __create_chunk_list__=_ChunkList(offsets, sizes),
        __create_write_items__=_WriteItems(offsets, sizes),
        **{ROWS_ATTR: (lo, hi)},
    )


def param_slot(param: nn.Parameter) -> tuple[FlatParamGroup, int]:
    """The parameter group and index behind a managed DTensor parameter."""
    record = _registry.record_of(param)
    assert record is not None
    return record.group, record.index


def dist_param_slots(module: nn.Module) -> dict[str, nn.Parameter]:
    """Every name (tied parameters under each of theirs) of a DTensor parameter managed by a
    unit, relative to ``module``. Outside forward/backward, where the DTensors are registered."""
    return {
        name: param
        for name, param in module.named_parameters(remove_duplicate=False)
        if _registry.record_of(param) is not None
    }


# ---------------------------------------------------------------------- module hooks

def state_dict_post_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """``module.state_dict()`` holds detached DTensor views of the main weights: attach the chunk
    metadata of this unit's parameters, so the result can go straight to ``dcp.save``."""
    state = _registry.state_of(module)
    if state is None:
        return
    own = {id(g) for g in state.groups}
    for name, param in dist_param_slots(module).items():
        group, index = param_slot(param)
        value = state_dict.get(prefix + name)
        # keep_vars=True returns the live parameters: leave them alone (see strip_metadata).
        if id(group) in own and isinstance(value, DTensor) and not isinstance(value, nn.Parameter):
            attach_chunk_metadata(value, group, index, prefix + name)
            make_picklable(value)
            rows = value._local_tensor.__dict__.get(ROWS_ATTR)
            if rows is not None:
                # On the DTensor itself too, where pickling keeps it (a tuple of ints): an entry
                # saved with torch.save and loaded on the same layout is recognized as the
                # model's own rows (``_incoming_rows``).
                setattr(value, ROWS_ATTR, rows)


# ---------------------------------------------------------------------- optimizer hooks

def _optimizer_state_alias(
    value: Any, group: FlatParamGroup, index: int, key: str
) -> Any:
    """A detached alias of one optimizer state value, marked for DCP (see
    :func:`optimizer_state_dict_post_hook`); non-tensors as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    alias = value.detach()  # same storage: dcp.load writes into the live state
    if isinstance(alias, DTensor):
        if not is_row_sharded(group) or not any(isinstance(p, Shard) for p in alias.placements):
            return alias
        error = _row_mismatch(alias, group, index, key)
        if error is None:
            attach_chunk_metadata(alias, group, index, key)
        else:
            unsupported = _Unsupported(error)
            _mark(alias._local_tensor, __create_chunk_list__=unsupported,
                  __create_write_items__=unsupported)
    elif is_row_sharded(group):
        lo, hi = group.local_row_range(index)
        if hi == lo:
            skip_on_save(alias)
    return alias


def optimizer_state_dict_post_hook(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> dict[str, Any]:
    """``optimizer.state_dict()`` of an optimizer that holds managed parameters: the state of
    each such parameter becomes a new dict of detached aliases (same storage, so ``dcp.load``
    through ``torch.distributed.checkpoint.state_dict`` still writes the live state; the live
    tensors stay unmarked), with chunk metadata at the true row offset on the DTensor states of
    row-sharded parameters. A plain tensor state (Adam's ``step``) of a parameter this rank
    holds no rows of is marked not to be written by this rank: such a rank never steps that
    parameter, so its copy may be stale, while every rank with rows has the current value
    (DCP keeps one copy of a plain tensor). Pickling drops all marks (``_PickleWithout``)."""
    state = state_dict.get("state")
    if not isinstance(state, dict):
        return state_dict
    for group_live, group_packed in zip(optimizer.param_groups, state_dict["param_groups"]):
        for param, pid in zip(group_live["params"], group_packed["params"]):
            record = _registry.record_of(param)
            entries = state.get(pid)
            # The compute parameter of a stale optimizer has no rows to mark.
            if record is None or param is record.compute_param or not isinstance(entries, dict):
                continue
            state[pid] = {
                name: _optimizer_state_alias(
                    value, record.group, record.index, f"state.{record.fqn}.{name}"
                )
                for name, value in entries.items()
            }
    return state_dict


def optimizer_load_state_dict_post_hook(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.load_state_dict``: the optimizer may have adopted marked aliases (a
    state dict from :func:`optimizer_state_dict_post_hook`, filled by ``dcp.load``) as its live
    state; unmark them."""
    strip_metadata(optimizer.state)


def expected_entries(module: nn.Module, prefix: str = "") -> dict[str, torch.Size | None]:
    """What ``module.state_dict()`` holds, keyed like it: the global shape of each tensor entry
    (tied parameters under each name), ``None`` for a non-tensor one (``_extra_state``)."""
    return {
        key: value.shape if isinstance(value, torch.Tensor) else None
        for key, value in module.state_dict(prefix=prefix, keep_vars=True).items()
    }


def first_mismatch(
    expected: Mapping[str, torch.Size | None],
    found: Mapping[str, torch.Size | None],
    *,
    strict: bool,
    what: str = "checkpoint",
) -> str | None:
    """The first problem between the model's entries and a checkpoint's, in model order:
    a shape mismatch, then (strict) a missing key, then (strict) an unexpected key.
    ``found[key] is None`` marks a non-tensor entry where a tensor is expected."""
    for key, shape in expected.items():
        if key not in found:
            if strict:
                wanted = f" (the model expects shape {tuple(shape)})" if shape is not None else ""
                return (
                    f"{what} has no entry '{key}'{wanted}; was it saved from a different model? "
                    "(strict=False skips missing entries)"
                )
            continue
        if shape is None:  # a non-tensor entry: presence is all we can check
            continue
        got = found[key]
        if got is None:
            return f"{what} entry '{key}' is not a tensor; the model expects shape {tuple(shape)}"
        if tuple(got) != tuple(shape):
            return (
                f"{what} entry '{key}' has shape {tuple(got)} but the model expects "
                f"{tuple(shape)}"
            )
    if strict:
        for key in found:
            if key not in expected:
                return f"{what} has an unexpected entry '{key}' that the model does not have"
    return None


def _tensor_shape(value: Any) -> torch.Size | None:
    return value.shape if isinstance(value, torch.Tensor) else None


def local_rows_dtensor(param: nn.Parameter, full: torch.Tensor, copy: bool = False) -> DTensor:
    """This rank's part of ``full`` (a whole, unsharded tensor shaped like ``param``) as a DTensor
    with ``param``'s placements and layout, ready for ``param.copy_``; ``copy``: own its rows
    instead of viewing ``full``."""
    group, index = param_slot(param)
    dparam: DTensor = param  # type: ignore[assignment]
    local = dparam._local_tensor
    if is_row_sharded(group):
        lo, hi = group.local_row_range(index)
        rows = full[lo:hi]
    else:
        lo, hi = 0, full.shape[0]
        rows = full
    rows = rows.to(device=local.device, copy=copy)
    out = DTensor.from_local(
        rows, dparam.device_mesh, dparam.placements, run_check=False, shape=dparam.shape,
        stride=dparam.stride(),
    )
    _mark(out._local_tensor, **{ROWS_ATTR: (lo, hi)})
    return out


def _incoming_rows(value: DTensor) -> tuple[int, int]:
    """The global rows a ``Shard(0)`` DTensor's local tensor holds: ours when it carries our chunk
    metadata, else DTensor's own (``torch.chunk``) layout."""
    rows = getattr(value._local_tensor, ROWS_ATTR, None) or value.__dict__.get(ROWS_ATTR)
    if rows is not None:
        return tuple(rows)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    return offsets[0], offsets[0] + sizes[0]


def _carries_rows(value: DTensor) -> bool:
    """Whether ``value`` came from this library's state dicts (it names its rows)."""
    return hasattr(value._local_tensor, ROWS_ATTR) or ROWS_ATTR in value.__dict__


def _convert_for_load(key: str, param: nn.Parameter, value: Any) -> Any:
    """Turn a full tensor, or a DTensor laid out differently but convertible without
    communication, into a DTensor with ``param``'s exact layout."""
    group, index = param_slot(param)
    dparam: DTensor = param  # type: ignore[assignment]
    if not isinstance(value, DTensor):
        return local_rows_dtensor(param, value.detach())
    if value.device_mesh != dparam.device_mesh:
        raise ValueError(
            f"state-dict entry '{key}' is a DTensor on mesh {value.device_mesh}, but the model's "
            f"parameter lives on {dparam.device_mesh}; load sharded checkpoints of another "
            "layout through megatron_fsdp_v2.checkpoint.load (torch.distributed.checkpoint)"
        )
    if all(isinstance(p, Replicate) for p in value.placements):
        return local_rows_dtensor(param, value._local_tensor.detach())
    lo, hi = group.local_row_range(index) if is_row_sharded(group) else (0, dparam.shape[0])
    if value.placements == dparam.placements and _incoming_rows(value) == (lo, hi):
        return value
    if value.placements == dparam.placements and not _carries_rows(value):
        # DTensor's own layout (``distribute_tensor``: torch's set_model_state_dict with
        # full_state_dict=True): the copy_ handler of _redistribute.py gathers it and keeps our
        # rows, deciding on every rank alike (whether the rows match here is a local fact, see
        # [Note: uneven redistribution]).
        return value
    raise ValueError(
        f"state-dict entry '{key}' is a DTensor sharded as {value.placements} with rows "
        f"{_incoming_rows(value)} on this rank, but the model holds rows {lo}..{hi} "
        f"({dparam.placements}); a sharded state dict of another world size or layout must be "
        "loaded through megatron_fsdp_v2.checkpoint.load (torch.distributed.checkpoint), or "
        "exported with get_full_state_dict and loaded with load_full_state_dict"
    )


def load_state_dict_pre_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
    strict: bool, missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
) -> None:
    """Before ``load_state_dict`` writes anything into this unit's subtree: check the shape of
    every entry (a ``ValueError`` naming the first mismatching key), then make the entries of
    this unit's parameters loadable in place (full tensors and ``Replicate()`` DTensors become
    this rank's rows). The root unit runs first and sees every key, so a bad state dict is
    rejected before any parameter is touched. Missing/unexpected keys are left to
    ``load_state_dict``'s own ``strict`` handling."""
    if local_metadata.get("assign_to_params_buffers", False):
        raise ValueError(
            "load_state_dict(assign=True) would replace the DTensor parameters that view "
            "fully_shard's flat buffers; load with assign=False"
        )
    if torch.__future__.get_swap_module_params_on_conversion():
        raise ValueError(
            "load_state_dict with torch.__future__.set_swap_module_params_on_conversion(True) "
            "would swap out the DTensor parameters that view fully_shard's flat buffers; "
            "turn it off around the load"
        )
    found = {k: _tensor_shape(v) for k, v in state_dict.items() if k.startswith(prefix)}
    expected = expected_entries(module, prefix)
    error = first_mismatch(expected, found, strict=False, what="state dict")
    if error is not None:
        raise ValueError(error)
    state = _registry.state_of(module)
    if state is None:
        return
    own = {id(g) for g in state.groups}
    for name, param in dist_param_slots(module).items():
        key = prefix + name
        if key in state_dict and id(param_slot(param)[0]) in own:
            state_dict[key] = _convert_for_load(key, param, state_dict[key])


def mark_all_loaded(module: nn.Module) -> None:
    """Every unit in ``module``'s tree refreshes its compute weights before the next use."""
    for m in module.modules():
        state = _registry.state_of(m)
        if state is not None:
            for group in state.groups:
                group.mark_main_weights_updated()
