"""Coalesced delayed reductions (``fully_shard(..., reduce_bucket_size_mb=...)``; see [Note:
reduction buckets] in ``megatron_fsdp_v2/_coalesce.py``).

Each case trains the same many-small-units model twice on the same ranks and data: once with
one delayed collective per flat group (``reduce_bucket_size_mb=None``) and once coalesced,
and requires the same losses and parameters, bitwise (``no_shard`` on 3 ranks: gloo's ring sums
an all-reduce's chunks from different ranks, so moving a gradient to another offset may change
its last bit; there the tiny bucket, which issues exactly the uncoalesced collectives, must be
bitwise equal and the others within 1e-6). The uncoalesced runs are what the parity tests
compare with single-process PyTorch. The coalesced run must also issue fewer reductions
(``CommDebugMode``) and report what it coalesced; the strategies that reduce every micro-batch
must be unaffected. Every case runs under the rank pool's timeout. The bucket-size arguments:
``test_coalescing_options.py``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

# private: reads the reduction coalescer's counters, the group count and the allocator's peak
from megatron_fsdp_v2._registry import state_of

# private: the coalescer's in-flight bound and its flush/complete methods (recorded)
from megatron_fsdp_v2._runtime._coalesce import MAX_BUCKETS_IN_FLIGHT, ReductionCoalescer

from _comm_counts import CollectiveCounts
from _training import final_params, train_steps

UNITS = 5
STEPS = 3
TIMEOUT_S = 180.0
# One group per bucket; ~2 groups per bucket (838 bytes: a Linear(8, 8) unit's fp32 buffer is
# 384 bytes at 2 and 3 ranks, 72 elements aligned to 16 per rank); everything at once.
TINY, MID, HUGE = 1e-6, 0.0008, 100.0


class _FailInBackward(torch.autograd.Function):
    """Identity whose backward raises (a failure in the middle of backward, on every rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected backward failure")


class Units(nn.Module):
    """``UNITS`` wrapped ``Linear(8, 8)`` units, an odd-shaped unit, a root-owned head; with
    ``unused``: a wrapped unit that never runs and a root parameter that gets no gradient."""

    def __init__(self, unused: bool) -> None:
        super().__init__()
        self.units = nn.ModuleList(nn.Linear(8, 8) for _ in range(UNITS))
        self.odd = nn.Linear(8, 3)
        self.head = nn.Linear(3, 1)
        self.idle = nn.Linear(8, 8) if unused else None
        self.extra = nn.Parameter(torch.randn(5)) if unused else None
        self.checkpointed = False
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, unit in enumerate(self.units):
            if self.fail and index == 2:  # units after it have queued their reductions
                x = _FailInBackward.apply(x)
            if self.checkpointed:
                x = checkpoint(lambda t, u=unit: torch.tanh(u(t)), x, use_reentrant=False)
            else:
                x = torch.tanh(unit(x))
        return self.head(self.odd(x))


def _collectives(comm: CollectiveCounts) -> dict[str, int]:
    out = {"all_reduce": 0, "reduce_scatter": 0}
    for op, n in comm.get_comm_counts().items():
        name = str(op).split(".")[-1].rstrip("_")
        if "allreduce" in name or "all_reduce" in name:
            out["all_reduce"] += n
        elif "reduce_scatter" in name:
            out["reduce_scatter"] += n
    return out


def _rank_run(rank: int, world: int, strategy: str, bucket_mb: float | None, micro: int,
              mp: str, variant: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Units(unused=variant == "unused")
    model.checkpointed = variant == "checkpoint"
    policy = {
        "fp32": MixedPrecisionPolicy(),
        "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        "bf16_reduce": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                            reduce_dtype=torch.bfloat16),
    }[mp]
    wrap: dict[str, Any] = dict(sharding_strategy=strategy, mp_policy=policy,
                                reduce_bucket_size_mb=bucket_mb)
    for module in [*model.units, model.odd] + ([model.idle] if model.idle is not None else []):
        fully_shard(module, **wrap)
    if variant == "sync":
        wrap["overlap"] = False
    fully_shard(model, **wrap)
    params = list(model.parameters())
    # partial: the optimizer updates only the first units (the others keep accumulating).
    trained = params[: 2 * 3] if variant == "partial" else params
    opt = torch.optim.SGD(trained, lr=0.05, momentum=0.9)
    # The data in the order the generator drew it: the failing backward's input (step 1)
    # before that step's micro-batches.
    gen = torch.Generator().manual_seed(1234)
    failing_input, batches = None, []
    for step in range(STEPS):
        if variant == "fail" and step == 1:
            failing_input = torch.randn(4, 8, generator=gen)
        batches.append([(torch.randn(world, 4, 8, generator=gen),
                         torch.randn(world, 4, 1, generator=gen)) for _ in range(micro)])

    def fail_backward(step: int) -> None:
        if variant == "fail" and step == 1:
            # A backward that raises half-way, with reductions queued (or in flight): the next
            # forward recovers (gradients discarded) and training goes on identically.
            model.fail = True
            with pytest.raises(RuntimeError, match="injected"):
                F.mse_loss(model(failing_input), torch.zeros(4, 1)).backward()
            model.fail = False

    counters: list[CollectiveCounts] = []

    @contextlib.contextmanager
    def counted(step: int) -> Iterator[None]:
        with CollectiveCounts() as comm, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the finalize variant's warning
            yield
        counters.append(comm)

    last_loss: list[torch.Tensor] = []

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = F.mse_loss(m(batch[0]), batch[1]) / micro
        last_loss[:] = [loss]
        return loss

    def second_backward(step: int) -> None:  # "retain": a second backward over the retained graph
        model.set_is_last_backward(True)
        last_loss[0].backward()

    losses = train_steps(
        model, opt, batches, loss_fn, rank=rank,
        select=lambda parts, r: (parts[0][r], parts[1][r]), divide_by_micro=False,
        mark="never_last" if variant == "finalize" else "last_backward",
        retain_graph=variant == "retain",
        before_optimizer=second_backward if variant == "retain" else None,
        before_step=fail_backward, around_step=counted)
    counts = [_collectives(comm) for comm in counters]
    coalescer = state_of(model).ctx.coalescer  # type: ignore[union-attr]
    stats = None if coalescer is None else {
        "coalesced_collectives": coalescer.coalesced_collectives,
        "coalesced_groups": coalescer.coalesced_groups,
        "single_collectives": coalescer.single_collectives,
    }
    return {
        "losses": torch.stack([loss for step in losses for loss in step]),
        "params": final_params(model),
        "counts": counts,
        "stats": stats,
        "groups": sum(len(state_of(m).groups) for m in model.modules()  # type: ignore[union-attr]
                      if state_of(m) is not None),
        "peak": state_of(model).ctx.allocator.peak_bytes,  # type: ignore[union-attr]
    }


def _pair(ranks: Any, world: int, strategy: str, bucket_mb: float, micro: int = 1,
          mp: str = "fp32", variant: str = "plain") -> tuple[list[Any], list[Any]]:
    base = ranks.run(_rank_run, world, strategy, None, micro, mp, variant, timeout_s=TIMEOUT_S)
    coal = ranks.run(_rank_run, world, strategy, bucket_mb, micro, mp, variant,
                     timeout_s=TIMEOUT_S)
    return base, coal


def _assert_same(base: list[Any], coal: list[Any], exact: bool) -> None:
    for rank, (b, c) in enumerate(zip(base, coal)):
        pairs = [("losses", b["losses"], c["losses"])] + [
            (f"parameter {i}", x, y) for i, (x, y) in enumerate(zip(b["params"], c["params"]))]
        for what, x, y in pairs:
            if exact:
                assert torch.equal(x, y), (
                    f"rank {rank} {what}: coalesced differs from uncoalesced, max abs diff "
                    f"{(x.float() - y.float()).abs().max().item() if x.numel() else 0}")
            else:
                torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-7,
                                           msg=lambda m, r=rank, w=what: f"rank {r} {w}: {m}")


def _reductions(result: dict[str, Any], strategy: str) -> list[int]:
    op = "all_reduce" if strategy == "no_shard" else "reduce_scatter"
    return [c[op] for c in result["counts"]]


# (world, strategy, bucket size, micro-batches, mixed precision, variant)
CASES = [
    (2, "no_shard", HUGE, 1, "fp32", "plain"),
    (2, "no_shard", MID, 3, "fp32", "plain"),
    (2, "no_shard", TINY, 1, "fp32", "plain"),
    (2, "optim", HUGE, 3, "fp32", "plain"),
    (2, "optim", MID, 1, "fp32", "plain"),
    (2, "no_shard", MID, 1, "fp32", "unused"),
    (2, "optim", HUGE, 1, "fp32", "unused"),
    (2, "no_shard", HUGE, 3, "fp32", "partial"),
    (2, "optim", MID, 3, "fp32", "partial"),
    (2, "no_shard", HUGE, 3, "fp32", "finalize"),
    (2, "optim", HUGE, 1, "fp32", "finalize"),
    (2, "no_shard", HUGE, 1, "bf16", "plain"),
    (2, "optim", MID, 3, "bf16_reduce", "plain"),
    (2, "no_shard", HUGE, 3, "bf16_reduce", "plain"),
    (2, "no_shard", MID, 1, "fp32", "checkpoint"),
    (2, "optim", HUGE, 3, "fp32", "retain"),
    (2, "no_shard", MID, 3, "fp32", "retain"),
    (2, "no_shard", HUGE, 1, "fp32", "fail"),
    (2, "optim", MID, 3, "fp32", "fail"),
    (2, "no_shard", HUGE, 3, "fp32", "sync"),
    (3, "optim", HUGE, 1, "fp32", "plain"),
    (3, "optim", MID, 3, "fp32", "unused"),
    (3, "optim", TINY, 3, "bf16_reduce", "plain"),
    (3, "no_shard", TINY, 3, "fp32", "plain"),
    (3, "no_shard", HUGE, 1, "fp32", "plain"),
    (3, "no_shard", MID, 3, "fp32", "unused"),
]


# A partial optimizer leaves a group's reduced gradients installed. At 2 ranks with the 16-element
# alignment, the root's Linear(3, 1) group (96 elements) leaves rank 1 only padding: it installs
# zero-row gradient views like its peer installs real ones, and the next window's path (one
# collective, or one per micro-batch) is decided from a read both ranks agree on, so the
# "partial" cases issue the same collectives on every rank (once a strict xfail: the padding-
# only rank accumulated while the others reduced each micro-batch, and gloo aborted).


def _case(c: tuple[Any, ...]) -> Any:
    return pytest.param(*c, id=f"w{c[0]}-{c[1]}-{c[2]}MB-N{c[3]}-{c[4]}-{c[5]}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,strategy,bucket,micro,mp,variant", [_case(c) for c in CASES])
def test_coalesced_matches_uncoalesced(ranks: Any, world: int, strategy: str, bucket: float,
                                       micro: int, mp: str, variant: str) -> None:
    base, coal = _pair(ranks, world, strategy, bucket, micro, mp, variant)
    exact = strategy == "optim" or world == 2 or bucket == TINY
    _assert_same(base, coal, exact)
    b, c = base[0], coal[0]
    assert b["stats"] is None
    stats = c["stats"]
    per_step_base = _reductions(b, strategy)
    per_step_coal = _reductions(c, strategy)
    if variant in ("finalize", "sync"):
        # finalize: no backward was the last, so the optimizer step reduces each group at once;
        # sync (overlap=False): every reduction runs at once. Both uncoalesced.
        assert stats["coalesced_collectives"] == stats["single_collectives"] == 0, stats
        assert per_step_coal == per_step_base
        return
    # Every group reduces once per window, in a bucket or on its own: once per step, also the
    # groups a partial optimizer never clears (their window carries the installed gradients
    # aside and adds them back after its one collective, see [Note: gradients known without a
    # host read]); twice with "retain", whose second backward over the retained graph is a
    # window of its own.
    groups_reduced = stats["coalesced_groups"] + stats["single_collectives"]
    trained_groups = c["groups"] - (1 if variant == "unused" else 0)  # the idle unit
    windows = 2 if variant == "retain" else 1
    if variant == "fail":  # plus what the failed backward issued before it raised
        assert groups_reduced >= STEPS * trained_groups, (stats, c["groups"])
    else:
        assert groups_reduced == windows * STEPS * trained_groups, (stats, c["groups"])
    if bucket == TINY:
        assert stats["coalesced_collectives"] == 0, stats
        assert per_step_coal == per_step_base
        if mp == "bf16_reduce":  # each bucket in flight holds its group's cast workspace
            assert c["peak"] <= MAX_BUCKETS_IN_FLIGHT * b["peak"], (c["peak"], b["peak"])
        else:
            assert c["peak"] == b["peak"]  # no staging bucket
    else:
        assert stats["coalesced_collectives"] >= (1 if variant == "partial" else STEPS), stats
        assert sum(per_step_coal) < sum(per_step_base), (per_step_coal, per_step_base)
        if variant != "fail":  # its failed backward ran outside the counted steps
            assert sum(per_step_base) - sum(per_step_coal) == (
                stats["coalesced_groups"] - stats["coalesced_collectives"])
    if bucket == HUGE and variant not in ("partial", "retain"):
        assert per_step_coal == [1] * STEPS, per_step_coal  # one bucket for the whole model
    if bucket == MID:
        # At most MAX_BUCKETS_IN_FLIGHT buckets of MID MiB staged at once.
        assert c["peak"] - b["peak"] <= MAX_BUCKETS_IN_FLIGHT * (int(MID * (1 << 20)) + 64), (
            c["peak"], b["peak"])


def _bucket_order(rank: int, world: int) -> list[tuple[str, int]]:
    """The order in which the tree's reduction buckets are issued and completed in one step
    (bucket sizes that put about two units in a bucket: several buckets per backward)."""
    torch.manual_seed(0)
    model = Units(unused=False)
    for module in [*model.units, model.odd]:
        fully_shard(module, sharding_strategy="no_shard", reduce_bucket_size_mb=MID)
    fully_shard(model, sharding_strategy="no_shard", reduce_bucket_size_mb=MID)
    events: list[tuple[str, int]] = []
    ids: dict[int, int] = {}
    flush, complete = ReductionCoalescer.flush, ReductionCoalescer.complete

    def recording_flush(self: ReductionCoalescer) -> None:
        bucket = self._open
        flush(self)
        if bucket is not None and bucket.issued:
            events.append(("issue", ids.setdefault(id(bucket), len(ids))))

    def recording_complete(self: ReductionCoalescer, bucket: Any) -> None:
        done = bucket.done
        complete(self, bucket)
        if not done and bucket.done:
            events.append(("complete", ids.setdefault(id(bucket), len(ids))))

    x, y = torch.randn(4, 8), torch.randn(4, 1)
    F.mse_loss(model(x), y).backward()  # the first step also records the forward order
    model.zero_grad()  # the next window starts EMPTY: the one-collective path, coalesced
    ReductionCoalescer.flush = recording_flush  # type: ignore[method-assign]
    ReductionCoalescer.complete = recording_complete  # type: ignore[method-assign]
    try:
        F.mse_loss(model(x), y).backward()
    finally:
        ReductionCoalescer.flush = flush  # type: ignore[method-assign]
        ReductionCoalescer.complete = complete  # type: ignore[method-assign]
    return events


@pytest.mark.timeout(300)
def test_buckets_stay_in_flight(ranks: Any) -> None:
    """Bucket i+1 is issued before bucket i is completed (DDP-style overlap), and never more
    than ``MAX_BUCKETS_IN_FLIGHT`` issued buckets are unfinished."""
    for events in ranks.run(_bucket_order, 2, timeout_s=TIMEOUT_S):
        issued = [b for kind, b in events if kind == "issue"]
        assert len(issued) >= 3, events
        position = {event: i for i, event in enumerate(events)}
        for bucket in issued[1:]:
            assert position[("issue", bucket)] < position[("complete", bucket - 1)], events
        in_flight = 0
        for kind, _ in events:
            in_flight += 1 if kind == "issue" else -1
            assert in_flight <= MAX_BUCKETS_IN_FLIGHT, events


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_other_strategies_unaffected(ranks: Any, strategy: str) -> None:
    base, coal = _pair(ranks, 2, strategy, HUGE, micro=3)
    _assert_same(base, coal, exact=True)
    assert coal[0]["counts"] == base[0]["counts"]
    assert coal[0]["stats"] == {"coalesced_collectives": 0, "coalesced_groups": 0,
                                "single_collectives": 0}
