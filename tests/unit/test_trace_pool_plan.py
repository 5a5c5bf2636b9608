"""The trace-planned pool (``megatron_fsdp_v2._buffers._trace_pool``), without processes: the
planner's offsets, and the allocator's record / plan / serve / replan cycle
([Note: trace-planned pool]).
"""

from __future__ import annotations

import random
from collections.abc import Hashable

import pytest
import torch

from megatron_fsdp_v2._buffers._trace_pool import ARENA_ALIGNMENT, TracePoolAllocator, plan_offsets

CPU = torch.device("cpu")
F32 = torch.float32


def overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]


# ------------------------------------------------------------------------------------- planner

@pytest.mark.parametrize("seed", range(20))
def test_conflicting_buckets_never_overlap(seed: int) -> None:
    rng = random.Random(seed)
    sizes = {k: rng.choice([0, 1, 7, 256, 300, 1024, 4096]) for k in range(rng.randint(1, 25))}
    conflicts: dict[Hashable, set[Hashable]] = {k: set() for k in sizes}
    for a in sizes:
        for b in sizes:
            if a < b and rng.random() < 0.3:
                conflicts[a].add(b)  # one direction is enough
    previous = {k: rng.randrange(0, 8) * ARENA_ALIGNMENT for k in sizes if rng.random() < 0.5}
    offsets, total = plan_offsets(sizes, conflicts, previous if seed % 2 else None)
    assert set(offsets) == set(sizes)
    assert total % ARENA_ALIGNMENT == 0
    for key, offset in offsets.items():
        assert offset % ARENA_ALIGNMENT == 0
        assert offset + sizes[key] <= total
    for a, others in conflicts.items():
        for b in others:
            ra = (offsets[a], offsets[a] + sizes[a])
            rb = (offsets[b], offsets[b] + sizes[b])
            assert not overlap(ra, rb), (a, b, ra, rb)
    # Never more than every scratch buffer side by side.
    assert total <= sum(-(-s // ARENA_ALIGNMENT) * ARENA_ALIGNMENT for s in sizes.values())


def test_buckets_never_live_together_share_memory() -> None:
    # a and c are never live together; b overlaps both.
    offsets, total = plan_offsets({"a": 1000, "b": 10, "c": 1000}, {"b": {"a", "c"}})
    assert offsets["a"] == offsets["c"]
    assert total == 1024 + 256


def test_previous_offsets_kept_when_still_valid() -> None:
    offsets, _ = plan_offsets({"a": 100, "b": 100}, {}, previous={"a": 512, "b": 512})
    assert offsets == {"a": 512, "b": 512}
    offsets, _ = plan_offsets({"a": 100, "b": 100}, {"a": {"b"}}, previous={"a": 512, "b": 512})
    assert offsets["a"] == 512 and offsets["b"] != 512


def test_empty_plan() -> None:
    assert plan_offsets({}, {}) == ({}, 0)
    with pytest.raises(ValueError, match="alignment"):
        plan_offsets({"a": 1}, {}, alignment=0)


@pytest.mark.parametrize("alignment", [0, 8, 24])
def test_arena_alignment_below_16_bytes_refused(alignment: int) -> None:
    """Every scratch buffer starts at a multiple of the alignment: below 16 bytes it would hand
    kernels and NCCL misaligned scratch buffers."""
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        TracePoolAllocator(alignment=alignment)


def test_arena_buckets_are_16_byte_aligned() -> None:
    """Scratch buffers of odd byte sizes and several dtypes, planned into one arena: each starts on
    an ARENA_ALIGNMENT boundary of it, so 16-byte aligned whatever came before it."""
    alloc = TracePoolAllocator()
    cpu = torch.device("cpu")
    specs = {"a": (7, torch.bfloat16), "b": (13, torch.float32), "c": (5, torch.uint8)}
    for _ in range(3):  # record, plan at the boundary, then serve from the arena
        alloc.begin_iteration()
        buckets = [alloc.allocate(k, n, dtype, cpu) for k, (n, dtype) in specs.items()]
        assert all(b.data_ptr() % 16 == 0 for b in buckets), [b.data_ptr() for b in buckets]
        for key in specs:
            alloc.free(key)
    assert alloc.planned and alloc.arena_bytes > 0


# ------------------------------------------------------------------------------------ allocator

def run(alloc: TracePoolAllocator, steps: list[tuple[str, str, int]],
        escaping: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Replay ("alloc" | "free", key, numel) steps; fill each allocated scratch buffer with a value
    of its own and check that no live scratch buffer was overwritten. Returns the scratch buffers
    handed out."""
    handed: dict[str, torch.Tensor] = {}
    fill: dict[str, float] = {}
    for op, key, numel in steps:
        if op == "alloc":
            scratch = alloc.allocate(key, numel, F32, CPU)
            if key in escaping:  # autograd saves views of it (a unit's forward)
                alloc.pin(key)
            assert scratch.shape == (numel,) and scratch.dtype == F32
            fill[key] = float(len(fill) + 1)
            scratch.fill_(fill[key])
            handed[key] = scratch
        else:
            alloc.free(key)
            fill.pop(key, None)  # a key allocated by an earlier run() has no value here
        for live, value in fill.items():
            assert bool((alloc.get(live) == value).all()), f"{live} was overwritten"
    return handed


TRACE = [("alloc", "a", 100), ("alloc", "b", 10), ("free", "a", 0), ("alloc", "c", 100),
         ("free", "b", 0), ("free", "c", 0)]


def test_empty_trace_makes_no_arena() -> None:
    alloc = TracePoolAllocator()
    for _ in range(3):
        alloc.begin_iteration()
    assert alloc.arena_bytes == 0 and not alloc.planned and alloc.replans == 0


def test_first_iteration_records_then_serves_stable_addresses_from_the_arena() -> None:
    alloc = TracePoolAllocator()
    alloc.begin_iteration()
    first = run(alloc, TRACE)
    assert alloc.arena_bytes == 0  # recording: storage-freeing scratch buffers
    assert first["a"].untyped_storage().nbytes() == 0  # freed like ScratchAllocator
    assert alloc.peak_bytes == 440
    ptrs = None
    for _ in range(3):
        alloc.begin_iteration()
        assert alloc.planned and alloc.replans == 1
        handed = run(alloc, TRACE)
        now = {k: v.data_ptr() for k, v in handed.items()}
        assert ptrs is None or now == ptrs
        ptrs = now
    assert alloc.outside_arena == 0
    assert alloc.offset("a") == alloc.offset("c")  # never live together
    assert alloc.arena_bytes == 512 + 256
    assert alloc.peak_bytes == 440  # the storage-freeing figure, unchanged


def test_changed_trace_is_served_outside_then_replanned() -> None:
    alloc = TracePoolAllocator()
    alloc.begin_iteration()
    run(alloc, TRACE)
    alloc.begin_iteration()
    run(alloc, TRACE)
    # A new key live with a and c, and c larger than planned.
    changed = [("alloc", "a", 100), ("alloc", "d", 50), ("alloc", "b", 10), ("free", "a", 0),
               ("alloc", "c", 200), ("free", "b", 0), ("free", "c", 0), ("free", "d", 0)]
    alloc.begin_iteration()
    run(alloc, changed)
    assert alloc.outside_arena >= 2 and alloc.replans == 1
    alloc.begin_iteration()
    assert alloc.replans == 2 and alloc.outside_arena == 0
    handed = run(alloc, changed)
    assert alloc.outside_arena == 0
    # Alternating with the old trace converges: no further replans, stable addresses.
    ptrs: dict[int, dict[str, int]] = {}
    for i in range(4):
        alloc.begin_iteration()
        handed = run(alloc, TRACE if i % 2 else changed)
        now = {k: v.data_ptr() for k, v in handed.items()}
        assert ptrs.setdefault(i % 2, now) == now
    assert alloc.replans == 2 and alloc.outside_arena == 0


def test_live_across_the_boundary_defers_the_plan() -> None:
    alloc = TracePoolAllocator()
    alloc.begin_iteration()
    run(alloc, [("alloc", "w", 10), ("alloc", "x", 10), ("free", "x", 0)])
    alloc.begin_iteration()  # w is live: no plan yet
    assert not alloc.planned
    run(alloc, [("alloc", "x", 10), ("free", "x", 0), ("free", "w", 0)])
    alloc.begin_iteration()
    assert alloc.planned
    assert alloc.offset("w") != alloc.offset("x")


def test_escaping_views_keep_their_memory_within_an_iteration() -> None:
    # x is gathered, freed, and gathered again (its saved views read it); s reuses x's memory.
    trace = [("alloc", "x", 64), ("free", "x", 0), ("alloc", "s", 64), ("free", "s", 0),
             ("alloc", "x", 64), ("free", "x", 0)]
    alloc = TracePoolAllocator()
    alloc.begin_iteration()
    run(alloc, trace, escaping=frozenset("x"))
    alloc.begin_iteration()
    run(alloc, trace, escaping=frozenset("x"))
    assert alloc.offset("x") == alloc.offset("s")
    # Off plan before s is allocated (a new key): s keeps clear of x's memory, so x gets it back.
    diverged = [("alloc", "x", 64), ("free", "x", 0), ("alloc", "z", 8), ("free", "z", 0),
                ("alloc", "s", 64), ("alloc", "x", 64), ("free", "x", 0), ("free", "s", 0)]
    alloc.begin_iteration()
    handed = run(alloc, diverged, escaping=frozenset("x"))
    assert alloc.outside_arena == 2  # z (unknown) and s
    # Not pinned (a stray prefetch: no forward used it), x may move instead.
    alloc.begin_iteration()
    run(alloc, diverged)
    alloc.begin_iteration()  # replanned for both patterns
    assert alloc.offset("x") != alloc.offset("s")
    # Diverging only after s took x's memory: x cannot get it back without moving under saved
    # tensors: a clear error, nothing overwritten.
    alloc2 = TracePoolAllocator()
    for _ in range(2):
        alloc2.begin_iteration()
        run(alloc2, trace, escaping=frozenset("x"))
    alloc2.begin_iteration()
    late = [("alloc", "x", 64), ("free", "x", 0), ("alloc", "s", 64), ("alloc", "z", 8)]
    handed = run(alloc2, late, escaping=frozenset("x"))
    before = handed["s"].clone()
    with pytest.raises(RuntimeError, match="must get back the memory"):
        alloc2.allocate("x", 64, F32, CPU)
    assert torch.equal(handed["s"], before) and not alloc2.is_allocated("x")


def test_non_escaping_bucket_moves_when_its_memory_is_taken() -> None:
    trace = [("alloc", "r", 64), ("free", "r", 0), ("alloc", "s", 64), ("free", "s", 0),
             ("alloc", "r", 64), ("free", "r", 0)]
    alloc = TracePoolAllocator()
    for _ in range(2):
        alloc.begin_iteration()
        run(alloc, trace)
    alloc.begin_iteration()
    run(alloc, [("alloc", "r", 64), ("free", "r", 0), ("alloc", "s", 64), ("alloc", "z", 8),
                ("alloc", "r", 64), ("free", "r", 0), ("free", "z", 0), ("free", "s", 0)])
    assert alloc.outside_arena == 2  # z and the second r


def test_alignment_and_mixed_dtypes() -> None:
    alloc = TracePoolAllocator()
    specs = [("a", 5, torch.bfloat16), ("b", 3, torch.float64), ("c", 7, torch.float32)]
    for _ in range(2):
        alloc.begin_iteration()
        for key, numel, dtype in specs:
            scratch = alloc.allocate(key, numel, dtype, CPU)
            assert scratch.dtype == dtype and scratch.numel() == numel
            scratch.fill_(1)
        for key, _, _ in specs:
            alloc.free(key)
    arena_ptr = next(iter(alloc._arenas.values())).data_ptr()
    for key, _, _ in specs:
        offset = alloc.offset(key)
        assert offset is not None and offset % ARENA_ALIGNMENT == 0
        assert alloc.get(key).data_ptr() == arena_ptr + offset  # type: ignore[union-attr]


def test_release_drops_the_arena_and_records_again() -> None:
    alloc = TracePoolAllocator()
    for _ in range(2):
        alloc.begin_iteration()
        run(alloc, TRACE)
    alloc.allocate("a", 100, F32, CPU)
    with pytest.raises(RuntimeError, match="in use"):
        alloc.release()
    alloc.free("a")
    alloc.release()
    assert alloc.arena_bytes == 0 and not alloc.planned and not alloc._views
    alloc.begin_iteration()
    run(alloc, TRACE)
    assert alloc.arena_bytes == 0
    alloc.begin_iteration()
    assert alloc.planned and alloc.arena_bytes == 768


def test_live_key_allocated_again_keeps_its_contents() -> None:
    alloc = TracePoolAllocator()
    for _ in range(2):
        alloc.begin_iteration()
        scratch = alloc.allocate("w", 8, F32, CPU)
        scratch.fill_(3)
        assert alloc.allocate("w", 8, F32, CPU) is scratch
        assert bool((scratch == 3).all()) and alloc.live_bytes == 32
        alloc.free("w")
    assert alloc.planned


def test_inference_mode_buckets_are_normal_tensors() -> None:
    alloc = TracePoolAllocator()
    for _ in range(2):
        alloc.begin_iteration()
        with torch.inference_mode():
            scratch = alloc.allocate("a", 4, F32, CPU)
        assert not scratch.is_inference()
        alloc.free("a")


def test_memory_report_shows_the_arena() -> None:
    from megatron_fsdp_v2 import MemoryReport

    plain = MemoryReport(model_weights=1 << 20, temporary_peak=3 << 20)
    assert "trace_pool_arena" not in str(plain) and plain.total == 4 << 20
    pooled = MemoryReport(model_weights=1 << 20, temporary_peak=3 << 20,
                          trace_pool_arena=4 << 20)
    assert "trace_pool_arena=4.00MiB (storage-freeing peak 3.00MiB)" in str(pooled)
    assert pooled.total == 5 << 20  # the larger of the two, once
