"""Flat-buffer layout math: where each parameter lives in a flat group and which rows each rank
owns.

Pure functions over shapes and the world size. No tensors are allocated here and nothing talks to
``torch.distributed``.

[Note: row-aligned flat buffers]
A flat group is stored as one flat 1-D buffer of ``world_size * shard_numel`` elements. Rank
``r`` owns the contiguous span ``[r * shard_numel, (r + 1) * shard_numel)`` of every buffer role
(model weights, main weights, main grads), which is exactly the slot that
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` assign to it, so collectives run on the
flat buffers directly and compute parameters are zero-copy views into the unsharded buffer.

For ``Shard(0)`` to describe a rank's piece of a parameter truthfully, no shard boundary may cut a
row (``shape[1:].numel()`` elements). Fused and vectorized kernels (Apex/TE LayerNorm, Triton
kernels with ``multiple_of`` hints, 128-bit loads) and NCCL want every view and slot they get
to start on a 16-byte boundary; a single odd-length 1-D parameter packed back to back would
move every later view, shard and slot off it ("misaligned address", or a slow scalar path).
We guarantee both by

* placing every parameter at an offset that is a multiple of ``lcm(row size, ALIGN_NUMEL)``, and
* making ``shard_numel`` a multiple of ``shard_multiple = lcm(row_lcm, ALIGN_NUMEL)``, where
  ``row_lcm`` is the least common multiple of all row sizes.

Then every boundary ``k * shard_numel`` is a multiple of each row size, and since each parameter
starts on a multiple of its row size, each boundary it crosses falls between two of its rows.

At world size 1 there is no boundary to keep whole rows at: offsets and ``shard_numel`` are
multiples of ``ALIGN_NUMEL`` only (the buffer's end still is, because a coalesced bucket places
the next group's buffer there).

``ALIGN_NUMEL`` is counted in *elements*, not bytes, because one layout serves every buffer of a
group and their dtypes differ (fp32 main weights and grads, bf16 model weights, bf16 or fp32
reduce-scatter scratch buffers; fp8 model weights later). 16 elements are 16 bytes for the smallest
element (1 byte) and more for the others, so every item start, every rank's slot start and every
buffer length is 16-byte aligned in every role, whatever dtypes the group uses, and adding a
role never changes the layout (a role's own buffer base is a fresh allocation: aligned). Row
sizes that are multiples of 16 (transformer widths) make ``lcm(row, 16) == row``: nothing
changes for them; a 1-D parameter costs at most 15 elements of gap; an odd row size ``R`` makes
the shard multiple ``16 * R`` (a longer tail, see design.md section 2). Every other view at an
element offset of a flat buffer or scratch buffer sits at a sum of these multiples and stays
aligned: slots and columns of the coalesced reduction and refresh buckets (``_coalesce.py``,
``_refresh_buckets.py``: multiples of ``shard_numel`` and of buffer lengths), and each trace-pool
scratch buffer starts at an ``ARENA_ALIGNMENT``-byte offset of its arena (``_trace_pool.py``).
``tests/distributed/test_alignment.py`` checks the pointers of every role and slot.

Parameters are placed in order of decreasing row size (1-D parameters, whose rows are single
elements, last), so the gaps between matrices are usually empty; each 1-D parameter whose length
is not a multiple of ``ALIGN_NUMEL`` leaves a gap of fewer than ``ALIGN_NUMEL`` elements.

The cost is padding: alignment gaps plus the tail that rounds the buffer up to
``world_size * shard_multiple``. When heterogeneous row sizes make ``row_lcm`` large enough that
the padding exceeds ``max_padding_ratio``, :func:`split_for_padding` splits the group into
several groups with compatible row sizes; each is an independent set of flat buffers with its
own collectives. (They are flat groups, not buckets: a bucket is a run of consecutive groups whose
collectives are coalesced into one, ``_coalesce.py``; the allocator's temporary buffers are scratch
buffers, ``_allocator.py``.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "ALIGN_NUMEL", "ItemLayout", "BufferLayout", "build_layout", "split_for_padding", "row_numel",
]

ALIGN_NUMEL = 16
"""Elements every item start and shard boundary is a multiple of: 16 bytes for 1-byte dtypes
(fp8), more for wider ones (see [Note: row-aligned flat buffers])."""


def row_numel(shape: torch.Size | Sequence[int]) -> int:
    """Elements in one dim-0 row of a tensor of ``shape`` (1 for 1-D tensors). A zero-width row
    (e.g. ``nn.Linear(0, n).weight``, shape ``(n, 0)``) counts as 1: the tensor has no elements,
    so any alignment works, and the layout math never divides by zero."""
    return max(math.prod(shape[1:]), 1) if len(shape) > 1 else 1


def _align_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _shard_multiple(row_lcm: int, world_size: int) -> int:
    # One rank has no boundary to keep whole rows at, but its buffer's end must stay aligned.
    return math.lcm(row_lcm, ALIGN_NUMEL) if world_size > 1 else ALIGN_NUMEL


@dataclass(frozen=True)
class ItemLayout:
    """One parameter inside a flat buffer."""

    # Start in the (unsharded) flat buffer: a multiple of ALIGN_NUMEL and, with world_size > 1,
    # of row_numel.
    offset: int
    numel: int
    shape: torch.Size
    row_numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class BufferLayout:
    """The layout of one flat buffer: items (in the caller's order) and the shard size."""

    items: tuple[ItemLayout, ...]
    world_size: int
    shard_numel: int  # elements each rank owns; a multiple of shard_multiple
    row_lcm: int

    @property
    def shard_multiple(self) -> int:
        """What ``shard_numel`` is a multiple of: ``ALIGN_NUMEL`` and, when there are rank
        boundaries (``world_size > 1``), every row size."""
        return _shard_multiple(self.row_lcm, self.world_size)

    @property
    def total_numel(self) -> int:
        return self.world_size * self.shard_numel

    @property
    def content_numel(self) -> int:
        return sum(item.numel for item in self.items)

    @property
    def padding_numel(self) -> int:
        return self.total_numel - self.content_numel

    @property
    def padding_ratio(self) -> float:
        """Padding over useful elements (0.0 when the buffer is exactly full)."""
        return self.padding_numel / max(self.content_numel, 1)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The ``[start, end)`` span of the flat buffer that ``rank`` owns."""
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def local_item_range(self, index: int, start: int, end: int) -> tuple[int, int]:
        """The part of item ``index`` inside the span ``[start, end)``, in flat-buffer offsets.

        Returns an empty range ``(s, s)`` when the item does not intersect the span.
        """
        item = self.items[index]
        lo, hi = max(item.offset, start), min(item.end, end)
        return (lo, hi) if lo < hi else (lo, lo)

    def uncovered_ranges(self) -> list[tuple[int, int]]:
        """Spans that belong to no item (alignment gaps and tail padding), sorted."""
        gaps: list[tuple[int, int]] = []
        cursor = 0
        for item in sorted(self.items, key=lambda it: it.offset):
            if item.offset > cursor:
                gaps.append((cursor, item.offset))
            cursor = max(cursor, item.end)
        if cursor < self.total_numel:
            gaps.append((cursor, self.total_numel))
        return gaps


def build_layout(shapes: Sequence[torch.Size], world_size: int) -> BufferLayout:
    """Lay out tensors of ``shapes`` in one row-aligned flat buffer sharded over ``world_size``.

    See [Note: row-aligned flat buffers].
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    rows = [row_numel(s) for s in shapes]
    numels = [math.prod(s) for s in shapes]
    # Larger rows first keeps the alignment gaps empty for transformer-shaped groups.
    placement_order = sorted(range(len(shapes)), key=lambda i: (-rows[i], i))
    offsets = [0] * len(shapes)
    cursor = 0
    for i in placement_order:
        # One rank has no boundary that could cut a row: its items need only the alignment.
        alignment = math.lcm(rows[i], ALIGN_NUMEL) if world_size > 1 else ALIGN_NUMEL
        offsets[i] = _align_up(cursor, alignment)
        if numels[i]:  # an empty tensor leaves no gap behind it
            cursor = offsets[i] + numels[i]
    row_lcm = math.lcm(*rows) if rows else 1
    multiple = _shard_multiple(row_lcm, world_size)
    shard_numel = _align_up(max(cursor, 1), world_size * multiple) // world_size
    items = tuple(
        ItemLayout(offsets[i], numels[i], torch.Size(shapes[i]), rows[i])
        for i in range(len(shapes))
    )
    return BufferLayout(items, world_size, shard_numel, row_lcm)


def split_for_padding(
    shapes: Sequence[torch.Size], world_size: int, max_padding_ratio: float = 0.01
) -> list[list[int]]:
    """Split the indices of ``shapes`` into parts whose layouts keep padding small.

    One part when its padding ratio is at most ``max_padding_ratio``. Otherwise tensors are
    split by row size (1-D tensors join the largest part) and parts are merged greedily, as
    long as a merge stays within the ratio. The split is kept only if it pads less in total
    than one part: tiny groups whose padding is dominated by the ``world_size *
    shard_multiple`` rounding stay as one part (splitting them only adds collectives), and so
    does a group whose padding is the ``ALIGN_NUMEL`` alignment of its items, which every part
    would pay again. The ratio counts all padding, alignment included, like ``memory_report``.
    """
    indices = list(range(len(shapes)))
    whole = build_layout(shapes, world_size)
    row_sizes = {row_numel(s) for s in shapes if len(s) > 1}
    if whole.padding_ratio <= max_padding_ratio or len(row_sizes) <= 1:
        return [indices]

    def padding_ratio(members: list[int]) -> float:
        return build_layout([shapes[i] for i in members], world_size).padding_ratio

    by_row: dict[int, list[int]] = {}
    vectors: list[int] = []
    for i in indices:
        if len(shapes[i]) > 1:
            by_row.setdefault(row_numel(shapes[i]), []).append(i)
        else:
            vectors.append(i)
    parts = sorted(by_row.values(), key=lambda b: -sum(math.prod(shapes[i]) for i in b))
    parts[0] = sorted(parts[0] + vectors)
    merged = True
    while merged and len(parts) > 1:
        merged = False
        for a in range(len(parts)):
            for b in range(a + 1, len(parts)):
                candidate = sorted(parts[a] + parts[b])
                if padding_ratio(candidate) <= max_padding_ratio:
                    parts[a] = candidate
                    del parts[b]
                    merged = True
                    break
            if merged:
                break
    # If splitting did not help, one part is cheaper (fewer collectives).
    split_padding = sum(
        build_layout([shapes[i] for i in b], world_size).padding_numel for b in parts
    )
    if split_padding >= whole.padding_numel:
        return [indices]
    return [sorted(b) for b in parts]
