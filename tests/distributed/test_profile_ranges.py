"""Profiler ranges: a profiled training step shows each ``mfsdp::`` phase the strategy runs.

One test id per (strategy, overlap) case on one pool of 2 spawned gloo ranks
(``_pool.RankPools``). No timing is asserted: only which ranges appear (exactly the phases the
strategy's plan runs, on rank 0 and rank 1 alike) and that none appears outside a profiler's
window.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megatron_fsdp_v2 import clip_grad_norm_, fully_shard

# private: the names of the library's profiler ranges
from megatron_fsdp_v2._profiling import PHASES

from _models import TinyGPT, lm_loss, make_batches
from _pool import RankPools

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]

# Every strategy, every step: the hooks and the gradient path of the accumulate-then-reduce or
# reduce-each plans all reduce, wait and install.
_ALWAYS = {
    "mfsdp::unshard", "mfsdp::post_backward", "mfsdp::reduce", "mfsdp::wait",
    "mfsdp::finish_reduce", "mfsdp::install", "mfsdp::final_callback", "mfsdp::free",
    "mfsdp::optimizer_pre_step",
}
# What the plan adds: a refresh of replicated compute weights after a step (optim, optim_grads);
# a gather of sharded ones (optim_grads_params); staging of gradients (fp32 gradients go in
# place on the accumulate path, so no_shard and optim never stage; on the reduce-each path the
# root does, and ZeRO-3 every unit: see [Note: gradients in place]).
_BY_STRATEGY = {
    "no_shard": set(),
    "optim": {"mfsdp::refresh"},
    "optim_grads": {"mfsdp::refresh", "mfsdp::stage"},
    "optim_grads_params": {"mfsdp::gather", "mfsdp::stage"},
}


def _profiled_ranges(rank: int, world: int, strategy: str, overlap: bool) -> dict[str, set[str]]:
    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    for block in model.blocks:
        fully_shard(block, sharding_strategy=strategy, overlap=overlap)
    fully_shard(model, sharding_strategy=strategy, overlap=overlap)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micro = 2
    batches = make_batches("lm", 3, micro, world, per_rank=2)

    def step(s: int) -> None:
        for i in range(micro):
            model.set_is_last_backward(i == micro - 1)
            (lm_loss(model, batches[s][i][rank]) / micro).backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def names(events: object) -> set[str]:
        return {e.name for e in events if e.name.startswith("mfsdp::")}  # type: ignore[attr-defined]

    # Outside a profiler: no range is recorded (the guard in _profiling.traced). A profiler
    # started afterwards must not see ranges entered before it.
    step(0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(1)  # a step after an optimizer step: refreshes and gathers included
        step(2)
    profiled = names(prof.events())
    with profile(activities=[ProfilerActivity.CPU]) as idle:
        pass
    return {"profiled": profiled, "idle": names(idle.events())}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_profile_shows_each_phase(ranks: RankPools, strategy: str, overlap: bool) -> None:
    results = ranks.run(_profiled_ranges, 2, strategy, overlap, timeout_s=240)
    expected = _ALWAYS | _BY_STRATEGY[strategy]
    if not overlap or strategy == "optim_grads_params":
        # Synchronous collectives: every one without overlap; with overlap, the first unit's
        # gather (nothing prefetched it).
        expected |= {"mfsdp::sync_collective"}
    assert expected <= set(PHASES), sorted(expected - set(PHASES))
    for rank, result in enumerate(results):
        got = result["profiled"]
        assert got == expected, (
            f"rank {rank}: {strategy} (overlap={overlap}) lacks {sorted(expected - got)}, "
            f"shows unexpected {sorted(got - expected)}"
        )
        assert not result["idle"], f"rank {rank}: ranges outside the profiled steps"
