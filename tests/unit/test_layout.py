"""Invariants of the row-aligned flat-buffer layout (``megatron_fsdp_v2._buffers._layout``).

Pure shape math, no processes. Each property is checked on hypothesis-generated shape lists when
hypothesis is installed, and always on a fixed set of seeded random shape lists, for world sizes
1-8 and every element size a group's buffers may have (1-byte fp8 to 8-byte fp64): every item
start, shard boundary and rank's piece of an item is 16-byte aligned in each of them. See
[Note: row-aligned flat buffers] in ``_layout.py`` for the contract.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
import torch

from megatron_fsdp_v2._buffers._layout import (
    ALIGN_NUMEL,
    BufferLayout,
    build_layout,
    row_numel,
    split_for_padding,
)

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    HAVE_HYPOTHESIS = True
except ImportError:  # pragma: no cover - the seeded loops below still run
    HAVE_HYPOTHESIS = False

S = torch.Size
RATIOS = (0.0, 0.001, 0.01, 0.1, 1.0)
# Row sizes that make the LCM large (primes, 257 as in OddMLP) and transformer-like ones.
ROW_CHOICES = (1, 2, 3, 4, 5, 7, 8, 12, 15, 16, 17, 37, 64, 96, 257, 768, 3072)
# Bytes per element of every dtype a buffer role may use: fp8 model weights, bf16/fp16 model
# weights and reduce-scatter buckets, fp32 main weights and grads, fp64.
ELEMENT_SIZES = (1, 2, 4, 8)
VECTOR_BYTES = 16  # what fused/vectorized kernels and NCCL want every pointer aligned to


def item_alignment(row: int, world: int) -> int:
    """Elements an item's offset is a multiple of: its row size and ALIGN_NUMEL (with rank
    boundaries), ALIGN_NUMEL alone (one rank)."""
    return math.lcm(row, ALIGN_NUMEL) if world > 1 else ALIGN_NUMEL


# ---------------------------------------------------------------------------------------------
# The properties
# ---------------------------------------------------------------------------------------------


def check_layout(shapes: Sequence[torch.Size], world: int) -> BufferLayout:
    """Every documented invariant of ``build_layout(shapes, world)``; returns the layout."""
    layout = build_layout(shapes, world)
    ctx = f"shapes={list(map(tuple, shapes))} world={world}"
    assert layout.world_size == world, ctx
    assert len(layout.items) == len(shapes), ctx
    assert layout.total_numel == world * layout.shard_numel, ctx
    assert layout.shard_numel >= 1, ctx
    expected_lcm = math.lcm(*(row_numel(s) for s in shapes)) if shapes else 1
    assert layout.row_lcm == expected_lcm, ctx

    for shape, item in zip(shapes, layout.items):
        # Items are in the caller's order and describe their tensor.
        assert item.shape == S(shape), ctx
        assert item.numel == math.prod(shape), ctx
        assert item.row_numel == row_numel(shape), ctx
        assert item.end == item.offset + item.numel, ctx
        # Each parameter starts on a multiple of its row size (where rank boundaries exist) and
        # of ALIGN_NUMEL, inside the buffer.
        assert item.offset % item_alignment(item.row_numel, world) == 0, (
            f"{ctx}: {item} offset not aligned"
        )
        assert 0 <= item.offset and item.end <= layout.total_numel, f"{ctx}: {item} outside"

    # shard_numel is a multiple of ALIGN_NUMEL and, with rank boundaries, of row_lcm, so every
    # rank boundary is a multiple of each row size.
    assert layout.shard_multiple == (
        math.lcm(layout.row_lcm, ALIGN_NUMEL) if world > 1 else ALIGN_NUMEL
    ), ctx
    assert layout.shard_numel % layout.shard_multiple == 0, ctx
    if world > 1:
        assert layout.shard_numel % layout.row_lcm == 0, ctx

    # 16-byte alignment in every dtype the group's buffers may use: item starts, rank slots
    # (shard boundaries, also the buffer's end) and each rank's piece of each item.
    for size in ELEMENT_SIZES:
        for item in layout.items:
            assert item.offset * size % VECTOR_BYTES == 0, f"{ctx}: {item} at {size} B/elem"
        for k in range(world + 1):
            assert k * layout.shard_numel * size % VECTOR_BYTES == 0, f"{ctx}: slot {k}"
        for index in range(len(layout.items)):
            for rank in range(world):
                lo, hi = layout.local_item_range(index, *layout.shard_range(rank))
                if lo < hi:
                    assert lo * size % VECTOR_BYTES == 0, f"{ctx}: rank {rank} item {index}"

    # No rank boundary cuts a row of any parameter.
    for k in range(1, world):
        boundary = k * layout.shard_numel
        for item in layout.items:
            if item.offset < boundary < item.end:
                assert (boundary - item.offset) % item.row_numel == 0, (
                    f"{ctx}: boundary {boundary} cuts a row of {item}"
                )

    # Items do not overlap (zero-size items occupy nothing).
    placed = sorted((it for it in layout.items if it.numel > 0), key=lambda it: it.offset)
    for a, b in zip(placed, placed[1:]):
        assert a.end <= b.offset, f"{ctx}: {a} overlaps {b}"

    # uncovered_ranges + items cover the buffer exactly, without overlap.
    gaps = layout.uncovered_ranges()
    assert gaps == sorted(gaps), ctx
    assert all(lo < hi for lo, hi in gaps), f"{ctx}: empty gap in {gaps}"
    spans = sorted([(it.offset, it.end) for it in placed] + list(gaps))
    cursor = 0
    for lo, hi in spans:
        assert lo == cursor, f"{ctx}: spans {spans} leave a hole or overlap at {cursor}"
        cursor = hi
    assert cursor == layout.total_numel, ctx
    assert layout.padding_numel == sum(hi - lo for lo, hi in gaps), ctx
    assert layout.content_numel == sum(math.prod(s) for s in shapes), ctx

    # Each rank's piece of each parameter is whole rows, and the pieces add up to the parameter.
    for index, item in enumerate(layout.items):
        covered = 0
        for rank in range(world):
            start, end = layout.shard_range(rank)
            assert (start, end) == (rank * layout.shard_numel, (rank + 1) * layout.shard_numel)
            lo, hi = layout.local_item_range(index, start, end)
            assert lo <= hi, ctx
            if lo < hi:
                assert item.offset <= lo and hi <= item.end and start <= lo and hi <= end, ctx
                assert (lo - item.offset) % item.row_numel == 0, f"{ctx}: rank {rank} {item}"
                assert (hi - item.offset) % item.row_numel == 0, f"{ctx}: rank {rank} {item}"
            covered += hi - lo
        assert covered == item.numel, f"{ctx}: ranks hold {covered} of {item.numel} elements"

    # Padding is minimal alignment gaps (each shorter than the alignment of the item after it,
    # in placement order) plus the tail that rounds up to world * shard_multiple.
    cursor = 0
    for item in sorted(layout.items, key=lambda it: (it.offset, it.numel)):
        if item.numel == 0:
            continue
        assert item.offset - cursor < item_alignment(item.row_numel, world), (
            f"{ctx}: gap of {item.offset - cursor} before {item}"
        )
        cursor = item.end
    content_end = max((it.end for it in layout.items), default=0)
    assert layout.total_numel - max(content_end, 1) < world * layout.shard_multiple, ctx
    return layout


def check_split(shapes: Sequence[torch.Size], world: int, max_ratio: float) -> list[list[int]]:
    """The documented contract of ``split_for_padding``; returns the parts."""
    parts = split_for_padding(shapes, world, max_padding_ratio=max_ratio)
    ctx = f"shapes={list(map(tuple, shapes))} world={world} max_ratio={max_ratio}"
    assert parts, ctx
    # A partition of the indices, each part sorted.
    flat = [i for b in parts for i in b]
    assert sorted(flat) == list(range(len(shapes))), f"{ctx}: {parts} is not a partition"
    assert all(b == sorted(b) for b in parts), ctx
    if len(parts) > 1:
        assert all(b for b in parts), f"{ctx}: empty part in {parts}"

    whole = build_layout(shapes, world)
    row_sizes = {row_numel(s) for s in shapes if len(s) > 1}
    if whole.padding_ratio <= max_ratio or len(row_sizes) <= 1:
        assert len(parts) == 1, f"{ctx}: split {parts} although one part is allowed"
    if len(parts) == 1:
        return parts

    # It splits only when that reduces the padding ...
    layouts = [check_layout([shapes[i] for i in b], world) for b in parts]
    split_padding = sum(lay.padding_numel for lay in layouts)
    assert split_padding < whole.padding_numel, f"{ctx}: split {parts} does not reduce padding"
    # ... 1-D tensors (rows of one element) stay together in one part ...
    vectors = {i for i, s in enumerate(shapes) if len(s) <= 1}
    assert sum(1 for b in parts if vectors & set(b)) <= 1, f"{ctx}: 1-D tensors split {parts}"
    # ... and each part is within the ratio, except a part of one row size (never merged)
    # whose padding is its minimal alignment gaps and tail (check_layout checks both).
    for part, lay in zip(parts, layouts):
        if lay.padding_ratio <= max_ratio:
            continue
        rows = {row_numel(shapes[i]) for i in part if len(shapes[i]) > 1}
        assert len(rows) == 1, (
            f"{ctx}: part {part} (row sizes {sorted(rows)}) pads {lay.padding_ratio:.4f}"
        )
    return parts


# ---------------------------------------------------------------------------------------------
# Shape generators
# ---------------------------------------------------------------------------------------------


def random_shape(rng: random.Random) -> torch.Size:
    kind = rng.random()
    if kind < 0.05:
        return S([])
    if kind < 0.35:
        return S([rng.choice((0, 1, 2, 3, 7, 17, 64, 257, 768, 3000))])
    rows = rng.choice((0, 1, 2, 3, 5, 7, 17, 37, 64, 129, 768, 2048))
    if kind < 0.85:
        return S([rows, rng.choice(ROW_CHOICES)])
    return S([rows, rng.choice((1, 2, 3, 4, 7)), rng.choice((1, 3, 5, 16))])


def random_shapes(seed: int) -> list[torch.Size]:
    rng = random.Random(seed)
    return [random_shape(rng) for _ in range(rng.randint(0, 10))]


SEEDS = range(300)


def test_layout_invariants_seeded() -> None:
    for seed in SEEDS:
        shapes = random_shapes(seed)
        for world in range(1, 9):
            check_layout(shapes, world)


def test_split_for_padding_seeded() -> None:
    for seed in SEEDS:
        shapes = random_shapes(seed)
        world = 1 + seed % 8
        for ratio in RATIOS:
            check_split(shapes, world, ratio)


if HAVE_HYPOTHESIS:
    _dim = st.integers(0, 300)
    _shape = st.one_of(
        st.just(S([])),
        st.builds(lambda n: S([n]), st.integers(0, 5000)),
        st.builds(lambda r, c: S([r, c]), st.integers(0, 3000), st.sampled_from(ROW_CHOICES)),
        st.builds(lambda r, c: S([r, c]), _dim, st.integers(1, 300)),
        st.builds(lambda a, b, c: S([a, b, c]), _dim, st.integers(1, 12), st.integers(1, 12)),
    )
    _shapes = st.lists(_shape, max_size=10)
    _world = st.integers(1, 8)
    _settings = settings(
        max_examples=100, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )

    @_settings
    @given(shapes=_shapes, world=_world)
    def test_layout_invariants_hypothesis(shapes: list[torch.Size], world: int) -> None:
        check_layout(shapes, world)

    @_settings
    @given(shapes=_shapes, world=_world, max_ratio=st.sampled_from(RATIOS))
    def test_split_for_padding_hypothesis(shapes: list[torch.Size], world: int,
                                     max_ratio: float) -> None:
        check_split(shapes, world, max_ratio)


# ---------------------------------------------------------------------------------------------
# Specific cases
# ---------------------------------------------------------------------------------------------


def gpt_block(d: int) -> list[torch.Size]:
    """The parameters of a GPT block (LayerNorms, qkv with bias, proj, 4x MLP)."""
    return [S([d]), S([d]), S([3 * d, d]), S([3 * d]), S([d, d]), S([d]), S([d]), S([d]),
            S([4 * d, d]), S([4 * d]), S([d, 4 * d]), S([d])]


@pytest.mark.parametrize("world, percent", [(2, 0.03), (3, 0.12), (4, 0.03), (8, 0.21)])
def test_gpt_block_padding_matches_design_doc(world: int, percent: float) -> None:
    """design.md §2 quotes these padding figures for a 768-wide GPT block."""
    shapes = gpt_block(768)
    layout = check_layout(shapes, world)
    assert round(100 * layout.padding_ratio, 2) == percent
    assert check_split(shapes, world, 0.01) == [list(range(len(shapes)))]
    # Rows of 3072 and 768 divide each other: placed by decreasing row size, no alignment gaps.
    assert len(layout.uncovered_ranges()) == 1


def test_divisible_row_sizes_leave_no_gaps_between_matrices() -> None:
    """Row sizes that divide each other and are multiples of ALIGN_NUMEL (transformer widths):
    matrices are packed back to back; only a 1-D tensor whose length is not a multiple of
    ALIGN_NUMEL leaves a gap, shorter than ALIGN_NUMEL, before the next vector."""
    rng = random.Random(0)
    for _ in range(200):
        base = rng.choice((1, 2, 3, 5)) * ALIGN_NUMEL
        shapes = [S([rng.randint(0, 50), base * 2 ** rng.randint(0, 3)])
                  for _ in range(rng.randint(1, 6))]
        shapes += [S([rng.randint(0, 50)]) for _ in range(rng.randint(0, 3))]
        rng.shuffle(shapes)
        for world in range(1, 9):
            layout = check_layout(shapes, world)
            vector_starts = {it.offset for it in layout.items if len(it.shape) <= 1}
            for lo, hi in layout.uncovered_ranges():
                if hi == layout.total_numel:
                    continue  # the tail
                assert hi in vector_starts and hi - lo < ALIGN_NUMEL, (shapes, world, lo, hi)


def test_odd_vector_first_keeps_everything_after_aligned() -> None:
    """The issue's case: an odd-length bias (50257) and an 8-expert router bias before other
    parameters. Packed back to back they would move every later start off 16 bytes."""
    shapes = [S([50257]), S([8]), S([7]), S([5, 7]), S([96, 64]), S([64])]
    for world in range(1, 9):
        layout = check_layout(shapes, world)
        assert all(item.offset % ALIGN_NUMEL == 0 for item in layout.items)
        assert layout.shard_numel % ALIGN_NUMEL == 0


def test_placement_is_by_decreasing_row_size() -> None:
    shapes = [S([5]), S([3, 4]), S([2, 16]), S([7])]
    layout = check_layout(shapes, 2)
    order = sorted(range(len(shapes)), key=lambda i: layout.items[i].offset)
    assert order == [2, 1, 0, 3]
    # (2, 16) at 0; (3, 4) at 32 (a multiple of lcm(4, 16)); the vectors at multiples of 16.
    assert [it.offset for it in layout.items] == [48, 32, 0, 64]
    assert layout.row_lcm == 16 and layout.shard_numel == 48  # 71 rounded up to 2 * 16


def test_world_size_one_pads_only_to_the_alignment() -> None:
    """One rank: no boundary that could cut a row, so items are packed at multiples of
    ALIGN_NUMEL whatever their row size, and the buffer ends at the next multiple of it."""
    for seed in SEEDS:
        shapes = random_shapes(seed)
        layout = check_layout(shapes, 1)
        content_end = max((it.end for it in layout.items), default=0)
        assert layout.shard_numel == -(-max(content_end, 1) // ALIGN_NUMEL) * ALIGN_NUMEL
        aligned = sum(-(-math.prod(s) // ALIGN_NUMEL) * ALIGN_NUMEL for s in shapes)
        assert layout.total_numel == max(aligned, ALIGN_NUMEL), shapes


def test_empty_and_degenerate_inputs() -> None:
    for world in range(1, 9):
        layout = check_layout([], world)
        assert layout.items == () and layout.row_lcm == 1 and layout.content_numel == 0
        assert layout.padding_ratio == layout.padding_numel  # max(content, 1) == 1
        assert split_for_padding([], world) == [[]]
        # Zero-size and scalar parameters.
        check_layout([S([0]), S([]), S([0, 5]), S([1])], world)
        check_split([S([0]), S([]), S([0, 5]), S([1])], world, 0.0)


@pytest.mark.parametrize("world", [0, -1])
def test_world_size_must_be_positive(world: int) -> None:
    with pytest.raises(ValueError, match="world_size"):
        build_layout([S([4, 4])], world)


def test_row_numel() -> None:
    assert row_numel(S([])) == 1
    assert row_numel(S([9])) == 1
    assert row_numel(S([9, 4])) == 4
    assert row_numel((2, 3, 5)) == 15
    assert row_numel([0, 6]) == 6


def test_split_for_padding_splits_incompatible_rows() -> None:
    """A 257-wide matrix next to a 256-wide one: the LCM (65792) would pad ~2x, so they split."""
    shapes = [S([64, 257]), S([64, 256]), S([256]), S([257])]
    for world in (2, 4, 8):
        parts = check_split(shapes, world, 0.01)
        assert len(parts) == 2
        assert [0, 1] not in parts
        # The 1-D tensors join the largest part (the 257-wide one).
        assert sorted(parts) == [[0, 2, 3], [1]]


def test_split_for_padding_keeps_tiny_groups_whole() -> None:
    """Padding dominated by the world * row_lcm rounding: splitting would only add collectives."""
    shapes = [S([1, 2]), S([1, 4])]
    whole = build_layout(shapes, 8)
    assert whole.padding_ratio > 0.01
    split = build_layout(shapes[:1], 8).padding_numel + build_layout(shapes[1:], 8).padding_numel
    assert split >= whole.padding_numel
    assert check_split(shapes, 8, 0.01) == [[0, 1]]


def test_zero_width_rows() -> None:
    shapes = [S([4, 0]), S([3, 5]), S([4])]
    try:
        layout = build_layout(shapes, 2)
    except ValueError:
        return  # a clear error is acceptable too
    assert layout.items[0].numel == 0
