"""A flat group's compute weights have one explicit state (``WeightState`` in
``megatron_fsdp_v2/_runtime/_compute_weights.py``, FSDP2's ``ShardedState`` with what is in
flight) instead of booleans: a group that gathers goes SHARDED -> GATHERING -> GATHERED ->
SHARDED, a replicated one REPLICATED -> REFRESHING -> REPLICATED. Walked through the public
``unshard``/``reshard`` and a training step, and the weights each state claims checked against
the module's parameters of a single-process copy."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

from megatron_fsdp_v2 import fully_shard

# private: a group's WeightState (state_of(m).groups[0].weights.state), the invariant under test;
#   no public API reports it
from megatron_fsdp_v2._registry import state_of

from _models import shard_rows

TIMEOUT_S = 120.0


def _walk(rank: int, world: int, strategy: str) -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    fully_shard(model[0], sharding_strategy=strategy)
    fully_shard(model, sharding_strategy=strategy)
    group = state_of(model[0]).groups[0]  # type: ignore[union-attr]
    seen = [group.weights.state.value]
    if strategy == "optim":  # replicated compute weights: refreshed after a step
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        x = torch.randn(world, 4, 8, generator=torch.Generator().manual_seed(1))
        model(x[rank]).sum().backward()
        reference(x.reshape(-1, 8)).sum().div(world).backward()
        opt.step()
        ref_opt.step()
        seen.append("stale" if group.needs_refresh else "current")
    handle = model[0].unshard(async_op=True)  # type: ignore[operator]
    seen.append(group.weights.state.value)
    handle.wait()
    seen.append(group.weights.state.value)
    # What GATHERED / REPLICATED claims: the module computes with the current weights.
    torch.testing.assert_close(model[0].weight.detach(), reference[0].weight.detach())
    model[0].reshard()  # type: ignore[operator]
    seen.append(group.weights.state.value)
    return seen


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,expected", [
    ("optim_grads_params", ["sharded", "gathering", "gathered", "sharded"]),
    ("optim", ["replicated", "stale", "refreshing", "replicated", "replicated"]),
])
def test_weight_states(ranks: Any, strategy: str, expected: list[str]) -> None:
    for rank, seen in enumerate(ranks.run(_walk, 2, strategy, timeout_s=TIMEOUT_S)):
        assert seen == expected, (rank, seen)


def _windows(rank: int, world: int) -> list[str]:
    """A group's gradient window (``WindowState``): OPEN from the first micro-batch that staged
    something until the last one's gradients are installed (CLOSED), with the installed
    gradient the single-process sum over the window's micro-batches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    fully_shard(model[0], sharding_strategy="optim")
    fully_shard(model, sharding_strategy="optim")
    group = state_of(model[0]).groups[0]  # type: ignore[union-attr]
    seen = [group.grads.window.value]
    x = torch.randn(2, world, 4, 8, generator=torch.Generator().manual_seed(2))
    for micro in range(2):
        model.set_is_last_backward(micro == 1)  # type: ignore[operator]
        model(x[micro, rank]).sum().backward()
        reference(x[micro].reshape(-1, 8)).sum().div(world).backward()
        seen.append(group.grads.window.value)
    grad = model[0].weight.grad
    assert grad is not None
    lo, hi = shard_rows(model[0].weight)
    torch.testing.assert_close(grad.to_local(), reference[0].weight.grad[lo:hi])
    return seen


@pytest.mark.timeout(300)
def test_window_states(ranks: Any) -> None:
    for rank, seen in enumerate(ranks.run(_windows, 2, timeout_s=TIMEOUT_S)):
        assert seen == ["closed", "open", "closed"], (rank, seen)
