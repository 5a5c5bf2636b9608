"""Overlapped schedule: same numbers as the synchronous one, prefetch order as designed, and
safety when control flow skips a prefetched unit.

The bitwise comparison has one test id per (strategy, skip) case, run on one pool of spawned
ranks (``_pool.RankPools``, restarted after any failure).
"""

from __future__ import annotations

import pytest
import torch

from megatron_fsdp_v2 import fully_shard

# private: the tree's runtime context (prefetch event log)
from megatron_fsdp_v2._registry import state_of
from megatron_fsdp_v2.testing import run_distributed

from _models import TinyGPT, all_ranks_ok, lm_loss, make_batches
from _pool import RankPools
from _training import final_params, train_steps

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


class SkippingGPT(TinyGPT):
    """Skips ``skip`` (a block index) when set: a prefetched unit that never runs."""

    skip: int | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                x = block(x)
        return self.head(self.ln_f(x))


def _trained_params(rank: int, world: int, strategy: str, overlap: bool, micro: int, steps: int = 4,
           skip_at: dict[int, int] | None = None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = SkippingGPT(layers=3)
    for block in model.blocks:
        fully_shard(block, sharding_strategy=strategy, overlap=overlap)
    fully_shard(model, sharding_strategy=strategy, overlap=overlap)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def skip_for(step: int) -> None:
        model.skip = (skip_at or {}).get(step)

    train_steps(model, opt, make_batches("lm", steps, micro, world, per_rank=2), lm_loss,
                rank=rank, clip_norm=1.0, before_step=skip_for)
    return final_params(model)


def _equal_worker(rank: int, world: int, strategy: str, skip_at: dict[int, int] | None) -> None:
    sync = _trained_params(rank, world, strategy, overlap=False, micro=2, skip_at=skip_at)
    overlapped = _trained_params(rank, world, strategy, overlap=True, micro=2, skip_at=skip_at)
    ok = all(torch.equal(a, b) for a, b in zip(sync, overlapped))
    assert all_ranks_ok(ok), f"{strategy} skip={skip_at}: overlap changed the numbers"


@pytest.mark.parametrize("skip_at", [None, {2: 1}], ids=["all-blocks", "skip-block1-at-step2"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", [2], ids=lambda w: f"w{w}")
def test_overlap_matches_synchronous_bitwise(ranks: RankPools, world_size: int, strategy: str,
                                             skip_at: dict[int, int] | None) -> None:
    ranks.run(_equal_worker, world_size, strategy, skip_at, timeout_s=300)


def _events_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = SkippingGPT(layers=3)
    for block in model.blocks:
        fully_shard(block, sharding_strategy="optim_grads_params")
    fully_shard(model, sharding_strategy="optim_grads_params")
    batches = make_batches("lm", 3, 1, world, per_rank=2)
    lm_loss(model, batches[0][0][rank]).backward()  # records the forward order
    ctx = state_of(model).ctx
    ctx.events = []
    lm_loss(model, batches[1][0][rank]).backward()
    expected = [
        # forward: each unit prefetches the next one in the recorded order
        ("unshard", "<root>"), ("prefetch", "blocks.0"),
        ("prefetch", "blocks.1"), ("reshard", "blocks.0"),
        ("prefetch", "blocks.2"), ("reshard", "blocks.1"),
        ("reshard", "blocks.2"),
        ("reshard", "<root>"),
        # backward: the root first (its outputs get gradients first), then each block gathers
        # itself only if not prefetched and prefetches the one before it
        ("unshard", "<root>"),
        ("unshard", "blocks.2"), ("prefetch", "blocks.1"), ("reshard", "blocks.2"),
        ("reduce", "blocks.2"),
        ("prefetch", "blocks.0"), ("reshard", "blocks.1"), ("reduce", "blocks.1"),
        ("reshard", "blocks.0"), ("reduce", "blocks.0"),
        # final callback: the root, whose inputs (token ids) never get gradients
        ("reshard", "<root>"), ("reduce", "<root>"),
    ]
    assert ctx.events == expected, f"\n got {ctx.events}\nwant {expected}"

    # A prefetched unit skipped by control flow is resharded at the root's post-forward.
    ctx.events = []
    model.skip = 1
    with torch.no_grad():
        model(batches[2][0][rank][:, :-1])
    assert ("prefetch", "blocks.1") in ctx.events, ctx.events
    assert ctx.events[-1] == ("reshard", "blocks.1"), ctx.events
    assert all(not g.is_gathered for s in ctx.states for g in s.groups)
    assert ctx.allocator.live_bytes == 0

    # ZeRO-1/2: all refresh all-gathers are launched at the root's pre-forward, in order.
    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    for block in model.blocks:
        fully_shard(block, sharding_strategy="optim_grads")
    fully_shard(model, sharding_strategy="optim_grads")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lm_loss(model, batches[0][0][rank]).backward()
    opt.step()
    ctx = state_of(model).ctx
    ctx.events = []
    lm_loss(model, batches[1][0][rank]).backward()
    assert ctx.events[:3] == [
        ("refresh", "<root>"), ("refresh", "blocks.0"), ("refresh", "blocks.1")
    ], ctx.events
    assert [e for e in ctx.events if e[0] == "reduce"] == [
        ("reduce", "blocks.1"), ("reduce", "blocks.0"), ("reduce", "<root>")
    ], ctx.events


@pytest.mark.parametrize("world_size", [2])
def test_event_order(world_size: int) -> None:
    run_distributed(_events_worker, world_size, timeout_s=120)
