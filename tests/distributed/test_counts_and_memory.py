"""Per-iteration collective counts (the strategy contract) and per-role memory."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from megatron_fsdp_v2 import MixedPrecisionPolicy, clip_grad_norm_, fully_shard, memory_report

# private: the units' parameter groups, whose buffer sizes the counts are checked against
from megatron_fsdp_v2._registry import state_of

from _comm_counts import CollectiveCounts
from _models import TinyGPT, all_ranks_ok, lm_loss, make_batches
from _pool import RankPools

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _expected(strategy: str, micro: int) -> tuple[int, int, int]:
    """(all-gathers, reduce-scatters, all-reduces) per flat group per iteration."""
    return {
        "no_shard": (0, 0, 1),
        "optim": (1, 1, 0),
        "optim_grads": (1, micro, 0),
        "optim_grads_params": (2 * micro, micro, 0),
    }[strategy]


def _count(comm: CollectiveCounts, *names: str) -> int:
    counts = comm.get_comm_counts()
    return sum(v for k, v in counts.items() if str(k).split(".")[-1].rstrip("_") in names)


def _groups(model: torch.nn.Module) -> list:
    return [g for m in model.modules() if (s := state_of(m)) is not None for g in s.groups]


def _counts_worker(rank: int, world: int, strategy: str, set_to_none: bool) -> None:
    for micro in (1, 3):
        torch.manual_seed(0)
        model = TinyGPT(layers=3)
        for block in model.blocks:
            fully_shard(block, sharding_strategy=strategy)
        fully_shard(model, sharding_strategy=strategy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batches = make_batches("lm", 3, micro, world, per_rank=2)
        observed = []
        for step in range(3):
            with CollectiveCounts() as comm:
                for i in range(micro):
                    model.set_is_last_backward(i == micro - 1)
                    (lm_loss(model, batches[step][i][rank]) / micro).backward()
                clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
            observed.append((
                _count(comm, "_allgather_base", "all_gather_into_tensor",
                       "allgather_into_tensor_coalesced"),
                _count(comm, "_reduce_scatter_base", "reduce_scatter_tensor",
                       "reduce_scatter_tensor_coalesced"),
                _count(comm, "allreduce", "all_reduce"),
                sum(comm.get_comm_counts().values()),
            ))
        n = len(_groups(model))
        ag, rs, ar = _expected(strategy, micro)
        # Iteration 0 has no refresh to do (weights are fresh at wrap time); from then on
        # every iteration pays exactly the contract. Clipping adds one all-reduce of the
        # squared norm when gradients are sharded (replicated ones need none).
        clip = 0 if strategy == "no_shard" else 1
        steady = (ag * n, rs * n, ar * n + clip, ag * n + rs * n + ar * n + clip)
        for step, got in enumerate(observed[1:], start=1):
            assert got == steady, (
                f"{strategy} N={micro} iteration {step}: (AG, RS, AR, total) = {got}, "
                f"expected {steady} for {n} groups"
            )


@pytest.mark.parametrize("set_to_none", [True, False], ids=["zero_grad_to_none", "zero_grad_zeros"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_collective_counts(ranks: RankPools, strategy: str, set_to_none: bool) -> None:
    """The contract holds whether the optimizer sets gradients to None or zeroes them in place
    (zeroed no_shard/optim gradients used to keep one collective per micro-batch for good)."""
    ranks.run(_counts_worker, 2, strategy, set_to_none, timeout_s=300)


def _memory_worker(rank: int, world: int) -> None:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=torch.float32)
    reports = {}
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        model = TinyGPT(vocab=64, dim=32, layers=2, heads=2)
        content = sum(p.numel() for p in model.parameters())
        for block in model.blocks:
            fully_shard(block, sharding_strategy=strategy, mp_policy=mp)
        fully_shard(model, sharding_strategy=strategy, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(2):
            lm_loss(model, make_batches("lm", 1, 1, world, 2, seed=step)[0][0][rank]).backward()
            opt.step()
            opt.zero_grad()
        # The next forward refreshes replicated weights (ZeRO-1/2); they must be bitwise equal.
        with torch.no_grad():
            model(torch.zeros(1, 4, dtype=torch.long))
        for group in _groups(model):
            if not group.plan.gathers_weights:
                gathered = [torch.empty_like(group.model_weight) for _ in range(world)]
                dist.all_gather(gathered, group.model_weight)
                for other in gathered:
                    assert torch.equal(
                        other.view(torch.int16), group.model_weight.view(torch.int16)
                    ), (
                        f"{strategy}: replicated model weights differ across ranks"
                    )
            assert group.allocator.live_bytes == 0, f"{strategy}: temporary buckets leaked"
        report = memory_report(model)
        reports[strategy] = report
        padding_elems = sum(g.layout.padding_numel for g in _groups(model))
        full = {"model": content * 2, "main": content * 4, "grad": content * 4}
        shard = {k: v / world for k, v in full.items()}
        expect = {
            "no_shard": (full["model"], full["main"], full["grad"]),
            "optim": (full["model"], shard["main"], full["grad"]),
            "optim_grads": (full["model"], shard["main"], shard["grad"]),
            # bf16 compute, fp32 main: every gather casts the main shard (no bf16 shard kept).
            "optim_grads_params": (0, shard["main"], shard["grad"]),
        }[strategy]
        got = (report.model_weights, report.main_weights, report.main_grads)
        for role, g, e, itemsize in zip(("model", "main", "grad"), got, expect, (2, 4, 4)):
            slack = padding_elems * itemsize  # padding, at most all of it on this rank
            assert abs(g - e) <= slack, f"{strategy} {role}: {g} bytes, ZeRO formula {e} +- {slack}"
        assert 0.0 <= report.padding_ratio < 1.0
        # bf16 compute, fp32 main: main weights have buffers of their own, nothing aliases.
        assert report.main_weights_aliased == 0 and "aliases" not in str(report), str(report)
        if strategy in ("optim_grads", "optim_grads_params"):
            assert report.temporary_peak > 0
    # Each strategy holds strictly less than the one before it.
    totals = [
        reports[s].model_weights + reports[s].main_weights + reports[s].main_grads
        for s in STRATEGIES
    ]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4, totals


@pytest.mark.parametrize("world_size", [4])
def test_memory_report_matches_zero_formula(ranks: RankPools, world_size: int) -> None:
    ranks.run(_memory_worker, world_size, timeout_s=300)


def _memory_alias_and_optimizer_worker(rank: int, world: int) -> None:
    """fp32 (main dtype = compute dtype): the main weights are views of the model weights, so
    ``main_weights`` is 0 and ``main_weights_aliased`` holds them (the ZeRO formula's main-weight
    bytes); the report says so. With the optimizer, ``optimizer_state`` is AdamW's two fp32
    moments of this rank's shard (the ZeRO formula: sharded for every strategy but no_shard)
    plus one ``step`` scalar per parameter with state; 0 before the first step; not counted for
    another model's optimizer."""
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        model = TinyGPT(vocab=64, dim=32, layers=2, heads=2)
        num_params = len(list(model.parameters()))
        content = sum(p.numel() for p in model.parameters())
        for block in model.blocks:
            fully_shard(block, sharding_strategy=strategy)
        fully_shard(model, sharding_strategy=strategy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        assert memory_report(model, optimizer=opt).optimizer_state == 0, "state before a step"
        lm_loss(model, make_batches("lm", 1, 1, world, 2)[0][0][rank]).backward()
        opt.step()
        opt.zero_grad()
        report = memory_report(model, optimizer=opt)
        padding_elems = sum(g.layout.padding_numel for g in _groups(model))
        main = content * 4 if strategy == "no_shard" else content * 4 / world
        assert report.main_weights == 0, f"{strategy}: {report}"
        assert abs(report.main_weights_aliased - main) <= padding_elems * 4, (
            f"{strategy}: aliased main weights {report.main_weights_aliased}, formula {main}")
        assert "main_weights=aliases model_weights" in str(report), str(report)
        moments = 2 * main
        slack = 2 * padding_elems * 4 + num_params * 8  # padding; step scalars (<= 8 bytes)
        assert abs(report.optimizer_state - moments) <= slack, (
            f"{strategy}: optimizer_state {report.optimizer_state}, formula {moments} +- {slack}")
        assert report.optimizer_state > moments - 2 * padding_elems * 4, "step scalars missing"
        assert f"optimizer_state={report.optimizer_state / (1 << 20):.2f}MiB" in str(report)
        assert report.total == (report.model_weights + report.main_grads
                                + report.temporary_peak + report.optimizer_state)
        other = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))])
        other.step()
        assert memory_report(model, optimizer=other).optimizer_state == 0, "foreign state counted"
        assert memory_report(model).optimizer_state == 0
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        memory_report(model, optimizer=[opt])  # type: ignore[arg-type]


def test_memory_report_aliasing_and_optimizer_state(ranks: RankPools) -> None:
    ranks.run(_memory_alias_and_optimizer_worker, 2, timeout_s=300)


def _gathered_weights_worker(rank: int, world: int) -> list[str]:
    """ZeRO-3 with bf16 compute and fp32 main weights keeps no bf16 shard: every gather casts
    the main shard into its slot of the gathered bucket (``Refresh.CAST_AT_GATHER``). The
    weights a block computes with, in forward and in backward, after optimizer steps, must be
    bitwise the bf16 cast of the full main weights. Returns the mismatches."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=torch.float32)
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, layers=2, heads=2)
    for block in model.blocks:
        fully_shard(block, sharding_strategy="optim_grads_params", mp_policy=mp)
    fully_shard(model, sharding_strategy="optim_grads_params", mp_policy=mp)
    groups = _groups(model)
    assert all(g.model_weight.numel() == 0 for g in groups), "a bf16 shard was kept"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected: dict[str, torch.Tensor] = {}
    mismatches: list[str] = []

    checked: list[str] = []

    def check(name: str, weight: torch.Tensor, when: str) -> None:
        checked.append(when)
        if weight.dtype != torch.bfloat16 or not torch.equal(
                weight.detach().view(torch.int16), expected[name].view(torch.int16)):
            mismatches.append(f"{when} {name}")

    for i, block in enumerate(model.blocks):
        name = f"blocks.{i}.fc1.weight"
        block.fc1.register_forward_pre_hook(
            lambda m, args, n=name: check(n, m.weight, "forward"))
        block.fc1.register_full_backward_pre_hook(
            lambda m, grad, n=name: check(n, m.weight, "backward"))
    for step in range(3):
        expected = {n: p.full_tensor().to(torch.bfloat16) for n, p in model.named_parameters()}
        for micro in range(2):
            model.set_is_last_backward(micro == 1)
            lm_loss(model, make_batches("lm", 1, 1, world, 2, seed=10 * step + micro)[0][0][rank]
                    ).backward()
        opt.step()
        opt.zero_grad()
    # 2 blocks x 2 micro-batches x 3 steps, in forward and in backward.
    return mismatches + [f"{len(checked)} checks"]


def test_zero3_casts_main_shard_into_each_gather(ranks: RankPools) -> None:
    for mismatches in ranks.run(_gathered_weights_worker, 2, timeout_s=300):
        assert mismatches == ["24 checks"], mismatches


def _kept_storage_worker(rank: int, world: int, strategy: str) -> list[str]:
    """[Note: main_grad kept on CPU]: after ``zero_grad(set_to_none=True)`` the accumulate
    path's ``main_grad`` keeps its storage (the reduce-each path's is freed), the optimizer
    sees ``.grad=None``, and the next backward's gradients are one process's, whatever the
    kept storage held (poisoned with NaN here)."""
    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    ref = copy.deepcopy(model)
    for block in model.blocks:
        fully_shard(block, sharding_strategy=strategy)
    fully_shard(model, sharding_strategy=strategy)
    batches = make_batches("lm", 2, 1, world, per_rank=2)
    lm_loss(model, batches[0][0][rank]).backward()
    model.zero_grad(set_to_none=True)
    errors = []
    keeps = strategy in ("no_shard", "optim")
    for group in _groups(model):
        main_grad = group.grads._main_grad
        held = main_grad is not None and main_grad.untyped_storage().nbytes() > 0
        if held != keeps:
            errors.append(f"main_grad storage {'kept' if held else 'freed'}, want the other")
        if held:
            main_grad.fill_(float("nan"))
    errors += [f"{n}: .grad after zero_grad" for n, p in model.named_parameters()
               if p.grad is not None]
    lm_loss(model, batches[1][0][rank]).backward()
    lm_loss(ref, torch.cat([batches[1][0][r] for r in range(world)])).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if not torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6):
            errors.append(f"{name}: gradient differs from one process's")
    if not all_ranks_ok(not errors):
        errors = errors or ["failed on another rank"]
    return [f"rank {rank}: {e}" for e in errors]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_zero_grad_keeps_accumulate_buffers_on_cpu(ranks: RankPools, strategy: str) -> None:
    failures = [e for r in ranks.run(_kept_storage_worker, 2, strategy, timeout_s=120) for e in r]
    assert not failures, "\n".join(failures[:20])


def _in_flight_worker(rank: int, world: int, strategy: str) -> list[int]:
    """How many units still have a reduction in flight after each drain of a backward ([Note:
    in-place reductions in flight] in ``_runtime/_state.py``)."""
    torch.manual_seed(0)
    model = TinyGPT(layers=4)
    for block in model.blocks:
        fully_shard(block, sharding_strategy=strategy)
    fully_shard(model, sharding_strategy=strategy)
    batches = make_batches("lm", 2, 1, world, per_rank=2)
    lm_loss(model, batches[0][0][rank]).backward()  # the context exists from the first forward
    model.zero_grad()
    ctx = state_of(model).ctx
    seen: list[int] = []
    drain = ctx.drain_reductions

    def counting_drain(keep: int) -> None:
        drain(keep)
        seen.append(sum(any(g.grads._pending for g in state.groups) for state in ctx.states))

    ctx.drain_reductions = counting_drain  # type: ignore[method-assign]
    lm_loss(model, batches[1][0][rank]).backward()
    return seen


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_in_place_reduce_scatters_finish_one_unit_later(ranks: RankPools, strategy: str) -> None:
    """``optim``'s in-place reduce-scatters are finished one unit later, as FSDP2's (on gloo each
    holds a copy of its input while in flight): each unit's post-backward finds none of an
    earlier unit in flight. ``no_shard``'s in-place all-reduces run on until the final
    callback, as DDP's buckets: one more in flight at each unit's post-backward."""
    seen = ranks.run(_in_flight_worker, 2, strategy, timeout_s=120)[0]
    assert seen, "no drain ran"
    assert len(seen) >= 5, seen  # each block's post-backward, then the root's or the final callback
    if strategy == "optim":
        assert not any(seen), seen  # each drain finished the unit before's
    else:
        assert seen[:4] == [0, 1, 2, 3], seen
