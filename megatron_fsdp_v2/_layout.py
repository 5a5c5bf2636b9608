"""Flat-buffer layout math: where each parameter lives in a flat group and which rows each rank
owns.

Pure functions over shapes and the world size. No tensors are allocated here and nothing talks to
``torch.distributed``.

[Note: row-aligned flat buffers]
A parameter group is stored as one flat 1-D buffer of ``world_size * shard_numel`` elements. Rank
``r`` owns the contiguous span ``[r * shard_numel, (r + 1) * shard_numel)`` of every buffer role
(model weights, main weights, main grads), which is exactly the slot that
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` assign to it, so collectives run on the
flat buffers directly and compute parameters are zero-copy views into the unsharded buffer.

For ``Shard(0)`` to describe a rank's piece of a parameter truthfully, no shard boundary may cut a
row (``shape[1:].numel()`` elements). We guarantee it by

* placing every parameter at an offset that is a multiple of its own row size, and
* making ``shard_numel`` a multiple of ``row_lcm``, the least common multiple of all row sizes.

Then every boundary ``k * shard_numel`` is a multiple of each row size, and since each parameter
starts on a multiple of its row size, each boundary it crosses falls between two of its rows.
Parameters are placed in order of decreasing row size (1-D parameters, whose rows are single
elements, last), so the alignment gaps are usually empty.

The cost is padding: alignment gaps plus the tail that rounds the buffer up to
``world_size * row_lcm``. When heterogeneous row sizes make ``row_lcm`` large enough that the
padding exceeds ``max_padding_ratio``, :func:`split_for_padding` splits the group into several
groups with compatible row sizes; each is an independent set of flat buffers with its own
collectives. ("Bucket" is reserved for temporary buffers, ``_allocator.py``.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ItemLayout", "BufferLayout", "build_layout", "split_for_padding", "row_numel"]


def row_numel(shape: torch.Size | Sequence[int]) -> int:
    """Elements in one dim-0 row of a tensor of ``shape`` (1 for 1-D tensors). A zero-width row
    (e.g. ``nn.Linear(0, n).weight``, shape ``(n, 0)``) counts as 1: the tensor has no elements,
    so any alignment works, and the layout math never divides by zero."""
    return max(math.prod(shape[1:]), 1) if len(shape) > 1 else 1


def _align_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class ItemLayout:
    """One parameter inside a flat buffer."""

    offset: int  # start in the (unsharded) flat buffer, a multiple of row_numel
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
    shard_numel: int  # elements each rank owns; a multiple of row_lcm when world_size > 1
    row_lcm: int

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
        cursor = _align_up(cursor, rows[i])
        offsets[i] = cursor
        cursor += numels[i]
    row_lcm = math.lcm(*rows) if rows else 1
    if world_size == 1:
        shard_numel = max(cursor, 1)
    else:
        shard_numel = _align_up(max(cursor, 1), world_size * row_lcm) // world_size
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
    long as a merge stays within the ratio. Tiny groups whose padding is dominated by the
    ``world_size * row_lcm`` rounding stay as one part: splitting them only adds collectives.
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
