"""Hostile training patterns ("No silent wrong, round 4"): calls torch allows in the middle of
training, where ``fully_shard`` must give single-process torch's numbers or raise clearly.

Each case trains the ``_silent_wrong`` model on 2 gloo ranks, each rank on its own rows of the
global batch, against a single-process reference trained on the whole batch (mean losses, so
the reference's gradients equal the rank-averaged ones), and, where FSDP2 has the feature,
``torch.distributed.fsdp.fully_shard`` on the same input in the same worker as a control. The
workers return what differed (parameters, gradients, forward outputs, errors raised); the
assertions run in the test process.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _fsdp2_api import _param_errors
from _silent_wrong import STRATEGIES, Batch, Net, _adamw, _batches, _rank_rows
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import FSDPModule, fully_shard
from megatron_fsdp_v2._registry import record_of

from _models import shard_rows
from _pool import RankPools

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 120
RTOL, ATOL = 1e-5, 1e-6
OURS, FSDP2 = "megatron_fsdp_v2", "FSDP2"

Scenario = Callable[[nn.Module, nn.Module, int], list[str]]


# ------------------------------------------------------------------------------------ helpers

def _build(engine: str, strategy: str) -> tuple[nn.Module, nn.Module]:
    """(wrapped model, single-process reference), both from seed 0: blocks first, then the root."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    for block in model.blocks:
        if engine == OURS:
            fully_shard(block, sharding_strategy=strategy, timeout=TIMEOUT_S / 4)
        else:
            torch_fully_shard(block)
    if engine == OURS:
        fully_shard(model, sharding_strategy=strategy, timeout=TIMEOUT_S / 4)
    else:
        torch_fully_shard(model)
    return model, ref


def _losses(model: nn.Module, ref: nn.Module, parts: list[Batch], rank: int,
            scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """This rank's loss, the reference's loss on the global batch, and the forward outputs'
    mismatch (this rank's rows of the reference's output)."""
    x, y = parts[rank]
    out = model(x)
    ref_out = ref(torch.cat([p[0] for p in parts]))
    errors = _close(out, ref_out[_rank_rows(rank)], "forward output")
    loss = F.mse_loss(out, y) * scale
    ref_loss = F.mse_loss(ref_out, torch.cat([p[1] for p in parts])) * scale
    return loss, ref_loss, errors


def _close(value: torch.Tensor, expected: torch.Tensor, what: str) -> list[str]:
    try:
        torch.testing.assert_close(value.detach().float(), expected.detach().float(), rtol=RTOL,
                                   atol=ATOL)
    except AssertionError as e:
        detail = [line for line in str(e).splitlines()[1:4] if line]
        return [f"{what}: {'; '.join(detail)}"]
    return []


def _grad_errors(model: nn.Module, ref: nn.Module) -> list[str]:
    """Every parameter's ``.grad`` against the reference's: ``None`` where torch's is ``None``,
    else the same values (this rank's rows; FSDP2's gradients in full)."""
    errors = []
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want, grad = ref_params[name].grad, p.grad
        if want is None or grad is None:
            if (want is None) != (grad is None):
                errors.append(f"{name}.grad is {'None' if grad is None else 'set'}, torch's is "
                              f"{'None' if want is None else 'set'}")
            continue
        if isinstance(grad, DTensor) and record_of(p) is None:  # FSDP2's: a collective
            errors += _close(grad.full_tensor(), want, f"{name}.grad")
        elif isinstance(grad, DTensor):
            lo, hi = shard_rows(p)
            errors += _close(grad.to_local(), want[lo:hi], f"{name}.grad")
        else:
            errors += _close(grad, want, f"{name}.grad")
    return errors


def _run(rank: int, world: int, scenario: str, strategy: str, engines: tuple[str, ...],
         *args: Any) -> dict[str, list[str]]:
    """Rank function: ``scenario`` on each engine; what differed from torch, per engine."""
    found = {}
    for engine in engines:
        model, ref = _build(engine, strategy)
        found[engine] = globals()[scenario](model, ref, rank, *args)
    return found


def _engines(strategy: str) -> tuple[str, ...]:
    """FSDP2 is the control next to its own strategy (ZeRO-3), not repeated for the others."""
    return (OURS, FSDP2) if strategy == "optim_grads_params" else (OURS,)


def _check(results: list[dict[str, list[str]]], engines: tuple[str, ...]) -> None:
    for engine in engines:
        for rank, found in enumerate(results):
            assert not found[engine], f"{engine}, rank {rank}:\n  " + "\n  ".join(found[engine])


# --------------------------------------- 1. requires_grad_(False) between two micro-batches

_FREEZE = {
    # one parameter of a group whose other parameters keep training
    "one_param": ["blocks.1.fc1.weight"],
    # every parameter of a unit (its groups stop requiring gradients altogether)
    "whole_unit": ["blocks.1.fc1.weight", "blocks.1.fc1.bias", "blocks.1.fc2.weight",
                   "blocks.1.fc2.bias"],
}


def _freeze_mid_window(model: nn.Module, ref: nn.Module, rank: int, which: str) -> list[str]:
    """torch: ``requires_grad_(False)`` after the first micro-batch of a window keeps the
    gradient accumulated so far (``.grad`` is that micro-batch's gradient, and AdamW steps
    the parameter with it); the next window gives it no gradient (``None``: AdamW skips it)."""
    errors: list[str] = []
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    for step, micro in enumerate(_batches(2, micro=2)):
        for i, parts in enumerate(micro):
            model.set_requires_gradient_sync(i == 1)  # type: ignore[operator]
            loss, ref_loss, found = _losses(model, ref, parts, rank, scale=0.5)
            errors += [f"step {step} micro {i}: {e}" for e in found]
            loss.backward()
            ref_loss.backward()
            if step == 0 and i == 0:
                for name in _FREEZE[which]:
                    model.get_parameter(name).requires_grad_(False)
                    ref.get_parameter(name).requires_grad_(False)
        errors += [f"step {step} after the window: {e}" for e in _grad_errors(model, ref)]
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        errors += [f"step {step} after the step: {e}" for e in _param_errors(model, ref)]
    return errors


@pytest.mark.parametrize("which", sorted(_FREEZE))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_requires_grad_false_mid_window_keeps_gradient(
    ranks: RankPools, strategy: str, which: str
) -> None:
    """Item 1: the first micro-batch's gradient survives ``requires_grad_(False)``; FSDP2 (the
    control) keeps it too."""
    engines = _engines(strategy)
    results = ranks.run(_run, 2, "_freeze_mid_window", strategy, engines, which,
                        timeout_s=TIMEOUT_S)
    _check(results, engines)


# ------------------------------- 3. kept weights and a window never marked last, then a step

def _kept_across_unmarked_windows(model: nn.Module, ref: nn.Module, rank: int) -> list[str]:
    """``set_reshard_after_backward(False)`` keeps gathered weights after a backward that is not
    the last of its window; with every backward unmarked, the optimizer step reduces late (with
    a warning) and changes the main weights under the kept ones: torch's next forward, in
    training or in evaluation, uses the stepped weights."""
    errors: list[str] = []
    model.set_reshard_after_backward(False)  # type: ignore[operator]
    model.set_is_last_backward(False)  # type: ignore[operator]
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    for step, micro in enumerate(_batches(3)):
        loss, ref_loss, found = _losses(model, ref, micro[0], rank)
        errors += [f"step {step}: {e}" for e in found]
        loss.backward()
        ref_loss.backward()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "optimizer.step.. found gradients")
            opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    with torch.no_grad():  # evaluation after the last step
        errors += [f"evaluation: {e}" for e in _losses(model, ref, _batches(1, seed=1)[0][0],
                                                     rank)[2]]
    errors += [f"after the steps: {e}" for e in _param_errors(model, ref)]
    return errors


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kept_weights_never_older_than_main_weights(ranks: RankPools, strategy: str) -> None:
    """Item 3: weights kept past a backward are gathered again after the step changed the main
    weights (every forward uses the stepped weights). FSDP2 (torch 2.14) computes with the kept
    pre-step weights here (0.14 off at the next forward): it is no control."""
    results = ranks.run(_run, 2, "_kept_across_unmarked_windows", strategy, (OURS,),
                        timeout_s=TIMEOUT_S)
    _check(results, (OURS,))


# ----------------------------------------------------- 5. unshard(), optimizer.step(), forward

def _unshard_then_step(model: nn.Module, ref: nn.Module, rank: int) -> list[str]:
    """torch has no unshard: its forward after ``optimizer.step()`` uses the stepped weights.
    ``unshard()`` of every unit before the step must not make the next forward use the weights
    gathered before it (FSDP2 in torch 2.14 does: it is no control here)."""
    errors: list[str] = []
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    for step, micro in enumerate(_batches(2)):
        loss, ref_loss, found = _losses(model, ref, micro[0], rank)
        errors += [f"step {step}: {e}" for e in found]
        loss.backward()
        ref_loss.backward()
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.unshard()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    with torch.no_grad():
        errors += [f"evaluation: {e}" for e in _losses(model, ref, _batches(1, seed=1)[0][0],
                                                     rank)[2]]
    return errors


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unsharded_weights_never_older_than_main_weights(
    ranks: RankPools, strategy: str
) -> None:
    """Item 5: weights gathered by ``unshard()`` before ``optimizer.step()`` are gathered again
    for the next forward."""
    results = ranks.run(_run, 2, "_unshard_then_step", strategy, (OURS,), timeout_s=TIMEOUT_S)
    _check(results, (OURS,))
