"""``fully_shard(..., collective_impl=...)``: the selection table behaves as documented, the real
table (a group above gloo's thresholds: 1 MiB for reduce-scatter, 4 MiB for all-gather) trains
bitwise like ``"native"``, gloo's all-reduce matches its reduce-scatter bit for bit, and misuse
fails clearly. The trained cases with every collective substituted:
``test_collective_impl_parity.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _collective_impl import (
    TIMEOUT_S,
    _bits,
    _check,
)

from megatron_fsdp_v2 import CollectiveCount, fully_shard

# private: the collective-implementation rule table and its choices (impl.choose)
from megatron_fsdp_v2._comm import _collective_impl as impl

# private: a refused wrap leaves no unit state behind (state_of(model) is None)
from megatron_fsdp_v2._registry import state_of

from _models import TinyGPT
from _pool import RankPools

pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


# --------------------------------------------------------------------------- selection table


def test_native_never_substitutes() -> None:
    for logical in (impl.ALL_GATHER, impl.REDUCE_SCATTER, impl.ALL_REDUCE):
        for backend in ("gloo", "nccl"):
            assert impl.choose("native", backend, logical, 1 << 30, 4) == logical


def test_gloo_thresholds() -> None:
    rs, ag = impl.GLOO_REDUCE_SCATTER_MIN_BYTES, impl.GLOO_ALL_GATHER_MIN_BYTES
    assert impl.choose("auto", "gloo", impl.REDUCE_SCATTER, rs, 2) == impl.ALL_REDUCE
    assert impl.choose("auto", "gloo", impl.REDUCE_SCATTER, rs, 3) == impl.ALL_REDUCE
    assert impl.choose("auto", "gloo", impl.ALL_GATHER, ag, 4) == impl.BROADCASTS
    assert impl.choose("auto", "gloo", impl.REDUCE_SCATTER, rs - 1, 4) == impl.REDUCE_SCATTER
    assert impl.choose("auto", "gloo", impl.ALL_GATHER, ag - 1, 2) == impl.ALL_GATHER
    # All-reduces are never replaced; a group of one rank has nothing to choose.
    assert impl.choose("auto", "gloo", impl.ALL_REDUCE, 1 << 30, 4) == impl.ALL_REDUCE
    assert impl.choose("auto", "gloo", impl.ALL_GATHER, 1 << 30, 1) == impl.ALL_GATHER


@pytest.mark.parametrize("backend", ["nccl", "fake", "mpi"])
def test_other_backends_stay_native(backend: str) -> None:
    """No GPU measurement says otherwise: NCCL (and unmeasured backends) keep native."""
    for logical in (impl.ALL_GATHER, impl.REDUCE_SCATTER, impl.ALL_REDUCE):
        assert impl.choose("auto", backend, logical, 1 << 30, 4) == logical


def test_rules_are_equivalents() -> None:
    """Every rule replaces a collective by one this module implements as its equivalent."""
    allowed = {(impl.REDUCE_SCATTER, impl.ALL_REDUCE), (impl.ALL_GATHER, impl.BROADCASTS)}
    for backend, rules in impl.RULES.items():
        for rule in rules:
            assert (rule.logical, rule.issued) in allowed, (backend, rule)
    assert "nccl" not in impl.RULES


def test_rule_ranges() -> None:
    rule = impl.Rule(impl.ALL_GATHER, impl.BROADCASTS, min_world=3, max_world=4,
                     min_bytes=10, max_bytes=20)
    assert rule.applies(impl.ALL_GATHER, 10, 3) and rule.applies(impl.ALL_GATHER, 20, 4)
    assert not rule.applies(impl.ALL_GATHER, 9, 3) and not rule.applies(impl.ALL_GATHER, 21, 3)
    assert not rule.applies(impl.ALL_GATHER, 15, 2) and not rule.applies(impl.ALL_GATHER, 15, 5)
    assert not rule.applies(impl.REDUCE_SCATTER, 15, 3)


@pytest.mark.parametrize("value,error", [("fast", ValueError), ("Auto", ValueError),
                                         (None, TypeError), (1, TypeError)])
def test_parse(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="collective_impl must be"):
        impl.parse_collective_impl(value)
    assert impl.parse_collective_impl("auto") == "auto"


def test_accounting_merge() -> None:
    a = impl.GroupCollectives("auto")
    a.record(impl.ALL_GATHER, impl.BROADCASTS, 3, 12)
    b = impl.GroupCollectives("auto")
    b.record(impl.ALL_GATHER, impl.BROADCASTS, 3, 6)
    b.record(impl.ALL_REDUCE, impl.ALL_REDUCE, 1, 4)
    total = impl.merge_counts([a.counts, b.counts])
    assert total == {(impl.ALL_GATHER, impl.BROADCASTS): CollectiveCount(2, 6, 18),
                     (impl.ALL_REDUCE, impl.ALL_REDUCE): CollectiveCount(1, 1, 4)}
    a.reset()
    assert a.counts == {} and total[(impl.ALL_GATHER, impl.BROADCASTS)].calls == 2


# --------------------------------------------------------------------------- the real table


class _Wide(nn.Module):
    """One group above both gloo thresholds (16 MiB of fp32 weights and bias), one below both."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(2048, 2048)
        self.small = nn.Linear(2048, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(torch.tanh(self.big(x)))


def _real_table_worker(rank: int, world: int, strategy: str) -> None:
    results = {}
    for collective_impl in ("native", "auto"):
        torch.manual_seed(0)
        model = _Wide()
        fully_shard(model.big, sharding_strategy=strategy, collective_impl=collective_impl)
        fully_shard(model, sharding_strategy=strategy, collective_impl=collective_impl)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(7)
        for _ in range(2):
            x = torch.randn(world, 4, 2048, generator=g)[rank]
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        big = model.big.collective_stats()  # type: ignore[operator]
        whole = model.collective_stats()  # type: ignore[operator]
        results[collective_impl] = ([p.to_local().clone() for p in model.parameters()],
                                    big, whole)
    (n_params, _, n_whole), (a_params, a_big, a_whole) = results["native"], results["auto"]
    for a, b in zip(n_params, a_params):
        _check(torch.equal(_bits(a), _bits(b)), f"{strategy}: parameters differ")
    _check(all(k[0] == k[1] for k in n_whole), f"native substituted: {n_whole}")
    # The big unit's buffers are above the threshold: substituted; the root's small group not.
    _check(all(k[0] != k[1] for k in a_big), f"{strategy} big unit: {a_big}")
    small = {k: c for k, c in a_whole.items() if k not in a_big or c != a_big[k]}
    _check(all(k[0] == k[1] for k in small), f"{strategy} small root group: {a_whole}")


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_real_table(ranks: RankPools, strategy: str) -> None:
    ranks.run(_real_table_worker, 2, strategy, timeout_s=TIMEOUT_S)


# --------------------------------------------------------------------------- bitwise claim


def _rs_vs_ar_worker(rank: int, world: int) -> None:
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    """The substitution's premise on gloo: this rank's slot of an all-reduce equals the
    reduce-scatter's output bit for bit (mixed magnitudes, so a different summation order
    would show)."""
    for dtype in (torch.float32, torch.bfloat16):
        for n in (world, 7 * world, 4096 * world, 262144 * world):
            g = torch.Generator().manual_seed(100 + rank)
            x = (torch.randn(n, generator=g, dtype=torch.float64)
                 * 10.0 ** torch.randint(-4, 4, (n,), generator=g)).to(dtype)
            reduced = x.clone()
            dist.all_reduce(reduced)
            shard = torch.empty(n // world, dtype=dtype)
            reduce_scatter(shard, x)
            mine = reduced[rank * (n // world): (rank + 1) * (n // world)]
            _check(torch.equal(_bits(mine), _bits(shard)),
                   f"world {world} {dtype} {n}: all-reduce slot != reduce-scatter output")


@pytest.mark.parametrize("world", [3, 4])
def test_gloo_all_reduce_matches_reduce_scatter(ranks: RankPools, world: int) -> None:
    ranks.run(_rs_vs_ar_worker, world, timeout_s=TIMEOUT_S)


# --------------------------------------------------------------------------- misuse


def _invalid_worker(rank: int, world: int) -> None:
    model = TinyGPT()
    before = type(model)
    for value, error in (("fast", ValueError), (None, TypeError)):
        try:
            fully_shard(model, collective_impl=value)
        except error as e:
            assert "collective_impl must be" in str(e) and "native" in str(e), str(e)
        else:
            raise AssertionError(f"collective_impl={value!r} was accepted")
        assert type(model) is before and state_of(model) is None
        assert not any(hasattr(p, "to_local") for p in model.parameters())


def _disagree_worker(rank: int, world: int) -> None:
    try:
        fully_shard(TinyGPT(), collective_impl="auto" if rank == 0 else "native")
    except (ValueError, RuntimeError) as e:
        assert "collective_impl" in str(e), str(e)
    else:
        raise AssertionError("ranks with different collective_impl were not caught")


def test_invalid_value(ranks: RankPools) -> None:
    """Raised before any collective (a rank that raised alone would leave no peer waiting)."""
    ranks.run(_invalid_worker, 2, timeout_s=60)


def test_ranks_disagree(ranks: RankPools) -> None:
    ranks.run(_disagree_worker, 2, timeout_s=120)
