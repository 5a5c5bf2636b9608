"""Where each scratch buffer of the trace-planned pool sits in its arena: byte offsets such that
two scratch buffers that are ever live together never overlap, while scratch buffers that never are
share bytes. Pure arithmetic on sizes and conflicts (no tensors); the pool that traces the conflicts
and serves the scratch buffers is ``_trace_pool.py`` (see [Note: trace-planned pool] there).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping

__all__ = ["ARENA_ALIGNMENT", "plan_offsets"]

ARENA_ALIGNMENT = 256  # bytes: every scratch buffer starts at a multiple (any dtype, CUDA-friendly)


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def plan_offsets(
    sizes: Mapping[Hashable, int], conflicts: Mapping[Hashable, Collection[Hashable]],
    previous: Mapping[Hashable, int] | None = None, alignment: int = ARENA_ALIGNMENT,
) -> tuple[dict[Hashable, int], int]:
    """Byte offsets for scratch buffers of ``sizes`` bytes in one arena such that two scratch
    buffers that conflict (either direction of ``conflicts`` suffices) never overlap. Offsets of
    ``previous`` that are aligned and still valid are kept (stable addresses across a replan); the
    rest are placed largest first, each at the lowest aligned offset clear of its placed neighbours.
    Returns the offsets and the arena size in bytes (a multiple of ``alignment``)."""
    if alignment <= 0:
        raise ValueError(f"alignment must be positive, got {alignment}")
    neighbours: dict[Hashable, set[Hashable]] = {key: set() for key in sizes}
    for key, others in conflicts.items():
        for other in others:
            if key in sizes and other in sizes and other != key:
                neighbours[key].add(other)
                neighbours[other].add(key)
    placed: dict[Hashable, int] = {}

    def fits(key: Hashable, offset: int) -> bool:
        end = offset + sizes[key]
        for other in neighbours[key]:
            start = placed.get(other)
            if start is not None and start < end and offset < start + sizes[other]:
                return False
        return True

    index = {key: i for i, key in enumerate(sizes)}
    if previous:
        kept = [k for k in sizes if k in previous and previous[k] % alignment == 0]
        for key in sorted(kept, key=lambda k: (previous[k], index[k])):
            if fits(key, previous[key]):
                placed[key] = previous[key]
    for key in sorted((k for k in sizes if k not in placed), key=lambda k: (-sizes[k], index[k])):
        if sizes[key] == 0:
            placed[key] = 0
            continue
        candidates = sorted({0, *(_align(placed[o] + sizes[o], alignment)
                                  for o in neighbours[key] if o in placed)})
        # The last candidate (past every placed neighbour) always fits.
        placed[key] = next(c for c in candidates if fits(key, c))
    total = _align(max((placed[k] + sizes[k] for k in placed), default=0), alignment)
    return placed, total
