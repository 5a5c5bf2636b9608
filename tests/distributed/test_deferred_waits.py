"""Waiting never launches a collective (see [Note: who issues collectives] in
``megatron_fsdp_v2/_runtime/_issuer.py``): every ``finish()`` of what the schedule waits on
(an issued collective's ``Pending``, or a ``Deferred`` that completes something issued before:
a reduction or refresh bucket, a gather of several buffers, the end of a gradient window) only
waits and finishes. A collective launched inside a wait runs where the waiting code happens to
wait, which the ranks' schedules need not agree on.

Counted at the dispatcher (``CollectiveCounts``, a witness independent of the library): the
whole training loop runs under it, and every ``finish()`` of the issuer module's handle classes
is wrapped to compare the count before and after. The run uses both kinds of buckets with
``overlap=True`` and enough groups for several buckets of each, so the waits that complete a
bucket (and, before this was restructured, issued the next refresh bucket) are exercised.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_refresh_buckets import Units

from megatron_fsdp_v2 import fully_shard

# private: the tree's runtime context (what the schedule waits on)
from megatron_fsdp_v2._registry import state_of

# private: the issuer's wait handles (Pending / Deferred)
from megatron_fsdp_v2._runtime import _issuer

from _comm_counts import CollectiveCounts

STEPS = 3
TIMEOUT_S = 120.0
# Two of the model's groups per bucket (96 fp32 elements each at world 2): four buckets of
# each kind per step.
BUCKET_MB = 0.001


def _train_counting_waits(rank: int, world: int, strategy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Units()
    wrap: dict[str, Any] = dict(sharding_strategy=strategy, overlap=True,
                                refresh_bucket_size_mb=BUCKET_MB,
                                reduce_bucket_size_mb=BUCKET_MB)
    for module in [*model.units, model.odd]:
        fully_shard(module, **wrap)
    fully_shard(model, **wrap)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1234)
    seen = {"finishes": 0, "launched_inside": 0}
    comm = CollectiveCounts()
    # Pending and, where it exists, Deferred: whatever the issuer module hands to waiters.
    handles = [cls for cls in (getattr(_issuer, n, None) for n in ("Pending", "Deferred"))
               if isinstance(cls, type) and hasattr(cls, "finish")]
    originals = {cls: cls.__dict__["finish"] for cls in handles}

    def counting(original: Any) -> Any:
        def finish(self: Any) -> None:
            before = comm.get_total_counts()
            original(self)
            seen["finishes"] += 1
            seen["launched_inside"] += comm.get_total_counts() - before
        return finish

    try:
        for cls, original in originals.items():
            cls.finish = counting(original)  # type: ignore[method-assign]
        with comm:
            for _ in range(STEPS):
                x, y = torch.randn(world, 4, 8, generator=gen), torch.randn(world, 4, 1,
                                                                            generator=gen)
                F.mse_loss(model(x[rank]), y[rank]).backward()
                opt.step()
                opt.zero_grad()
            total = comm.get_total_counts()
    finally:
        for cls, original in originals.items():
            cls.finish = original  # type: ignore[method-assign]
    ctx = state_of(model).ctx  # type: ignore[union-attr]
    assert ctx is not None and ctx.coalescer is not None and ctx.refresh_coalescer is not None
    return {
        **seen, "total": total,
        "reduce_buckets": ctx.coalescer.coalesced_collectives,
        "refresh_buckets": ctx.refresh_coalescer.coalesced_collectives,
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["optim", "no_shard"])
def test_waiting_never_launches_a_collective(ranks: Any, strategy: str) -> None:
    results = ranks.run(_train_counting_waits, 2, strategy, timeout_s=TIMEOUT_S)
    for rank, r in enumerate(results):
        # The run is the one meant: buckets of both kinds (refresh only where compute weights
        # are refreshed), several refresh buckets per forward so that completing one had a
        # next one to issue, and many waits.
        assert r["reduce_buckets"] >= 3 * STEPS, r
        if strategy == "optim":  # step 0 refreshes nothing
            assert r["refresh_buckets"] >= 3 * (STEPS - 1), r
        assert r["finishes"] > 0 and r["total"] > 0, r
        assert r["launched_inside"] == 0, (
            f"rank {rank}: {r['launched_inside']} of {r['total']} collectives were launched "
            f"inside a wait (finish()) ({r})")
