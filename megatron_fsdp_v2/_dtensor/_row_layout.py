"""``RowLayout``: where one managed parameter's rows sit on this rank, as a small value.

The DTensor paths of state dicts and checkpoints (``_chunk_metadata.py``, ``_local_rows.py``)
need only this of a parameter: whether its optimizer-facing DTensor holds rows of its own, which
global rows, its placements and shape, and, under tensor parallelism, where the
TP-local tensor sits. The layer that owns the parameter's flat group builds it once per
parameter (``ParamRecord.row_layout``) and hands it down, so nothing below the runtime looks a
group up or reads its plan."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import Placement

__all__ = ["RowLayout"]


@dataclass(frozen=True)
class RowLayout:
    """One managed parameter's rows on this rank (see the module docstring)."""

    # The optimizer-facing DTensor holds rows of its own on each rank (a Shard(0) of the flat
    # group's optimizer placement); False: every rank holds every row (Replicate()).
    row_sharded: bool
    # Global dim-0 rows of this rank's shard (of the TP-local tensor, under tensor parallelism).
    rows: tuple[int, int]
    # The whole parameter's shape (under tensor parallelism too).
    shape: torch.Size
    # The optimizer-facing DTensor's placements.
    placements: tuple[Placement, ...]
    # Under tensor parallelism: where this rank's TP-local tensor starts in the whole parameter.
    tp_offsets: tuple[int, ...] | None = None
