"""The trace-planned pool (``fully_shard(..., enable_trace_pool=True)``): scratch buffers served
from one persistent arena per device at planned offsets, so that every scratch buffer keeps its
address from one iteration to the next (what CUDA graphs need) and steady state allocates nothing.

[Note: trace-planned pool]
``TracePoolAllocator`` serves the same keys as the storage-freeing ``ScratchAllocator`` (see
[Note: storage-freeing scratch buffers]) and adds a plan:

* Iteration boundary: the root's pre-forward (not an activation-checkpoint recompute), which
  calls :meth:`TracePoolAllocator.begin_iteration`. An "iteration" is therefore one forward and
  everything up to the next one: its backward, the final callback, the optimizer step, clipping.
  With gradient accumulation each micro-batch is an iteration of its own.
* Trace: every ``allocate``/``free`` is an event. Two keys *conflict* when one is allocated
  while the other is live. The events of an iteration form its pattern; the pool keeps the
  patterns seen so far (micro-batches 1..N-1 and the last one of a window differ, so do the
  steps of a model whose control flow alternates) and the union of their conflicts.
* Plan (``plan_offsets``, ``_offset_plan.py``): byte offsets in one ``uint8`` arena per device,
  aligned, such that two conflicting keys never overlap; keys that are never live together share
  bytes. Scratch buffers are typed views of the arena, built once per plan, so ``data_ptr()`` is
  stable. The first iteration is served like the storage-freeing allocator (recording); the plan is
  made at the first boundary where no scratch buffer is live (so a window whose scratch buffers live
  across micro-batches, HSDP's ``window_grad``, is traced whole). A trace with no scratch buffer
  makes no arena.
* Serving: while the iteration's events so far equal the beginning of a pattern the plan was made
  from ("on plan"), every scratch buffer comes from its planned region: the plan already separated
  it from everything live with it. Once the iteration leaves every known pattern (a new key, a new
  size, a new order), a scratch buffer is served from the arena only if its region overlaps no live
  scratch buffer and no pinned region (below); otherwise from a storage-freeing scratch buffer of
  its own. The new pattern is recorded and the arena replanned at the next boundary where nothing is
  live, for the union of all patterns (so alternating traces converge instead of thrashing).
  A replan keeps the offsets that are still valid and reuses the arena when it is large
  enough, so unchanged scratch buffers keep their addresses; an arena that grows is a new
  allocation. A scratch buffer that is not pinned may move between two of its allocations: its
  holders (``_reduce.py``'s pending reductions, the HSDP window scratch buffers read through
  ``get``) only use it while it is live.
* Pinned memory: ZeRO-3's ``unsharded_model_weight`` is viewed by the compute parameters and
  by tensors autograd saves in forward (e.g. ``weight.t()`` saved by ``addmm``) and reads in
  backward after the scratch buffer was freed and gathered again. The storage-freeing allocator
  keeps them valid by keeping one storage per key. Here, when a unit registers its compute
  parameters (forward, recompute, backward), the group *pins* its scratch buffer
  (``ScratchAllocator.pin``): until the next boundary the key gets back the memory it has now, and a
  diverged iteration keeps other scratch buffers clear of it (a stray prefetch of a unit control
  flow skipped is not pinned and moves out of the way). If the memory is occupied by a live scratch
  buffer when a pinned key is allocated again (an iteration that diverged only after that scratch
  buffer took the memory), the pool raises ``RuntimeError`` instead of moving the scratch buffer
  under saved tensors; the pattern is recorded, so the next iteration is planned for it. Compute
  parameters are rebound when their scratch buffer moves between iterations
  (``FlatParamGroup.views_generation``); a graph built before the move and backwarded after it
  (``retain_graph=True`` across a replan) raises ``RuntimeError`` in the unit's pre-backward instead
  of reading memory that moved. A replaced arena is freed once nothing views it: the compute
  parameters drop their views at the boundary (a retained graph's saved tensors keep it alive,
  unchanged).
* ``release()`` (``FSDPModule.release_memory_pool()``): drops the arena and the trace between
  steps; the next iteration records again.

Whoever keeps a view of a scratch buffer past a ``free``/``allocate`` cycle (as autograd does with
the gathered weights) must ``pin`` it, or it may find other data there in a changed iteration. On
CUDA the arena relies on the invariant the storage-freeing scratch buffers rely on: a scratch buffer
is freed on the caller stream after its collective was waited on, and side streams wait on the
caller stream before each launch, so the next key in the same bytes is ordered after the last use. A
scratch buffer freed on another stream than it was allocated on makes the allocation stream wait on
the freeing one (see [Note: scratch buffers freed on another stream] in ``_allocator.py``).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import dataclass

import torch

from ._allocator import ScratchAllocator, allocation_stream
from ._offset_plan import ARENA_ALIGNMENT, plan_offsets

# ARENA_ALIGNMENT and plan_offsets belong to _offset_plan.py; listed here as the pool's defaults.
__all__ = ["ARENA_ALIGNMENT", "ScratchSpec", "TracePoolAllocator", "plan_offsets"]

# What every scratch buffer's start must be a multiple of, at least: kernels and NCCL read the
# scratch buffers (and their slots, see [Note: row-aligned flat buffers] in _layout.py) with 16-byte
# accesses.
_MIN_SCRATCH_ALIGNMENT = 16


@dataclass(frozen=True)
class ScratchSpec:
    """What a key asked for: its region in the arena fits ``nbytes``."""

    numel: int
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


Event = tuple[object, ...]


class TracePoolAllocator(ScratchAllocator):
    """Scratch buffers at planned offsets of a persistent arena (see [Note: trace-planned
    pool]); same interface and byte accounting as :class:`ScratchAllocator`."""

    moves_scratch = True

    def __init__(self, alignment: int = ARENA_ALIGNMENT, max_patterns: int = 16) -> None:
        # _scratch: the storage-freeing scratch buffers served outside the arena
        super().__init__()
        if alignment <= 0 or alignment % _MIN_SCRATCH_ALIGNMENT:
            raise ValueError(
                f"TracePoolAllocator alignment must be a positive multiple of "
                f"{_MIN_SCRATCH_ALIGNMENT} bytes (scratch buffers are read with 16-byte accesses), "
                f"got {alignment}"
            )
        self.alignment = alignment
        self.max_patterns = max_patterns
        self.replans = 0  # plans made (the first one included)
        self.outside_arena = 0  # allocations served outside the arena since the last plan
        self._reset_trace()

    def _reset_trace(self) -> None:
        self._specs: dict[Hashable, ScratchSpec] = {}  # every key seen, its latest spec
        self._conflicts: dict[Hashable, set[Hashable]] = {}
        # Pattern -> whether the current plan covers it (insertion order: oldest first).
        self._patterns: dict[tuple[Event, ...], bool] = {}
        self._events: list[Event] = []
        self._candidates: list[tuple[Event, ...]] = []  # covered patterns matching so far
        self._on_plan = False
        self._planned = False
        self._planned_specs: dict[Hashable, ScratchSpec] = {}
        self._offsets: dict[Hashable, int] = {}
        self._regions: dict[Hashable, tuple[torch.device, int, int]] = {}  # device, start, end
        self._arenas: dict[torch.device, torch.Tensor] = {}
        self._views: dict[Hashable, torch.Tensor] = {}
        self._current: dict[Hashable, torch.Tensor] = {}  # what allocate handed out last
        self._in_arena: dict[Hashable, bool] = {}  # this iteration's placement per key
        self._pinned: set[Hashable] = set()  # this iteration's (see ScratchAllocator.pin)
        self._scratch = {}

    # ------------------------------------------------------------------ queries

    @property
    def arena_bytes(self) -> int:
        """Bytes of the arenas (persistent while planned)."""
        return sum(a.untyped_storage().nbytes() for a in self._arenas.values())

    @property
    def planned(self) -> bool:
        return self._planned

    def offset(self, key: Hashable) -> int | None:
        """``key``'s planned byte offset in its device's arena (None: not planned)."""
        return self._offsets.get(key)

    def get(self, key: Hashable) -> torch.Tensor | None:
        current = self._current.get(key)
        return current if current is not None else self._scratch.get(key)

    # ------------------------------------------------------------------ allocate / free

    def allocate(
        self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        if key in self._live:
            current = self._current[key]
            if current.numel() == numel and current.dtype == dtype:
                return current
            self.free(key)  # replaced: its bytes leave the accounting first
        known = self._specs.get(key)
        if known is not None and (known.numel, known.dtype, known.device) == (numel, dtype, device):
            spec = known
        else:
            spec = ScratchSpec(numel, dtype, torch.device(device))
            if known is None or (known.dtype, known.device) != (spec.dtype, spec.device) or (
                known.numel < spec.numel
            ):
                self._specs[key] = spec  # a key's region fits the largest size seen
        self._record(("alloc", key, spec))
        conflicts = self._conflicts.setdefault(key, set())
        for other in self._live:
            if other not in conflicts:
                conflicts.add(other)
                self._conflicts.setdefault(other, set()).add(key)
        scratch = self._place(key, spec)
        self._current[key] = scratch
        self._live.add(key)
        self.live_bytes += spec.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if scratch.is_cuda:
            self._streams[key] = allocation_stream(scratch)
        return scratch

    def free(self, key: Hashable) -> None:
        if key not in self._live:
            return
        self._record(("free", key))
        scratch = self._current[key]
        self.live_bytes -= scratch.numel() * scratch.element_size()
        in_arena = self._in_arena.get(key, False)
        # See [Note: scratch buffers freed on another stream].
        self._order_free(key, scratch, in_arena)
        if not in_arena:
            scratch.untyped_storage().resize_(0)
        self._live.discard(key)

    def adopt(self, other: ScratchAllocator) -> None:
        """Take over the scratch buffers of a unit's own allocator (made before the root's lazy
        init): served outside the arena until the next plan."""
        if other is self:
            return
        self._scratch.update(other._scratch)
        for key in other._live:
            self._current[key] = other._scratch[key]
            self._in_arena[key] = False
        self._live |= other._live
        self.live_bytes += other.live_bytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        other._scratch, other._live, other.live_bytes = {}, set(), 0

    def _record(self, event: Event) -> None:
        pos = len(self._events)
        self._events.append(event)
        if self._on_plan:
            candidates = self._candidates
            if len(candidates) == 1:  # the common case: one pattern matches
                pattern = candidates[0]
                self._on_plan = pos < len(pattern) and pattern[pos] == event
            else:
                self._candidates = [p for p in candidates if pos < len(p) and p[pos] == event]
                self._on_plan = bool(self._candidates)

    def _region(self, key: Hashable) -> tuple[torch.device, int, int] | None:
        return self._regions.get(key)

    def _overlaps(self, key: Hashable, others: Collection[Hashable]) -> Hashable | None:
        """A key of ``others`` whose planned region overlaps ``key``'s, if any."""
        region = self._region(key)
        assert region is not None
        device, lo, hi = region
        for other in others:
            if other == key or lo == hi:  # (an empty scratch buffer overlaps nothing)
                continue
            theirs = self._region(other)
            if (
                theirs is not None and theirs[0] == device and theirs[1] < theirs[2]
                and theirs[1] < hi and lo < theirs[2]
            ):
                return other
        return None

    def pin(self, key: Hashable) -> None:
        if key in self._live:
            self._pinned.add(key)

    def _place(self, key: Hashable, spec: ScratchSpec) -> torch.Tensor:
        region = self._planned_specs.get(key)
        planned = (
            region is not None and key in self._offsets and region.numel >= spec.numel
            and (region.dtype, region.device) == (spec.dtype, spec.device)
        )
        in_arena_live = [k for k in self._live if self._in_arena.get(k, False)]
        earlier = self._in_arena.get(key)
        if key in self._pinned and earlier is not None:
            # Autograd may read views of the memory this key had: it must get the same back.
            occupant = self._overlaps(key, in_arena_live) if planned else "(its size changed)"
            if earlier and occupant is not None:
                raise RuntimeError(
                    f"enable_trace_pool: the scratch buffer {key!r} must get back the memory "
                    "it had earlier in this iteration (tensors autograd saved in forward view "
                    f"it), but scratch buffer {occupant!r}, which the plan never saw live at this "
                    "point, occupies it: this iteration's control flow differs from every "
                    "iteration the pool was planned from. Nothing was overwritten; the step "
                    "failed. The new pattern was recorded: the next forward recovers and the "
                    "pool plans for it. Models whose control flow changes unpredictably between "
                    "iterations are better served by enable_trace_pool=False"
                )
            use_arena = earlier
        else:
            use_arena = planned and self._overlaps(key, in_arena_live) is None
            if use_arena and not self._on_plan:
                # Off plan: keep clear of memory whose views autograd may still read (pinned
                # keys, allocated again later in this iteration).
                reserved = [k for k in self._pinned if self._in_arena.get(k, False)]
                use_arena = self._overlaps(key, reserved) is None
        self._in_arena[key] = use_arena
        if use_arena:
            return self._view(key, spec)
        self.outside_arena += 1
        return self._outside(key, spec)

    def _view(self, key: Hashable, spec: ScratchSpec) -> torch.Tensor:
        view = self._views.get(key)
        if view is None or view.numel() != spec.numel:
            offset = self._offsets[key]
            with torch.inference_mode(False):
                view = self._arenas[spec.device][offset : offset + spec.nbytes].view(spec.dtype)
            self._views[key] = view
        return view

    def _outside(self, key: Hashable, spec: ScratchSpec) -> torch.Tensor:
        scratch = self._scratch.get(key)
        if (
            scratch is None or scratch.numel() != spec.numel or scratch.dtype != spec.dtype
            or scratch.device != spec.device
        ):
            with torch.inference_mode(False):
                scratch = torch.empty(spec.numel, dtype=spec.dtype, device=spec.device)
            self._scratch[key] = scratch
        else:
            scratch.untyped_storage().resize_(spec.nbytes)
        return scratch

    # ------------------------------------------------------------------ iterations and plans

    def begin_iteration(self) -> bool:
        """The iteration boundary (the root's pre-forward): take in the last iteration's
        pattern, and (re)plan if the plan does not cover every pattern and nothing is live.
        Returns whether scratch buffers may have moved (a new plan)."""
        moved = False
        events = tuple(self._events)
        if events and events not in self._patterns:
            if len(self._patterns) >= self.max_patterns:  # its conflicts stay in the union
                del self._patterns[next(iter(self._patterns))]
            self._patterns[events] = False
        self._events = []
        self._in_arena = {k: v for k, v in self._in_arena.items() if k in self._live}
        # The last iteration's graphs are done (a retained one raises if backwarded after its
        # weights moved: FSDPState._checked_pre_backward).
        self._pinned = set()
        if not self._live and not all(self._patterns.values()):
            if not (self._planned and self._plan_is_valid()):
                self._replan()
                moved = True
            self._patterns = dict.fromkeys(self._patterns, True)
        self._candidates = [p for p, covered in self._patterns.items() if covered]
        self._on_plan = self._planned
        return moved

    def _plan_is_valid(self) -> bool:
        """Whether the current offsets serve every key seen, conflicts included."""
        if any(self._planned_specs.get(k) != s for k, s in self._specs.items()):
            return False
        return all(
            self._overlaps(key, others) is None for key, others in self._conflicts.items()
        )

    def _replan(self) -> None:
        assert not self._live, "replanning would move live scratch buffers"
        sizes: dict[torch.device, dict[Hashable, int]] = {}
        for key, spec in self._specs.items():
            sizes.setdefault(spec.device, {})[key] = spec.nbytes
        offsets: dict[Hashable, int] = {}
        arenas: dict[torch.device, torch.Tensor] = {}
        for device, device_sizes in sizes.items():
            previous = {
                k: self._offsets[k] for k in device_sizes
                if k in self._offsets and self._planned_specs[k].device == device
            }
            placed, total = plan_offsets(device_sizes, self._conflicts, previous, self.alignment)
            offsets.update(placed)
            arena = self._arenas.get(device)
            if arena is None or arena.numel() < total:
                with torch.inference_mode(False):
                    arena = torch.empty(total, dtype=torch.uint8, device=device)
            arenas[device] = arena
        # Views that stay valid: same arena, offset and spec (their scratch buffers keep the
        # address).
        views = {
            key: view for key, view in self._views.items()
            if key in offsets and offsets[key] == self._offsets.get(key)
            and self._specs[key] == self._planned_specs.get(key)
            and arenas[self._specs[key].device] is self._arenas.get(self._specs[key].device)
        }
        # A replaced arena is freed once nothing views it any more: the compute parameters
        # drop their views at this boundary (FlatParamGroup.drop_gathered_views); a graph
        # retained from before keeps its saved tensors' memory, unchanged (and raises if
        # backwarded: FSDPState._checked_pre_backward).
        self._arenas, self._offsets, self._views = arenas, offsets, views
        self._planned_specs = dict(self._specs)
        self._regions = {
            key: (spec.device, offsets[key], offsets[key] + spec.nbytes)
            for key, spec in self._planned_specs.items()
        }
        self._scratch, self._current = {}, {}  # nothing is live
        self._planned = True
        self.replans += 1
        self.outside_arena = 0

    def release(self) -> None:
        """Drop the arena and the trace (between steps: no scratch buffer may be live); the next
        iteration records again."""
        if self._live:
            raise RuntimeError(
                f"release_memory_pool(): scratch buffers {sorted(map(repr, self._live))} are "
                "in use; call it between steps (after the optimizer step, before the next "
                "forward), not between forward and backward or inside an accumulation window"
            )
        self._reset_trace()  # the arena is freed once nothing views it (see _replan)
