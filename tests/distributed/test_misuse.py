"""Misuse that used to train silently wrong or crash with an internal error: ranks running
different units (checked with ``MFSDP_DEBUG_COLLECTIVES=1``), a parameter whose rows make padding
explode, a strided-view parameter, a submodule called outside its unit's forward."""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch
import torch.nn as nn

from megatron_fsdp_v2 import fully_shard

# private: the parameter groups still pending a reduction
from megatron_fsdp_v2._registry import state_of
from megatron_fsdp_v2.testing import RankPools, run_distributed

from _models import all_ranks_ok

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


class Skippy(nn.Module):
    """Three equal blocks; rank ``skip_rank`` skips block 1 (data-dependent control flow that
    differs across ranks)."""

    def __init__(self, skip_rank: int | None, dim: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.skip_rank = skip_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = torch.distributed.get_rank()
        for i, block in enumerate(self.blocks):
            if i == 1 and rank == self.skip_rank:
                continue
            x = block(x)
        return x


def _skipped_unit(rank: int, world: int, strategy: str) -> str:
    os.environ["MFSDP_DEBUG_COLLECTIVES"] = "1"
    torch.manual_seed(0)
    model = Skippy(skip_rank=1)
    for block in model.blocks:
        fully_shard(block, sharding_strategy=strategy)
    fully_shard(model, sharding_strategy=strategy)
    with pytest.raises(RuntimeError) as info:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
    return str(info.value)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_debug_check_names_mismatched_collectives(strategy: str) -> None:
    """With the debug flag, a rank that skips a unit (the others' next bucket has the same size:
    without the check they would exchange the wrong data) fails on every rank with an error
    naming what each rank issues, instead of training wrong or aborting in gloo. Fresh ranks
    (the others share the session's): the ranks stop mid-step on different collectives."""
    messages = run_distributed(_skipped_unit, 2, strategy, timeout_s=60)
    for message in messages:
        assert re.search(
            r"ranks issue different collectives \(rank 0: .*unit 'blocks\.\d' .*; rank 1: .*\)\. "
            r"Every rank must run the same fully_shard units", message,
        ), message


def _agreeing_control_flow(rank: int, world: int) -> tuple[int, list[float]]:
    """Trains with the debug check on: how many checks ran, and the losses (the check must not
    change them: the same run without it is the reference)."""
    # private: counts the collective-order checks (_collectives.check_collective_order)
    from megatron_fsdp_v2._comm import _collectives

    checks = [0]
    original = _collectives.check_collective_order

    def counted(*args: object, **kwargs: object) -> None:
        checks[0] += 1
        original(*args, **kwargs)  # type: ignore[arg-type]

    losses: dict[str, list[float]] = {}
    for debug in ("1", "0"):
        os.environ["MFSDP_DEBUG_COLLECTIVES"] = debug
        _collectives.check_collective_order = counted  # type: ignore[assignment]
        try:
            torch.manual_seed(0)
            model = Skippy(skip_rank=None)
            for block in model.blocks:
                fully_shard(block, sharding_strategy="optim_grads_params")
            fully_shard(model, sharding_strategy="optim_grads_params")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            losses[debug] = []
            for step in range(2):
                loss = model(torch.randn(2, 4, generator=torch.Generator().manual_seed(step)))
                loss = loss.square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses[debug].append(loss.item())
        finally:
            _collectives.check_collective_order = original  # type: ignore[assignment]
            os.environ.pop("MFSDP_DEBUG_COLLECTIVES")
        if debug == "1":
            checked = checks[0]
    assert losses["1"] == losses["0"], losses
    return checked, losses["1"]


def test_debug_check_passes_when_ranks_agree(ranks: RankPools) -> None:
    """The check runs before every collective (gathers, reductions, refreshes) and passes,
    changing no number."""
    results = ranks.run(_agreeing_control_flow, 2, timeout_s=60)
    for checked, losses in results:
        assert checked >= 2 * 3 * 2, (checked, losses)  # >= a gather per unit per pass


def _padding_warning(rank: int, world: int) -> list[str]:
    model = nn.Module()
    model.wide = nn.Parameter(torch.randn(1, 100000))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fully_shard(model)
    small = nn.Linear(3, 2)  # pads by a large ratio but a few elements: no warning
    with warnings.catch_warnings(record=True) as caught_small:
        warnings.simplefilter("always")
        fully_shard(small)
    assert not [w for w in caught_small if "padded" in str(w.message)]
    return [str(w.message) for w in caught]


def test_padding_warning_names_parameter(ranks: RankPools) -> None:
    """A (1, 100000) parameter at world 3 cannot be split by rows: 200% padding is warned about,
    naming the parameter and the fixes."""
    for messages in ranks.run(_padding_warning, 3, timeout_s=60):
        assert any(
            re.search(r"parameter 'wide' of shape \(1, 100000\) .* padded by 200% .*world size 3"
                      r".*max_padding_ratio is 0.01.*ignored_params", m)
            for m in messages
        ), messages


def _strided_parameter(rank: int, world: int, strategy: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    model[0].weight = nn.Parameter(torch.randn(6, 8)[:, ::2])  # a strided view
    assert not model[0].weight.is_contiguous()
    ref = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    ref.load_state_dict({k: v.contiguous() for k, v in model.state_dict().items()})
    fully_shard(model[0], sharding_strategy=strategy)
    fully_shard(model, sharding_strategy=strategy)
    x = torch.randn(2, 4)
    assert all_ranks_ok(torch.equal(model(x), ref(x)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strided_view_parameter(ranks: RankPools, strategy: str) -> None:
    ranks.run(_strided_parameter, 2, strategy, timeout_s=60)


def _submodule_called_directly(rank: int, world: int) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    fully_shard(model)
    with pytest.raises(RuntimeError, match=r"LayerNorm is managed by the fully_shard unit "
                       r"'Sequential' .* called outside that unit's forward.*wrap this submodule"):
        model[1](torch.randn(2, 4))
    model(torch.randn(2, 4)).sum().backward()  # calling the unit works


def test_submodule_called_outside_its_unit(ranks: RankPools) -> None:
    ranks.run(_submodule_called_directly, 2, timeout_s=60)


def _skipped_after_refresh(rank: int, world: int, strategy: str) -> None:
    """The root's pre-forward launches the refresh all-gather of every stale ZeRO-1/2 unit;
    control flow (the same on every rank) then skips one. Its gather must still be waited on
    by the end of the forward (before the buffer is reused or the next refresh replaces it)."""
    torch.manual_seed(0)
    model = Skippy(skip_rank=None)
    for block in model.blocks:
        fully_shard(block, sharding_strategy=strategy)
    fully_shard(model, sharding_strategy=strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    model.skip_rank = rank  # every rank skips block 1 this time
    model(torch.randn(2, 4))
    pending = [g.name for m in model.modules() if (s := state_of(m))
               for g in s.groups if g.weights._pending is not None]
    assert all_ranks_ok(not pending), f"collectives never waited on: {pending}"


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_skipped_unit_refresh_is_waited_on(ranks: RankPools, strategy: str) -> None:
    ranks.run(_skipped_after_refresh, 2, strategy, timeout_s=60)
