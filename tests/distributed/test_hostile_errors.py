"""Hostile use that must fail fast and clearly, or train right ("No silent wrong, round 4",
items 8, 10, 12, 13): ``fully_shard`` arguments that differ between ranks are caught by the
wrap-time rank check; optimizers that are not elementwise, and gradient penalties
(``create_graph=True``), train exactly like single-process PyTorch or are refused at their
first step naming what works; a call outside the step that some rank does not make fails
after the group's timeout naming that rank and the call, before any collective (the arrival
check), and a forward run on some ranks only fails with an error naming that misuse, not only
the transport's "Timed out".
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _bad_input import expect_rejected
from _silent_wrong import (
    STEPS,
    STRATEGIES,
    WORLD,
    Net,
    _adamw,
    _assert_grads,
    _assert_outputs,
    _assert_params,
    _assert_unchanged,
    _batches,
    _expect_raises,
    _rank_rows,
    _setup,
    _snapshot,
    _step_both,
    _wrap,
)
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp_v2 import checkpoint as mckpt
from megatron_fsdp_v2 import fully_shard

# private: forgets the cached process groups after a timed-out collective
from megatron_fsdp_v2._comm import _process_groups

# private: the arrival check's wait and timeout (await_every_rank)
from megatron_fsdp_v2._comm._arrival import arrival_wait, await_every_rank

# private: the process group a unit communicates on
from megatron_fsdp_v2._registry import state_of
from megatron_fsdp_v2.testing import RankPools

# A wrap that leaves a collective unmatched waits this long before the transport raises; every
# check here must answer well before it.
_WRAP_TIMEOUT_S = 20.0


# ---------------------------------------------------------------------- 8. rank check


def _outer_strategy_disagrees(rank: int, world: int) -> None:
    """HSDP (2 x 2): rank 0 asks for outer ``optim``, the others for ``no_shard``. Every rank
    raises the rank check's error naming the argument, before any group is created for it."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    outer = "optim" if rank == 0 else "no_shard"
    start = time.monotonic()
    expect_rejected(
        lambda: nn.Linear(4, 4),
        lambda m: fully_shard(m, mesh=mesh, outer_dp_sharding_strategy=outer,
                              timeout=_WRAP_TIMEOUT_S),
        ValueError,
        r"ranks disagree on what fully_shard wraps: rank 0 has 'outer_dp_sharding_strategy: "
        r"optim' but rank \d has 'outer_dp_sharding_strategy: no_shard'.*every rank must wrap "
        r"the same model",
        collectives=True,
    )
    elapsed = time.monotonic() - start
    assert elapsed < _WRAP_TIMEOUT_S / 2, f"raised after {elapsed:.1f}s: a collective timed out"
    # The ranks are still in step: the same wrap everywhere works.
    model = fully_shard(nn.Linear(4, 4), mesh=mesh, outer_dp_sharding_strategy="optim",
                        timeout=_WRAP_TIMEOUT_S)
    model(torch.ones(2, 4)).sum().backward()
    dist.barrier()


def test_outer_strategy_disagreement_is_caught(ranks: RankPools) -> None:
    """Item 8: ``outer_dp_sharding_strategy`` is in the wrap-time rank check."""
    ranks.run(_outer_strategy_disagrees, 4, timeout_s=90)


# ---------------------------------------------------------------------- 12. optimizers


class _NormalizedSGD(torch.optim.Optimizer):
    """An optimizer unknown to the library that reads across each parameter: every update is
    the gradient divided by its mean absolute value (a reduction over all of its elements)."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: ARG002 - torch's signature
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.abs().mean() + 1e-3), alpha=-group["lr"])


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "SGD":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if name == "Rprop":
        return torch.optim.Rprop(params, lr=1e-2)
    if name == "Adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    if name == "LBFGS":
        return torch.optim.LBFGS(params, lr=0.5, max_iter=3, history_size=4)
    return _NormalizedSGD(params)


# What each strategy must do with each optimizer: train exactly (None), or refuse at the first
# step naming the strategy that works.
_CROSS_PARAMETER = ("Adafactor", "LBFGS")


def _optimizer_case(rank: int, strategy: str, name: str) -> None:
    model, ref = _setup(strategy)
    opt, ref_opt = _optimizer(name, model.parameters()), _optimizer(name, ref.parameters())
    refused = strategy != "no_shard" and name in _CROSS_PARAMETER
    for step, micro in enumerate(_batches(STEPS)):
        parts = micro[0]
        x, y = parts[rank]
        whole_x, whole_y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        def ref_closure() -> torch.Tensor:
            ref_opt.zero_grad()
            loss = F.mse_loss(ref(whole_x), whole_y)
            loss.backward()
            return loss

        if refused:
            closure()
            before = _snapshot(model)
            with _expect_raises(NotImplementedError, type(opt).__name__, "sharding_strategy=",
                                "'no_shard'", what=f"{name} under {strategy}"):
                opt.step(closure)
            _assert_unchanged(model, before, f"{name} under {strategy}: the refused step")
            return
        opt.step(closure)
        ref_opt.step(ref_closure)
        _assert_params(model, ref, f"{name} under {strategy}, step {step}")


def _optimizers(rank: int, world: int) -> None:
    for strategy in STRATEGIES:
        for name in ("SGD", "Rprop", "Adafactor", "LBFGS", "normalized"):
            _optimizer_case(rank, strategy, name)


def test_optimizers_not_elementwise(ranks: RankPools) -> None:
    """Item 12: SGD and Rprop (elementwise; they step with a closure here, as LBFGS needs
    one) and an unknown optimizer that reduces over each parameter train exactly like one
    process under every strategy; Adafactor and LBFGS (which read across a parameter, or
    across parameters) train exactly under ``no_shard`` and are refused at their first step
    under the sharded strategies, naming ``no_shard``, with nothing changed."""
    ranks.run(_optimizers, WORLD, timeout_s=240)


# ---------------------------------------------------------------------- 13. gradient penalty


def _penalty_case(rank: int, strategy: str) -> None:
    """A gradient penalty on the inputs (WGAN-GP style): ``autograd.grad(loss, x,
    create_graph=True)``, then ``(loss + |dloss/dx|^2).backward()``, whose second backward runs
    through the graph of the first, which saved the gathered weights."""
    model, ref = _setup(strategy)
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    for step, micro in enumerate(_batches(STEPS)):
        parts = micro[0]
        where = f"{strategy} step {step}"
        x = parts[rank][0].clone().requires_grad_()
        whole_x = torch.cat([p[0] for p in parts]).requires_grad_()
        out, ref_out = model(x), ref(whole_x)
        _assert_outputs(out, ref_out[_rank_rows(rank)], model, ref, where)
        loss = F.mse_loss(out, parts[rank][1])
        ref_loss = F.mse_loss(ref_out, torch.cat([p[1] for p in parts]))
        (grad_x,) = torch.autograd.grad(loss, x, create_graph=True)
        (ref_grad_x,) = torch.autograd.grad(ref_loss, whole_x, create_graph=True)
        # Rank r's loss is the mean over its rows: its input gradient is WORLD times the
        # reference's rows (the reference averages over every rank's rows).
        (loss + grad_x.pow(2).sum() / WORLD).backward()
        (ref_loss + (ref_grad_x * WORLD).pow(2).sum() / WORLD**2).backward()
        _assert_grads(model, ref, where)
        _step_both(opt, ref_opt)
    _assert_params(model, ref, f"{strategy}: after the penalty steps")


def _penalties(rank: int, world: int) -> None:
    for strategy in STRATEGIES:
        _penalty_case(rank, strategy)


def test_gradient_penalty(ranks: RankPools) -> None:
    """Item 13: a gradient penalty (``create_graph=True``) trains exactly like one process under
    every strategy, ZeRO-3 included (whose gathered weights the penalty's backward reads)."""
    ranks.run(_penalties, WORLD, timeout_s=240)


# ---------------------------------------------------------------------- 10. calls some rank skips


def _arrivals(rank: int, world: int) -> dict[str, float]:
    """The arrival check before collectives issued outside the step (see [Note: arrival
    check]): a rank that calls alone is told which rank did not come, and which call, after the
    group's timeout and before any collective; a rank that comes after the others gave up is
    told who left; ranks that all come pass, at the cost measured here."""
    model = fully_shard(nn.Linear(4, 4), timeout=3.0)
    process_group = state_of(model).groups[0].process_group
    assert arrival_wait(process_group).total_seconds() == 3.0, "the group's own timeout"
    call = "checkpoint.get_full_state_dict (test)"
    start = time.monotonic()
    if rank == 0:
        with pytest.raises(RuntimeError, match=(
                r"checkpoint.get_full_state_dict \(test\): rank 1 of its group \(ranks \[0, 1\]\)"
                r" did not call it within 3s \(this rank's call #1 of it on this group\); every "
                r"rank of the group must call .*No collective was issued")):
            await_every_rank(call, process_group)
        assert time.monotonic() - start < 3.0 + 2.0, "waited past the group's timeout"
    dist.barrier()  # rank 1 comes only after rank 0 gave up
    if rank == 1:
        with pytest.raises(RuntimeError, match=r"rank 0 of its group .* did not call it within "
                                               r"0.5s"):
            await_every_rank(call, process_group, timedelta(seconds=0.5))
    dist.barrier()
    # Every rank calls: no wait beyond the slowest rank's arrival; the group still works.
    costs = []
    for _ in range(20):
        dist.barrier()
        start = time.perf_counter()
        await_every_rank(call, process_group)
        costs.append(time.perf_counter() - start)
    full = mckpt.get_full_state_dict(model)
    if rank == 0:
        assert set(full) == {"weight", "bias"} and full["weight"].shape == (4, 4)
    return {"median_ms": 1e3 * sorted(costs)[len(costs) // 2]}


def test_arrival_check_names_the_rank_that_did_not_call(ranks: RankPools) -> None:
    """Item 10 (the mechanism): a call some rank skips fails naming that rank and the call."""
    results = ranks.run(_arrivals, WORLD, timeout_s=120)
    print(f"arrival check, median per call on 2 gloo ranks (FileStore): "
          f"{results[0]['median_ms']:.2f} ms")


def _forward_on_one_rank(rank: int, world: int) -> None:
    """An evaluation forward on rank 0 only (ZeRO-3 gathers weights in it) while rank 1 goes on
    training: the unmatched collectives time out on both ranks, and both errors say what that
    means and name the misuse, not only the transport's "Timed out"."""
    torch.manual_seed(0)
    model = _wrap(Net(), "optim_grads_params", timeout=3.0)
    batch = torch.ones(2, Net.DIN)
    model(batch).sum().backward()
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError) as info:
            if rank == 0:
                with torch.no_grad():
                    model(batch)  # evaluation on one rank: the misuse
            model(batch).sum().backward()
        message = str(info.value)
        assert "did not complete within the group's timeout: some rank of the group did not " \
               "issue the matching collective" in message, message
        assert "evaluation under `if rank == 0:`" in message, message
        assert "get_full_state_dict" in message, message
        assert time.monotonic() - start < 3.0 + 10.0, "not bounded by the group's timeout"
    finally:
        _process_groups.clear_process_groups()  # the timed-out group is out of step: not reused
        dist.barrier()


def test_forward_on_some_ranks_names_the_misuse(ranks: RankPools) -> None:
    """Item 10 (a forward run on some ranks only): both ranks fail within the group's timeout
    with an error naming the misuse and the fix."""
    ranks.run(_forward_on_one_rank, WORLD, timeout_s=120)


def _full_state_dict_on_one_rank(rank: int, world: int) -> None:
    """``get_full_state_dict`` called on rank 0 only (the documented misuse): rank 0 fails
    after the group's timeout naming rank 1 and the call, having issued no collective; a rank
    that comes after the others gave up is told who left; then every rank calls it and it
    works."""
    model = fully_shard(nn.Linear(4, 4), timeout=3.0)
    start = time.monotonic()
    if rank == 0:
        with pytest.raises(RuntimeError, match=(
                r"checkpoint.get_full_state_dict: rank 1 of its group \(ranks \[0, 1\]\) did not "
                r"call it within 3s .*not under `if rank == 0:`.*No collective was issued")):
            mckpt.get_full_state_dict(model)
        assert time.monotonic() - start < 3.0 + 2.0, "waited past the group's timeout"
    dist.barrier()
    if rank == 1:
        with pytest.raises(RuntimeError, match=r"rank 0 of its group .* did not call it"):
            mckpt.get_full_state_dict(model)
    dist.barrier()
    full, expected = mckpt.get_full_state_dict(model), model.weight.full_tensor()
    if rank == 0:
        torch.testing.assert_close(full["weight"], expected)


def test_full_state_dict_on_one_rank_names_the_rank(ranks: RankPools) -> None:
    """Item 10: a full state dict some rank skips fails naming that rank and the call."""
    ranks.run(_full_state_dict_on_one_rank, WORLD, timeout_s=120)
