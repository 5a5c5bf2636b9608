"""Failures never hang: a rank that raises makes the others fail within the collective timeout,
and an exception (or KeyboardInterrupt) inside a forward/backward on every rank leaves the model
in a state the next step starts from, with results identical to never having tried."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

# private: forgets the cached process groups after a timed-out collective
from megatron_fsdp_v2._comm import _process_groups

# private: the units' runtime state after a failure (recovered, nothing in flight)
from megatron_fsdp_v2._registry import state_of
from megatron_fsdp_v2.testing import DistributedTestError, run_distributed

from _failure_injection import InjectedError, inject_failure, raising
from _models import (
    TinyGPT,
    all_ranks_ok,
    assert_close_to_reference,
    lm_loss,
    make_batches,
    reference_copy,
    wrap_blocks,
)

# The library's collective timeout in these cases. The failing-rank test waits it out six times,
# so it is short; a healthy collective waits only for its peer's compute since the last one
# (milliseconds for TinyGPT), far below it even on a loaded machine (at a load of 20 on 2
# cores every wait took 1.00-1.02 s, and no healthy collective timed out).
TIMEOUT_S = 1.0
SLACK_S = 20.0  # the bound: a peer fails within TIMEOUT_S + SLACK_S


# ---------------------------------------------------------------------- a failing rank

def _one_rank_fails(rank: int, world: int, strategy: str, where: str) -> tuple[float, str]:
    """Rank 1 raises in ``where`` and stays alive (in a barrier on the healthy default group);
    rank 0 goes on into the next collective. Returns rank 0's time to fail and its error."""
    torch.manual_seed(0)
    model = wrap_blocks(TinyGPT(), strategy, timeout=TIMEOUT_S)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = make_batches("lm", 3, 1, world, per_rank=2)
    failing = rank == 1
    lm_loss(model, batches[0][0][rank]).backward()  # a normal step: records the prefetch order
    opt.step()
    opt.zero_grad()
    if failing and where == "forward":
        inject_failure(model, "forward")
    if failing and where == "backward":
        inject_failure(model, "backward_late")
    if failing and where == "step":
        opt.register_step_pre_hook(raising(InjectedError))
    dist.barrier()
    start = time.monotonic()
    try:
        for step in (1, 2):
            lm_loss(model, batches[step][0][rank]).backward()
            opt.step()
            opt.zero_grad()
    except InjectedError:
        assert failing, "the injected error fired on the wrong rank"
        outcome: tuple[float, str] = (-1.0, "injected")
    except Exception as e:  # noqa: BLE001 - the peer's error is what we measure
        assert not failing, f"rank 1 should have raised the injected error, got {e!r}"
        outcome = (time.monotonic() - start, f"{type(e).__name__}: {e}")
    else:
        raise AssertionError(f"rank {rank} finished two steps although rank 1 failed")
    dist.barrier()  # the failing rank stays alive until the other has failed
    _process_groups.clear_process_groups()  # the timed-out group no longer matches across ranks
    return outcome


def _is_timeout(error: str) -> bool:
    """gloo's words for a collective that timed out (or that a timeout on the peer closed)."""
    return "timed out" in error.lower() or "timeout" in error.lower()


_CASES = [
    ("optim_grads_params", "forward"),  # the next unit's all-gather
    ("no_shard", "forward"),  # no forward collective: the backward all-reduce
    ("optim_grads", "backward"),  # the reduce-scatter of the next unit
    ("optim", "step"),  # the next forward's refresh all-gather
]


def _propagates(rank: int, world: int, signal_path: str) -> None:
    """As in ``_one_rank_fails``, but every rank lets its error escape (rank 1 only once rank 0
    has failed, so it stays alive and out of every collective until then)."""
    torch.manual_seed(0)
    model = wrap_blocks(TinyGPT(), "optim_grads_params", timeout=TIMEOUT_S)
    batch = make_batches("lm", 1, 1, world, per_rank=2)[0][0][rank]
    if rank == 1:
        inject_failure(model, "backward_early")
    dist.barrier()
    try:
        lm_loss(model, batch).backward()
    except InjectedError:
        deadline = time.monotonic() + TIMEOUT_S + SLACK_S
        while not os.path.exists(signal_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise
    except Exception:
        open(signal_path, "w").close()
        raise


def _ranks_fail_differently(rank: int, world: int) -> None:
    """Every rank fails, but at different points of the backward: rank 1 has a reduction in
    flight that rank 0 never launched. Recovery cannot complete it and must say so (within the
    timeout), and keep saying so instead of issuing collectives on the broken group."""
    torch.manual_seed(0)
    model = wrap_blocks(TinyGPT(), "optim_grads_params", timeout=TIMEOUT_S)
    batches = make_batches("lm", 2, 1, world, per_rank=2)
    lm_loss(model, batches[0][0][rank]).backward()
    inject_failure(model, "backward_early" if rank == 0 else "backward_late")
    dist.barrier()
    with pytest.raises(InjectedError):
        lm_loss(model, batches[1][0][rank]).backward()
    dist.barrier()
    start = time.monotonic()
    try:
        lm_loss(model, batches[1][0][rank]).backward()  # recovery runs in the root pre-forward
        error = None
    except RuntimeError as e:
        error = str(e)
    elapsed = time.monotonic() - start
    assert elapsed < 2 * TIMEOUT_S + SLACK_S, elapsed
    if rank == 1:
        assert error is not None, error
        assert "cannot recover from the failed forward/backward" in error, error
        assert "restart the job" in error
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="cannot recover"):
            model(batches[1][0][rank][:, :-1])
        assert time.monotonic() - start < TIMEOUT_S, "it waited on the broken group again"
    else:
        assert error is not None, "rank 0 completed a step its peer never joined"
    dist.barrier()
    _process_groups.clear_process_groups()


def _failing_rank_worker(rank: int, world: int, signal_path: str) -> None:
    _ranks_fail_differently(rank, world)
    for strategy, where in _CASES:
        elapsed, error = _one_rank_fails(rank, world, strategy, where)
        if rank == 0:
            assert 0.5 * TIMEOUT_S <= elapsed < TIMEOUT_S + SLACK_S, (
                f"{strategy}/{where}: rank 0 failed after {elapsed:.1f}s: {error}"
            )
            assert _is_timeout(error), (
                f"{strategy}/{where}: rank 0 failed with {error}"
            )
        else:
            assert error == "injected", error
    _propagates(rank, world, signal_path)  # raises on every rank


def test_failing_rank_fails_the_others_within_the_timeout(tmp_path: Any) -> None:
    """Rank 1 raises in forward, backward or the optimizer step and stays alive; rank 0, in the
    next collective, fails after the collective timeout (not torch's 10 minutes, not never).
    Finally both let their errors escape: run_distributed reports them instead of a hang."""
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_failing_rank_worker, 2, str(tmp_path / "failed"), timeout_s=150,
                        grace_s=30)
    elapsed = time.monotonic() - start
    report = str(info.value)
    assert "AssertionError" not in report, report
    assert "did not finish" not in report, report
    rank0, rank1 = report.split("--- rank 1 ---")
    assert "--- rank 0 ---" in rank0 and _is_timeout(rank0), report
    assert "InjectedError: injected" in rank1, report
    assert elapsed < 150, elapsed


# ---------------------------------------------------------------------- failure on every rank

def _run(model: nn.Module, micro_batches: list[torch.Tensor], *, first: int = 0, total: int,
         inject: tuple[str, type[BaseException]] | None = None) -> float:
    """Forward and backward of micro-batches ``first, first + 1, ...`` of a window of ``total``;
    ``inject`` makes the last one given fail."""
    loss_sum = 0.0
    for i, batch in enumerate(micro_batches, start=first):
        if hasattr(model, "set_is_last_backward"):
            model.set_is_last_backward(i == total - 1)
        last = i == first + len(micro_batches) - 1
        handle = inject_failure(model, *inject) if inject is not None and last else None
        try:
            loss = lm_loss(model, batch) / total
            loss.backward()
        finally:
            if handle is not None:
                handle.remove()
        loss_sum += loss.item()
    return loss_sum


def _change_weights_between_failure_and_retry(model: nn.Module, ref: nn.Module, states: list,
                                             eager: bool) -> None:
    """What a user may do right after catching the error: read a state dict (a checkpoint) and
    change the weights (as a checkpoint reload would). The state dict must hold the DTensor
    parameters (the model is recovered at once after an Exception in forward, otherwise by the
    state-dict hook), and the next forward must not reuse weights the failed one gathered."""
    ctx = states[0].ctx
    ok = not eager or not ctx.step_failed
    state_dict = model.state_dict()
    ok &= not ctx.step_failed
    ok &= all(isinstance(state_dict[name], DTensor) for name, _ in model.named_parameters())
    assert all_ranks_ok(ok), "not recovered before the state dict was read"
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).mul_(0.9)
        for p in ref.parameters():
            p.mul_(0.9)
    model.mark_main_weights_updated()


def _recovers(rank: int, world: int, strategy: str, where: str, exc: type[BaseException],
              micro: int) -> None:
    """Step 1 fails on every rank at the same point, then is retried as a user would: a failed
    forward retries that micro-batch (gradients were untouched); a failed backward redoes the
    accumulation window (its gradients were discarded). The result must match a reference that
    never saw the failure. SGD with momentum, which (unlike Adam) is sensitive to gradient
    scale, so failed-step gradients leaking into the retry would show."""
    torch.manual_seed(0)
    model = TinyGPT()
    ref = reference_copy(model)
    model = wrap_blocks(model, strategy, timeout=30)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)
    batches = make_batches("lm", 3, micro, world, per_rank=2)
    other = make_batches("lm", 1, micro, world, per_rank=2, seed=7)[0]  # the failed attempt's
    states = [s for m in model.modules() if (s := state_of(m)) is not None]
    for step in range(3):
        mine = [mb[rank] for mb in batches[step]]
        if step == 1 and where == "forward":
            loss = _run(model, mine[:-1], total=micro)
            with pytest.raises(exc, match="injected"):
                _run(model, mine[-1:], first=micro - 1, total=micro, inject=(where, exc))
            if micro == 1:
                _change_weights_between_failure_and_retry(model, ref, states,
                                                          eager=exc is InjectedError)
            loss += _run(model, mine[-1:], first=micro - 1, total=micro)
        else:
            if step == 1:
                with pytest.raises(exc, match="injected"):
                    _run(model, [mb[rank] for mb in other], total=micro, inject=(where, exc))
                if micro == 1:
                    _change_weights_between_failure_and_retry(model, ref, states, eager=False)
            loss = _run(model, mine, total=micro)
        opt.step()
        opt.zero_grad()
        ref_loss = _run(ref, [torch.cat(mb) for mb in batches[step]], total=micro)
        ref_opt.step()
        ref_opt.zero_grad()
        mean = torch.tensor([loss])
        dist.all_reduce(mean)
        ok = abs(mean.item() / world - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
        assert all_ranks_ok(ok), f"step {step}: loss {mean.item() / world} vs {ref_loss}"
        ctx = states[0].ctx
        ok = (
            ctx is not None and not ctx.step_failed and ctx.allocator.live_bytes == 0
            and not any(g.is_gathered and g.plan.gathers_weights
                        for s in states for g in s.groups)
            and all(isinstance(p, DTensor) for p in model.parameters())
        )
        assert all_ranks_ok(ok), f"step {step}: state not clean after the step"
    try:
        assert_close_to_reference(model, ref, rtol=1e-5, atol=1e-6)
        ok, err = True, None
    except AssertionError as e:
        ok, err = False, e
    assert all_ranks_ok(ok), f"parameters differ: {err or 'on another rank'}"


class _HalfStepSGD(torch.optim.SGD):
    """SGD whose step can die half-way, on every rank: the first half of the parameters updated,
    the rest not."""

    fail = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if not self.fail:
            return super().step(closure)
        params = [p for g in self.param_groups for p in g["params"]]
        for p in params[: len(params) // 2]:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.defaults["lr"])
        raise InjectedError("injected")


def _optimizer_step_fails(rank: int, world: int, strategy: str) -> None:
    """A step that raises after updating some main weights: the next forward must use compute
    weights refreshed from them (the step marks them stale before it runs)."""
    torch.manual_seed(0)
    model = TinyGPT()
    ref = reference_copy(model)
    model = wrap_blocks(model, strategy, timeout=30)
    opt = _HalfStepSGD(model.parameters(), lr=0.05)
    ref_opt = _HalfStepSGD(ref.parameters(), lr=0.05)
    batches = make_batches("lm", 3, 1, world, per_rank=2)
    for step in range(3):
        loss = _run(model, [batches[step][0][rank]], total=1)
        ref_loss = _run(ref, [torch.cat(batches[step][0])], total=1)
        mean = torch.tensor([loss])
        dist.all_reduce(mean)
        ok = abs(mean.item() / world - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
        assert all_ranks_ok(ok), f"step {step}: loss {mean.item() / world} vs {ref_loss}"
        opt.fail = ref_opt.fail = step == 0
        for o in (opt, ref_opt):
            try:
                o.step()
            except InjectedError:
                pass
            o.zero_grad()


def _recovery_sweep(rank: int, world: int) -> list[str]:
    failures = []
    for strategy in ("optim", "optim_grads"):  # replicated compute weights, sharded main ones
        try:
            _optimizer_step_fails(rank, world, strategy)
        except AssertionError as e:
            failures.append(f"{strategy} optimizer step fails half-way: {e}")
    all_cases = (
        ("forward", InjectedError, 1),  # recovered at once (always_call forward hook)
        ("forward", KeyboardInterrupt, 1),  # recovered by the state-dict hook
        ("backward_early", InjectedError, 1),
        ("backward_late", KeyboardInterrupt, 1),  # a reduction in flight
        ("backward_late", InjectedError, 2),  # the accumulation window is redone
        ("forward", KeyboardInterrupt, 2),  # only the failed micro-batch is redone
    )
    for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        cases = all_cases if strategy in ("optim", "optim_grads_params") else all_cases[::2]
        for where, exc, micro in cases:
            try:
                _recovers(rank, world, strategy, where, exc, micro)
            except AssertionError as e:  # raised on every rank together (all_ranks_ok)
                failures.append(f"{strategy} {where} {exc.__name__} micro={micro}: {e}")
    return failures


def test_failed_step_on_every_rank_recovers_with_parity() -> None:
    results = run_distributed(_recovery_sweep, 2, timeout_s=200)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)
