"""Local-rows DTensors: this rank's rows of a whole tensor as a DTensor laid out like a managed
parameter (``local_row_range``, not ``torch.chunk``), which rows an incoming state-dict DTensor
holds, and the conversion of a state-dict entry into the parameter's exact layout for
``load_state_dict`` (no communication; see [Note: uneven shards in state dicts] in
``_chunk_metadata.py``). Each function takes the parameter's :class:`RowLayout`
(``ParamRecord.row_layout``) from its caller.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from ._chunk_metadata import ROWS_ATTR, mark_rows
from ._row_layout import RowLayout

__all__ = ["convert_for_load", "local_rows_dtensor"]


def local_rows_dtensor(
    param: nn.Parameter, layout: RowLayout, full: torch.Tensor, copy: bool = False
) -> DTensor:
    """This rank's part of ``full`` (a whole, unsharded tensor shaped like ``param``, laid out as
    ``layout``) as a DTensor with ``param``'s placements and layout, ready for ``param.copy_``;
    ``copy``: own its rows instead of viewing ``full``."""
    dparam: DTensor = param  # type: ignore[assignment]
    local = dparam._local_tensor
    if layout.row_sharded:
        lo, hi = layout.rows
        rows = full[lo:hi]
    else:
        lo, hi = 0, full.shape[0]
        rows = full
    rows = rows.to(device=local.device, copy=copy)
    out = DTensor.from_local(
        rows, dparam.device_mesh, dparam.placements, run_check=False, shape=dparam.shape,
        stride=dparam.stride(),
    )
    mark_rows(out._local_tensor, (lo, hi))
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


def convert_for_load(key: str, param: nn.Parameter, layout: RowLayout, value: Any) -> Any:
    """Turn a full tensor, or a DTensor laid out differently but convertible without
    communication, into a DTensor with ``param``'s exact layout (``layout``)."""
    dparam: DTensor = param  # type: ignore[assignment]
    if not isinstance(value, DTensor):
        return local_rows_dtensor(param, layout, value.detach())
    if value.device_mesh != dparam.device_mesh:
        raise ValueError(
            f"state-dict entry '{key}' is a DTensor on mesh {value.device_mesh}, but the model's "
            f"parameter lives on {dparam.device_mesh}; load sharded checkpoints of another "
            "layout through megatron_fsdp_v2.checkpoint.load (torch.distributed.checkpoint)"
        )
    if all(isinstance(p, Replicate) for p in value.placements):
        return local_rows_dtensor(param, layout, value._local_tensor.detach())
    lo, hi = layout.rows if layout.row_sharded else (0, dparam.shape[0])
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
