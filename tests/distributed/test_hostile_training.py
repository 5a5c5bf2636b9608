"""Hostile training patterns ("No silent wrong, round 4"): calls torch allows in the middle of
training, where ``fully_shard`` must give single-process torch's numbers or raise clearly.

Each case trains the ``_silent_wrong`` model on 2 gloo ranks, each rank on its own rows of the
global batch, against a single-process reference trained on the whole batch (mean losses, so
the reference's gradients equal the rank-averaged ones), and, where FSDP2 gets it right,
``torch.distributed.fsdp.fully_shard`` on the same input in the same worker as a control (item
1; with torch 2.14 FSDP2 computes with stale weights in items 3 and 5 and ignores items 2 and 6,
so it is no control there: each case's docstring says what it does). The workers return what
differed (parameters, gradients, forward outputs, errors raised); the assertions run in the
test process.
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
from _fsdp2_api import _wrap as _wrap_units
from _silent_wrong import (
    STRATEGIES,
    Batch,
    Net,
    _adamw,
    _batches,
    _rank_rows,
    _snapshot,
    _unchanged,
    _wrap,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import FSDPModule

# private: tells our parameters from FSDP2's (record_of is None for FSDP2's)
from megatron_fsdp_v2._registry import record_of

from _models import shard_rows
from _pool import RankPools

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 120
RTOL, ATOL = 1e-5, 1e-6
OURS, FSDP2 = "megatron_fsdp_v2", "FSDP2"


# ------------------------------------------------------------------------------------ helpers

def _build(engine: str, strategy: str) -> tuple[nn.Module, nn.Module]:
    """(wrapped model, single-process reference), both from seed 0: blocks first, then the root."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    if engine == OURS:
        _wrap(model, strategy)
    else:
        _wrap_units(model, torch_fully_shard)
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


# --------------------------------------------- 2. a submodule replaced or added after wrapping

def _raises(call: Callable[[], Any], exc_type: type[BaseException], *needles: str) -> list[str]:
    """What is wrong with how ``call`` failed: nothing raised, another error, or a message that
    lacks a needle."""
    try:
        call()
    except exc_type as e:
        missing = [n for n in needles if n not in str(e)]
        return [f"{type(e).__name__} lacks {missing}: {e}"] if missing else []
    except Exception as e:  # noqa: BLE001 - reported as the wrong error
        return [f"expected {exc_type.__name__}, got {type(e).__name__}: {e}"]
    return [f"nothing raised (expected {exc_type.__name__} naming {list(needles)})"]


def _changed(model: nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """Parameters that differ from ``before`` (``_snapshot``) after a rejected forward (those
    wrapping installed: a replaced submodule's new parameters are not compared)."""
    names = [name for name, p in model.named_parameters() if record_of(p) is not None]
    try:
        _unchanged(model, before, "after the rejected forward", names)
    except AssertionError as e:
        return [str(e)]
    return []


_D = Net.DIM
_SUBMODULE_CHANGES: dict[str, tuple[str, Callable[[nn.Module], None]]] = {
    # (the submodule the error must name, the change)
    "replace_in_nested_unit": ("fc1", lambda m: setattr(m.blocks[1], "fc1",
                                                        nn.Linear(_D, 2 * _D + 1))),
    "replace_nested_unit": ("blocks.1", lambda m: m.blocks.__setitem__(1, nn.Linear(_D, _D))),
    "replace_in_root": ("head", lambda m: setattr(m, "head", nn.Linear(_D, Net.DOUT))),
    "add_used": ("extra", lambda m: (setattr(m.blocks[0], "extra", nn.Linear(_D, _D)),
                                     setattr(m.blocks[0], "use_extra", True))),
}


def _submodule_changed(model: nn.Module, ref: nn.Module, rank: int, how: str,
                       first_step: bool) -> list[str]:
    """torch trains whatever modules the model holds; ``fully_shard``'s units manage only the
    parameters they were wrapped with, so a submodule assigned after wrapping (its parameters
    would be trained per rank, never averaged) raises at the next forward, naming it and
    "after fully_shard", before anything changes (FSDP2, torch 2.14, trains the new module's
    plain parameters per rank: no control)."""
    errors: list[str] = []
    x, y = _batches(1)[0][0][rank]
    if first_step:  # after a step, or between fully_shard and the first forward
        opt = _adamw(model.parameters())
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    name, change = _SUBMODULE_CHANGES[how]
    change(model)
    before = _snapshot(model)
    errors += _raises(lambda: model(x), RuntimeError, f"'{name}'", "after fully_shard")
    errors += _changed(model, before)
    return errors


@pytest.mark.parametrize("first_step", [True, False], ids=["after_a_step", "before_forward"])
@pytest.mark.parametrize("how", sorted(_SUBMODULE_CHANGES))
@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_submodule_replaced_after_wrap_raises(
    ranks: RankPools, strategy: str, how: str, first_step: bool
) -> None:
    """Item 2: a replaced or added submodule is refused at the next forward."""
    results = ranks.run(_run, 2, "_submodule_changed", strategy, (OURS,), how, first_step,
                        timeout_s=TIMEOUT_S)
    _check(results, (OURS,))


# --------------------------------------------------------- 6. p.data = x on a wrapped parameter

_DATA_TARGETS = {"nested": "blocks.0.fc1.weight", "root": "head.bias"}


def _data_assigned(model: nn.Module, ref: nn.Module, rank: int, where: str,
                   first_step: bool) -> list[str]:
    """torch: after ``p.data = x`` the model computes with ``x``. The unit computes with its flat
    buffers, which the assignment does not reach (FSDP2, torch 2.14, ignores it too: no
    control): the next forward raises, naming the parameter and "after fully_shard", before
    anything changes."""
    errors: list[str] = []
    x, y = _batches(1)[0][0][rank]
    if first_step:
        opt = _adamw(model.parameters())
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    name = _DATA_TARGETS[where]
    param = model.get_parameter(name)
    before = _snapshot(model)
    param.data = torch.randn(param.shape)
    short = name.split(".", 2)[-1] if where == "nested" else name  # as the unit names it
    errors += _raises(lambda: model(x), RuntimeError, f"'{short}'", ".data", "after fully_shard")
    errors += _changed(model, before)
    return errors


@pytest.mark.parametrize("first_step", [True, False], ids=["after_a_step", "before_forward"])
@pytest.mark.parametrize("where", sorted(_DATA_TARGETS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_data_assignment_after_wrap_raises(
    ranks: RankPools, strategy: str, where: str, first_step: bool
) -> None:
    """Item 6: ``p.data = x`` on a wrapped parameter is refused at the next forward."""
    results = ranks.run(_run, 2, "_data_assigned", strategy, (OURS,), where, first_step,
                        timeout_s=TIMEOUT_S)
    _check(results, (OURS,))


def _data_untouched_trains(model: nn.Module, ref: nn.Module, rank: int) -> list[str]:
    """The watch of item 6 raises only for an assignment: aliases of the parameters taken and
    dropped (``detach()``, a state dict), ``load_state_dict`` and in-place writes train as in
    torch."""
    errors: list[str] = []
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    for step, micro in enumerate(_batches(2)):
        loss, ref_loss, found = _losses(model, ref, micro[0], rank)
        errors += [f"step {step}: {e}" for e in found]
        loss.backward()
        ref_loss.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        aliases = [p.detach() for p in model.parameters()]
        model.load_state_dict(model.state_dict())
        del aliases
        with torch.no_grad():
            nn.init.constant_(model.get_parameter("head.bias"), 0.1)
            nn.init.constant_(ref.get_parameter("head.bias"), 0.1)
    errors += _param_errors(model, ref)
    return errors


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_aliases_and_state_dicts_are_not_data_assignments(
    ranks: RankPools, strategy: str
) -> None:
    """The control of item 6's detection: no false alarm."""
    results = ranks.run(_run, 2, "_data_untouched_trains", strategy, (OURS,),
                        timeout_s=TIMEOUT_S)
    _check(results, (OURS,))
