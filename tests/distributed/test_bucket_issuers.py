"""A bucket's collective is the bucket's, not its first member's (see [Note: who issues
collectives] in ``megatron_fsdp_v2/_runtime/_issuer.py``): the tree's reduction and refresh
buckets launch through their own issuer accounts (``BucketIssuers``), so a member group's
account (what its unit's ``collective_stats`` reports) counts only the collectives that group
issued on its own, and the root's ``collective_stats`` counts every collective that reached the
dispatcher (``CollectiveCounts``, a witness independent of the library).

Every group is refreshed once per step after the first (``optim``: the replicated compute
weights) and reduced once per step (the accumulate path's one reduce-scatter), on its own or
in a bucket; the coalescers report how many groups their buckets covered.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_refresh_buckets import Units

from megatron_fsdp_v2 import fully_shard

# private: reads the tree's runtime context (its bucket issuers)
from megatron_fsdp_v2._registry import state_of

from _comm_counts import CollectiveCounts

STEPS = 3
TIMEOUT_S = 120.0
BUCKET_MB = 0.001  # two of the model's groups per bucket at world 2 (96 fp32 elements each)


def _calls(counts: dict[tuple[str, str], Any], logical: str) -> int:
    return sum(c.calls for (name, _), c in counts.items() if name == logical)


def _train_and_count(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Units()
    wrap: dict[str, Any] = dict(sharding_strategy="optim", overlap=True,
                                refresh_bucket_size_mb=BUCKET_MB, reduce_bucket_size_mb=BUCKET_MB)
    for module in [*model.units, model.odd]:
        fully_shard(module, **wrap)
    fully_shard(model, **wrap)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1234)
    with CollectiveCounts() as comm:
        for _ in range(STEPS):
            x, y = torch.randn(world, 4, 8, generator=gen), torch.randn(world, 4, 1, generator=gen)
            F.mse_loss(model(x[rank]), y[rank]).backward()
            opt.step()
            opt.zero_grad()
    ctx = state_of(model).ctx  # type: ignore[union-attr]
    assert ctx is not None and ctx.coalescer is not None and ctx.refresh_coalescer is not None
    groups = list(ctx.groups)
    own = [g.collectives.counts for g in groups]
    root = model.collective_stats()  # type: ignore[operator]
    return {
        "groups": len(groups),
        "own_gathers": sum(_calls(c, "all_gather") for c in own),
        "own_reductions": sum(_calls(c, "reduce_scatter") for c in own),
        "root_calls": sum(c.calls for c in root.values()),
        "dispatched": comm.get_total_counts(),
        "refresh": (ctx.refresh_coalescer.coalesced_collectives,
                    ctx.refresh_coalescer.coalesced_groups),
        "reduce": (ctx.coalescer.coalesced_collectives, ctx.coalescer.coalesced_groups),
    }


@pytest.mark.timeout(300)
def test_buckets_are_counted_as_their_own(ranks: Any) -> None:
    for rank, r in enumerate(ranks.run(_train_and_count, 2, timeout_s=TIMEOUT_S)):
        n = r["groups"]
        refresh_buckets, refreshed_in_buckets = r["refresh"]
        reduce_buckets, reduced_in_buckets = r["reduce"]
        assert refresh_buckets >= 2 and reduce_buckets >= 2, r  # the run is the one meant
        # A member's account holds only what it issued on its own.
        assert r["own_gathers"] == n * (STEPS - 1) - refreshed_in_buckets, (rank, r)
        assert r["own_reductions"] == n * STEPS - reduced_in_buckets, (rank, r)
        # The root reports every collective of the tree, buckets included, once.
        assert r["root_calls"] == r["dispatched"], (rank, r)
        assert r["root_calls"] == (r["own_gathers"] + r["own_reductions"] + refresh_buckets
                                   + reduce_buckets), (rank, r)
