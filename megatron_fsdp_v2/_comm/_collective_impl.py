"""Which ``torch.distributed`` calls carry each logical collective (``fully_shard(...,
collective_impl=...)``), and the per-group accounting of what ran.

[Note: collective implementation]
The buffer plan names *logical* collectives (all-gather, reduce-scatter, all-reduce of one flat
buffer). ``"native"`` issues each as the matching flat-tensor call. ``"auto"`` may issue an
equivalent that measured faster on the group's backend, chosen by :func:`choose` from
:data:`RULES` (one table, per backend, by buffer bytes and group size). An equivalent must need
no new full-size temporary and give bitwise the same result:

* reduce-scatter as an in-place all-reduce of the input scratch buffer that already exists, this
  rank's slot of it then being the result (copied into a separate output, a shard-sized copy). Only
  the slot is read afterwards: the rest of the input scratch buffer is never read after a reduction
  (a scratch buffer, or ``main_grad`` outside the optimizer-facing part). Bitwise the same on
  gloo where measured: ``benchmarks/bench_collectives.py --check-bitwise`` compares the two at
  every size and group size the rules substitute, and the tests repeat that check at 3 and 4
  ranks.
* all-gather as one broadcast per rank, each from that rank's slot of the output (this rank's
  shard copied into its slot first unless it already is that slot, the in-place refresh), all
  issued asynchronously and waited on together. Broadcasts copy bits, so this is exact.

Which implementation runs is decided in the collectives layer (``_collectives.py``): a group's
issuer (``GroupIssuer.launch`` in ``_runtime/_issuer.py``) passes its :class:`GroupCollectives` to
the collective functions, which ask it and count into it. Collectives launched outside an
issuer (wrap-time broadcasts, the gradient norm all-reduce of clipping, checkpoints, the debug
order check) are native and not counted.
Every rank decides alike (backend, bytes and group size agree across ranks), so ranks always
pair the same calls; ``check_ranks`` makes every rank agree on ``collective_impl`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ._backends import backend_for

__all__ = [
    "COLLECTIVE_IMPLS", "CollectiveCount", "GroupCollectives", "Rule", "RULES", "backend_of",
    "choose", "parse_collective_impl",
]

COLLECTIVE_IMPLS = ("native", "auto")

# Logical collectives (what the plan names) and what may be issued for them.
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
BROADCASTS = "broadcast"


def parse_collective_impl(value: object) -> str:
    """``fully_shard``'s ``collective_impl`` argument, checked."""
    if not isinstance(value, str):
        raise TypeError(
            f"collective_impl must be a string, one of {COLLECTIVE_IMPLS}, got "
            f"{type(value).__name__}"
        )
    if value not in COLLECTIVE_IMPLS:
        raise ValueError(
            f"collective_impl must be one of {COLLECTIVE_IMPLS}, got {value!r}: 'native' issues "
            "the documented collectives, 'auto' the fastest bitwise-equivalent ones measured on "
            "the backend"
        )
    return value


@dataclass(frozen=True)
class Rule:
    """Issue ``logical`` as ``issued`` on groups of ``min_world``..``max_world`` ranks when the
    full buffer has ``min_bytes``..``max_bytes`` bytes (``None``: no upper bound)."""

    logical: str
    issued: str
    min_world: int = 2
    max_world: int | None = None
    min_bytes: int = 0
    max_bytes: int | None = None

    def applies(self, logical: str, nbytes: int, world: int) -> bool:
        return (
            logical == self.logical
            and self.min_world <= world <= (self.max_world or world)
            and self.min_bytes <= nbytes <= (self.max_bytes if self.max_bytes is not None
                                             else nbytes)
        )


# The ``auto`` rules per backend, first match wins; no match (or a backend not listed, NCCL
# included): native. Decided by ``benchmarks/bench_collectives.py`` (gloo, fp32, median of the
# slowest rank over 5-9 repetitions, torch 2.14.1, 2 CPU cores shared with other jobs), ratios
# native time / substitute time (> 1: the substitute is faster), one figure per run of
#
#   python benchmarks/bench_collectives.py [--reps 9] [--sizes ...]
#
#   world  buffer    reduce-scatter/all-reduce  all-gather/bcasts   in-place all-gather/bcasts
#     2    256 KiB   1.88 5.07 0.81             1.17 0.56 1.15      1.08 0.30 1.60
#     2      1 MiB   1.74 2.61 1.11             1.30 1.22 0.74      1.32 1.22 0.73
#     2      4 MiB   1.32 2.35 2.33 1.39        3.51 2.42 1.80 0.41 2.27 0.55 1.75 0.75
#     2      8 MiB   1.52 1.49                  0.85 1.49           0.78 1.02
#     2     16 MiB   1.47 1.77                  1.86 1.56           1.64 1.54
#     2    128 MiB   2.16 2.12                  5.77 4.64           4.00 4.46
#     4      1 MiB   1.11 1.12 2.19             1.88 1.47 1.07      1.55 0.74 0.90
#     4      4 MiB   1.25 1.97 1.11 1.51        1.87 2.18 2.33 0.84 2.32 2.16 3.47 1.05
#     4     16 MiB   1.49 0.86                  1.50 1.23           1.35 1.55
#     4    128 MiB   1.68 2.66                  3.17 10.7           3.12 10.4
#
# (all runs, 3 ranks included: design.md "Collective selection"). The all-reduce beats the
# reduce-scatter from 1 MiB in all but one of the measured points; the broadcasts beat the
# all-gather only from 16 MiB on every run of this shared machine (below, the ratios swung
# across 1). Re-measured on the quiet machine (nothing else running), two runs,
# ``--world 2 4 --sizes 256K 1M 4M 8M 16M 64M --reps 7`` and ``--sizes 4M 8M 12M --reps 9``:
#
#   world  buffer    all-gather/bcasts   in-place all-gather/bcasts
#     2      1 MiB   1.64                1.69
#     2      4 MiB   1.07 2.20           0.98 1.47
#     2      8 MiB   1.48 2.23           1.49 2.19
#     2     12 MiB   1.62                1.65
#     4      1 MiB   1.39                1.37
#     4      4 MiB   1.74 1.55           1.31 1.31
#     4      8 MiB   1.20 1.17           1.29 1.22
#     4     12 MiB   1.62                1.49
#
# so the broadcasts take over from 4 MiB (27 of the 28 points at or above it won; the other 0.98).
# Bitwise equality of the reduce-scatter substitute: ``--check-bitwise --world 2 3 4``
# (identical at every size, fp32 and bf16).
#
# NCCL: no rule. Its reduce-scatter and all-gather move fewer bytes than the substitutes and
# are the faster ones on GPUs; change this only with a GPU measurement of the same benchmark.
GLOO_REDUCE_SCATTER_MIN_BYTES = 1 << 20
GLOO_ALL_GATHER_MIN_BYTES = 4 << 20
RULES: dict[str, tuple[Rule, ...]] = {
    "gloo": (
        Rule(REDUCE_SCATTER, ALL_REDUCE, min_bytes=GLOO_REDUCE_SCATTER_MIN_BYTES),
        Rule(ALL_GATHER, BROADCASTS, min_bytes=GLOO_ALL_GATHER_MIN_BYTES),
    ),
}


def choose(impl: str, backend: str, logical: str, nbytes: int, world: int) -> str:
    """What to issue for the logical collective ``logical`` over a ``nbytes``-byte full buffer
    on a ``world``-rank group of ``backend``: ``logical`` itself under ``"native"``."""
    if impl == "native" or world < 2:
        return logical
    for rule in RULES.get(backend, ()):
        if rule.applies(logical, nbytes, world):
            return rule.issued
    return logical


def backend_of(process_group: dist.ProcessGroup, device_type: str) -> str:
    """The backend that runs ``process_group``'s collectives on tensors of ``device_type`` (a group
    may have one backend per device type, e.g. ``"cpu:gloo,cuda:nccl"``, and no backend string
    at all: see ``[Note: backend detection]``); ``""`` when it has none for that device."""
    return backend_for(process_group, device_type)


@dataclass
class CollectiveCount:
    """One (logical, issued) pair's totals since the last reset: ``calls`` logical collectives,
    ``ops`` ``torch.distributed`` calls issued for them (a broadcast gather issues one per
    rank), ``bytes`` of the full buffers they ran over (the gathered output, or the reduced
    input), the same under either implementation."""

    calls: int = 0
    ops: int = 0
    bytes: int = 0


class GroupCollectives:
    """One flat group's implementation setting, decisions and accounting."""

    __slots__ = ("impl", "counts", "_decided")

    def __init__(self, impl: str) -> None:
        self.impl = impl
        self.counts: dict[tuple[str, str], CollectiveCount] = {}
        # (logical, group, bytes, device type) -> issued; a group has a handful of buffers.
        self._decided: dict[tuple[str, dist.ProcessGroup, int, str], str] = {}

    def choose(self, logical: str, process_group: dist.ProcessGroup, nbytes: int,
               device_type: str) -> str:
        key = (logical, process_group, nbytes, device_type)
        issued = self._decided.get(key)
        if issued is None:
            if self.impl == "native":
                issued = logical
            else:
                issued = choose(self.impl, backend_of(process_group, device_type), logical, nbytes,
                                dist.get_world_size(process_group))
            self._decided[key] = issued
        return issued

    def record(self, logical: str, issued: str, ops: int, nbytes: int) -> None:
        count = self.counts.get((logical, issued))
        if count is None:
            count = self.counts[(logical, issued)] = CollectiveCount()
        count.calls += 1
        count.ops += ops
        count.bytes += nbytes

    def reset(self) -> None:
        self.counts.clear()


def merge_counts(
    many: list[dict[tuple[str, str], CollectiveCount]],
) -> dict[tuple[str, str], CollectiveCount]:
    """The sum of several groups' counts (copies: later collectives do not change them)."""
    total: dict[tuple[str, str], CollectiveCount] = {}
    for counts in many:
        for key, count in counts.items():
            into = total.setdefault(key, CollectiveCount())
            into.calls += count.calls
            into.ops += count.ops
            into.bytes += count.bytes
    return dict(sorted(total.items()))
