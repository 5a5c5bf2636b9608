"""Coalesced refresh all-gathers (``fully_shard(..., refresh_bucket_size_mb=...)``; see [Note:
refresh buckets] in ``megatron_fsdp_v2/_refresh_buckets.py``).

Each case trains a many-small-units model twice on the same ranks and data: once with one
refresh all-gather per flat group (``refresh_bucket_size_mb=None``, what the parity tests
compare with single-process PyTorch) and once coalesced, and requires bitwise the same losses
and parameters (copies move bits). The coalesced run must issue fewer all-gathers
(``CommDebugMode``), report what it coalesced, hold no refresh bucket after a forward, and keep
its temporary peak within two buckets. Variants: no overlap, a unit skipped by control flow,
an inference-mode forward between steps, a forward that raises half-way (recovery), the
trace-planned pool, uneven shards at world 3. The argument checks are shared with
``reduce_bucket_size_mb`` in ``test_coalescing.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

# private: the refresh coalescer's counters and the allocator's live and peak bytes
from megatron_fsdp_v2._registry import state_of

from _comm_counts import CollectiveCounts
from _training import final_params, train_steps

UNITS = 6
STEPS = 4
TIMEOUT_S = 180.0
# Gathered bytes of one Linear(8, 8) unit: 72 fp32 elements padded to the world (288+ bytes).
TINY, MID, HUGE = 1e-6, 0.0007, 100.0  # one group per bucket; 2-3 units; everything at once


class Units(nn.Module):
    """``UNITS`` wrapped ``Linear(8, 8)`` units, an odd-shaped unit and a root-owned head;
    ``skip``: the unit to leave out of the next forward; ``fail``: raise after unit 2."""

    def __init__(self) -> None:
        super().__init__()
        self.units = nn.ModuleList(nn.Linear(8, 8) for _ in range(UNITS))
        self.odd = nn.Linear(8, 3)
        self.head = nn.Linear(3, 1)
        self.skip: int | None = None
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, unit in enumerate(self.units):
            if self.fail and index == 3:
                raise RuntimeError("injected forward failure")
            if index != self.skip:
                x = torch.tanh(unit(x))
        return self.head(self.odd(x))


def _all_gathers(comm: CollectiveCounts) -> int:
    return sum(n for op, n in comm.get_comm_counts().items()
               if "all_gather" in str(op) or "allgather" in str(op))


def _rank_run(rank: int, world: int, strategy: str, bucket_mb: float | None, mp: str,
              variant: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Units()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp == "bf16" else None
    wrap: dict[str, Any] = dict(sharding_strategy=strategy, mp_policy=policy,
                                refresh_bucket_size_mb=bucket_mb,
                                overlap=variant != "sync", enable_trace_pool=variant == "pool")
    for module in [*model.units, model.odd]:
        fully_shard(module, **wrap)
    fully_shard(model, **wrap)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1234)
    batches = [[(torch.randn(world, 4, 8, generator=gen), torch.randn(world, 4, 1, generator=gen))]
               for _ in range(STEPS)]
    evaluated: dict[int, torch.Tensor] = {}  # step -> the inference-mode forward's loss
    gathers, live_after_forward = [], []

    def between_steps(step: int) -> None:
        x, y = batches[step][0]
        if variant == "fail" and step == 2:
            # Raises in the middle of the forward, refresh buckets issued or planned: recovered
            # at once, and training goes on identically.
            model.fail = True
            with pytest.raises(RuntimeError, match="injected"):
                model(x[rank])
            model.fail = False
        if variant == "eval" and step == 2:
            # Refreshes everything (bucket copies written under inference mode); the training
            # forward then finds every group fresh.
            with torch.inference_mode():
                evaluated[step] = F.mse_loss(model(x[rank]), y[rank]).clone()
        model.skip = 2 if variant == "skip" and step == 2 else None

    def counted_forward(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with CollectiveCounts() as comm:
            loss = F.mse_loss(m(batch[0]), batch[1])
        live_after_forward.append(state_of(m).ctx.allocator.live_bytes)  # type: ignore
        gathers.append(_all_gathers(comm))
        return loss

    per_step = train_steps(model, opt, batches, counted_forward, rank=rank,
                           select=lambda parts, r: (parts[0][r], parts[1][r]), mark=None,
                           divide_by_micro=False, before_step=between_steps)
    losses = []
    for step, (loss,) in enumerate(per_step):
        losses += [evaluated[step]] if step in evaluated else []
        losses.append(loss)
    coalescer = state_of(model).ctx.refresh_coalescer  # type: ignore[union-attr]
    return {
        "losses": torch.stack(losses),
        "params": final_params(model),
        "gathers": gathers,
        "live_after_forward": live_after_forward,
        "stats": None if coalescer is None else (coalescer.coalesced_collectives,
                                                 coalescer.coalesced_groups),
    }


# (world, strategy, bucket size, mixed precision, variant)
CASES = [
    (2, "optim", HUGE, "fp32", "plain"),
    (2, "optim", MID, "fp32", "plain"),
    (2, "optim", TINY, "fp32", "plain"),
    (2, "optim_grads", MID, "fp32", "plain"),
    (2, "optim", MID, "bf16", "plain"),
    (2, "optim_grads", HUGE, "bf16", "plain"),
    (2, "optim", MID, "fp32", "sync"),
    (2, "optim_grads", HUGE, "fp32", "sync"),
    (2, "optim", MID, "fp32", "skip"),
    (2, "optim_grads", HUGE, "bf16", "skip"),
    (2, "optim", MID, "fp32", "eval"),
    (2, "optim_grads", MID, "bf16", "eval"),
    (2, "optim", MID, "bf16", "pool"),
    (2, "optim_grads", MID, "fp32", "pool"),
    (2, "optim", MID, "fp32", "fail"),
    (2, "optim_grads", HUGE, "fp32", "fail"),
    (3, "optim", MID, "fp32", "plain"),
    (3, "optim_grads", HUGE, "bf16", "skip"),
    (3, "optim", MID, "bf16", "fail"),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,strategy,bucket,mp,variant", CASES,
                         ids=[f"w{c[0]}-{c[1]}-{c[2]}MB-{c[3]}-{c[4]}" for c in CASES])
def test_coalesced_refresh_matches(ranks: Any, world: int, strategy: str, bucket: float, mp: str,
                                   variant: str) -> None:
    base = ranks.run(_rank_run, world, strategy, None, mp, variant, timeout_s=TIMEOUT_S)
    coal = ranks.run(_rank_run, world, strategy, bucket, mp, variant, timeout_s=TIMEOUT_S)
    for rank, (b, c) in enumerate(zip(base, coal)):
        pairs = [("losses", b["losses"], c["losses"])] + [
            (f"parameter {i}", x, y) for i, (x, y) in enumerate(zip(b["params"], c["params"]))]
        for what, x, y in pairs:
            assert torch.equal(x, y), (
                f"rank {rank} {what}: coalesced refresh differs from per-group refresh, max abs "
                f"diff {(x.float() - y.float()).abs().max().item() if x.numel() else 0}")
        # No refresh bucket outlives a forward.
        assert c["live_after_forward"] == b["live_after_forward"], (
            c["live_after_forward"], b["live_after_forward"])
    b, c = base[0], coal[0]
    assert b["stats"] is None
    collectives, groups = c["stats"]
    # Step 0 refreshes nothing: the weights are fresh after wrapping.
    assert b["gathers"][0] == c["gathers"][0] == 0
    if bucket == TINY:
        assert (collectives, groups) == (0, 0)
        assert c["gathers"] == b["gathers"]
        return
    assert collectives >= 1 and groups > collectives, c["stats"]
    assert sum(c["gathers"]) < sum(b["gathers"]), (c["gathers"], b["gathers"])
    if variant not in ("fail", "eval"):  # their extra forward's gathers were not counted
        assert sum(b["gathers"]) - sum(c["gathers"]) == groups - collectives, (
            b["gathers"], c["gathers"], c["stats"])
    if bucket == HUGE and variant in ("plain", "sync"):
        # One bucket for every group (the root's own group is planned with the units').
        assert c["gathers"][1:] == [1] * (STEPS - 1), c["gathers"]


def _train_peak(rank: int, world: int, bucket_mb: float | None) -> int:
    """The temporary peak during forwards that refresh (MID buckets vs none)."""
    torch.manual_seed(0)
    model = Units()
    for module in [*model.units, model.odd]:
        fully_shard(module, sharding_strategy="optim", refresh_bucket_size_mb=bucket_mb)
    fully_shard(model, sharding_strategy="optim", refresh_bucket_size_mb=bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    peak = 0
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        allocator = state_of(model).ctx.allocator  # type: ignore[union-attr]
        before = allocator.live_bytes
        allocator.reset_peak()
        model(torch.randn(4, 8))
        peak = max(peak, allocator.peak_bytes - before)
        opt.zero_grad()
    return peak


@pytest.mark.timeout(300)
def test_at_most_two_buckets_alive(ranks: Any) -> None:
    """Temporary memory of a forward that refreshes: none without buckets, at most two buckets
    (of at most the bucket size each) with them."""
    none = ranks.run(_train_peak, 2, None, timeout_s=TIMEOUT_S)
    mid = ranks.run(_train_peak, 2, MID, timeout_s=TIMEOUT_S)
    for n, m in zip(none, mid):
        assert n == 0, n
        assert 0 < m <= 2 * int(MID * (1 << 20)), m


def _other_strategies(rank: int, world: int, strategy: str) -> list[int]:
    """no_shard and ZeRO-3 accept the option and issue exactly what they issue without it."""
    counts = []
    for bucket_mb in (None, HUGE):
        torch.manual_seed(0)
        model = Units()
        for module in [*model.units, model.odd]:
            fully_shard(module, sharding_strategy=strategy, refresh_bucket_size_mb=bucket_mb)
        fully_shard(model, sharding_strategy=strategy, refresh_bucket_size_mb=bucket_mb)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with CollectiveCounts() as comm:
            for _ in range(2):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
        counts.append(comm.get_total_counts())
        coalescer = state_of(model).ctx.refresh_coalescer  # type: ignore[union-attr]
        assert (coalescer is None) == (bucket_mb is None)
        assert coalescer is None or coalescer.coalesced_collectives == 0
    return counts


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_other_strategies_unaffected(ranks: Any, strategy: str) -> None:
    for without, with_buckets in ranks.run(_other_strategies, 2, strategy, timeout_s=TIMEOUT_S):
        assert without == with_buckets
