"""The DCP face of this library's uneven ``Shard(0)`` DTensors: chunk metadata at each rank's true
row offset, attached to the local tensors of state-dict DTensors, the row marker, and the pickling
fixes that keep such tensors saveable with ``torch.save``. No hooks (those are in
``_runtime/_state_dict_hooks.py``), no collectives.

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
(``optimizer_state_dict_post_hook`` in ``_runtime/_state_dict_hooks.py``, installed by
``_runtime/_optimizer_hooks.py``), and its
``load_state_dict`` post-hook strips what the optimizer adopts on load. So torch's own
``torch.distributed.checkpoint.state_dict`` API gives DCP-ready state dicts, and
``checkpoint.get_state_dict`` is a thin wrapper over it. The attached callables are module-level
classes; a marked tensor also gets an instance ``__getstate__`` that leaves them out, so
``torch.save`` of a state dict writes none of them (``torch.load(weights_only=True)`` works) and
DCP, which detaches tensors before serializing them, writes none either.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Shard

if TYPE_CHECKING:
    from ._row_layout import RowLayout

__all__ = [
    "ROWS_ATTR",
    "attach_chunk_metadata",
    "make_picklable",
    "mark_rows",
    "mark_unsupported",
    "row_mismatch",
    "skip_on_save",
    "strip_metadata",
]

# Set on the local tensor of a state-dict DTensor: the global rows (lo, hi) it holds.
ROWS_ATTR = "_mfsdp_rows"


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


def mark_unsupported(value: DTensor, message: str) -> None:
    """Make DCP (and only DCP) raise ``ValueError(message)`` when it asks ``value`` (a state-dict
    DTensor whose rows it cannot place) for its chunks or write items (see
    :class:`_Unsupported`)."""
    unsupported = _Unsupported(message)
    _mark(value._local_tensor, __create_chunk_list__=unsupported,
          __create_write_items__=unsupported)


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


def row_mismatch(value: DTensor, layout: RowLayout, key: str) -> str | None:
    """Why ``value`` does not follow the row sharding of the parameter laid out as ``layout``,
    or None."""
    shape, placements = layout.shape, layout.placements
    lo, hi = layout.rows
    local = value._local_tensor
    if (
        tuple(value.placements) != placements
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


def attach_chunk_metadata(value: DTensor, layout: RowLayout, key: str) -> None:
    """Give ``value`` (a ``Shard(0)`` DTensor shaped like the parameter laid out as ``layout`` in
    its first dimension) chunk metadata at this rank's true row offset. No-op for
    ``Replicate()``."""
    if not layout.row_sharded or not any(isinstance(p, Shard) for p in value.placements):
        return
    error = row_mismatch(value, layout, key)
    if error is not None:
        raise ValueError(error)
    lo, hi = layout.rows
    local = value._local_tensor
    offsets = (lo,) + (0,) * (value.dim() - 1)
    if layout.tp_offsets is not None:  # rows of the TP-local tensor, at TP's own offsets
        offsets = tuple(a + b for a, b in zip(offsets, layout.tp_offsets))
    sizes = tuple(local.shape)
    _mark(
        local,
        __create_chunk_list__=_ChunkList(offsets, sizes),
        __create_write_items__=_WriteItems(offsets, sizes),
        **{ROWS_ATTR: (lo, hi)},
    )
