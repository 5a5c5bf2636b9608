"""FSDP2's ``reshard_after_forward`` (argument and method) and ``set_reshard_after_backward`` with
``set_requires_gradient_sync`` on fully_shard (see ``_fsdp2_api.py`` for how cases run).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from _fsdp2_api import (
    TIMEOUT_S,
    _batches,
    _check_training,
    _loss,
    _net,
    _train,
    _wrap,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard

# private: whether each parameter group is gathered (reshard schedule)
from megatron_fsdp_v2._registry import state_of

from _pool import RankPools

pytestmark = pytest.mark.timeout(600)


# ---------------------------------------------------------------------- reshard_after_forward

def _reshard_after_forward_worker(rank: int, world: int, how: str, micro: int) -> dict[str, Any]:
    model, ref = _net()
    if how == "argument":
        _wrap(model, reshard_after_forward=False)
    else:
        _wrap(model)
        model.set_reshard_after_forward(False)  # type: ignore[attr-defined]
    # Between forward and backward a unit keeps its gathered weights (the root included).
    out = _loss(model, _batches(1, 1)[0][0])
    gathered_after_forward = all(
        g.is_gathered for m in model.modules() if (s := state_of(m)) for g in s.groups
    )
    out.backward()
    gathered_after_backward = any(
        g.is_gathered for m in model.modules() if (s := state_of(m)) for g in s.groups
    )
    model.zero_grad()  # type: ignore[operator]
    # The same step on the reference keeps both in sync for the training below.
    _loss(ref, _batches(1, 1)[0][0]).backward()
    ref.zero_grad()
    result = _train(model, ref, steps=3, micro=micro, count_step=1)
    # A forward no backward follows keeps the weights too (and, as FSDP2's, leaves the
    # unsharded parameters registered); an edit of the main weights (the DTensor parameters,
    # as an optimizer holds them) before the next forward must not be missed.
    dist_params = list(model.parameters())
    _loss(model, _batches(1, 1)[0][0])
    with torch.no_grad():
        for p in (*dist_params, *ref.parameters()):
            p.mul_(0.5)
    # That forward's backward registers the DTensor parameters again, for the optimizer below.
    edited, ref_edited = (_loss(m, _batches(1, 1)[0][0]) for m in (model, ref))
    if abs(edited.item() - ref_edited.item()) > 1e-5 * abs(ref_edited.item()):
        result["errors"].append(f"edit missed: loss {edited.item()} vs {ref_edited.item()}")
    edited.backward()
    ref_edited.backward()
    model.zero_grad()  # type: ignore[operator]
    ref.zero_grad()
    after_edit = _train(model, ref, steps=1, micro=1)
    result["errors"] += [f"after edit: {e}" for e in after_edit["errors"]]
    result["losses"] += after_edit["losses"]
    result["ref_losses"] += after_edit["ref_losses"]
    result["gathered_after_forward"] = gathered_after_forward
    result["gathered_after_backward"] = gathered_after_backward
    # FSDP2 itself on the same input: the same losses.
    fsdp2, _ = _net()
    _wrap(fsdp2, torch_fully_shard, reshard_after_forward=False)
    _, ref2 = _net()
    _loss(ref2, _batches(1, 1)[0][0]).backward()
    ref2.zero_grad()
    _loss(fsdp2, _batches(1, 1)[0][0]).backward()
    fsdp2.zero_grad()
    result["fsdp2_losses"] = _train(fsdp2, ref2, steps=3, micro=micro)["losses"]
    _loss(fsdp2, _batches(1, 1)[0][0])
    with torch.no_grad():
        for p in (*fsdp2.parameters(), *ref2.parameters()):
            p.mul_(0.5)
    result["fsdp2_losses"] += _train(fsdp2, ref2, steps=1, micro=1)["losses"]
    return result


@pytest.mark.parametrize("how", ["argument", "method"])
@pytest.mark.parametrize("micro", [1, 2])
def test_reshard_after_forward_false(ranks: RankPools, how: str, micro: int) -> None:
    """ZeRO-3 with ``reshard_after_forward=False``: the reference's numbers, FSDP2's losses,
    and N all-gathers + N reduce-scatters per group per window of N micro-batches."""
    results = ranks.run(_reshard_after_forward_worker, 2, how, micro, timeout_s=TIMEOUT_S)
    _check_training(results)
    for rank, r in enumerate(results):
        assert r["gathered_after_forward"], f"rank {rank}: weights freed after forward"
        assert not r["gathered_after_backward"], f"rank {rank}: weights kept after backward"
        assert r["counts"] == (micro * r["groups"], micro * r["groups"]), (
            f"rank {rank}: (all-gathers, reduce-scatters) {r['counts']}, expected "
            f"{micro} each per group ({r['groups']} groups)"
        )
        torch.testing.assert_close(r["losses"], r["fsdp2_losses"], rtol=1e-5, atol=1e-7)


def _default_counts_worker(rank: int, world: int) -> dict[str, Any]:
    model, ref = _net()
    _wrap(model)
    return _train(model, ref, steps=2, micro=2, count_step=1)


def test_reshard_after_forward_default_keeps_zero3_counts(ranks: RankPools) -> None:
    """Without the argument the ZeRO-3 schedule is unchanged: 2N all-gathers."""
    results = ranks.run(_default_counts_worker, 2, timeout_s=TIMEOUT_S)
    _check_training(results)
    for r in results:
        assert r["counts"] == (4 * r["groups"], 2 * r["groups"]), r["counts"]


# ---------------------------------------------------------------------- reshard_after_backward

def _reshard_after_backward_worker(rank: int, world: int, edit: bool) -> dict[str, Any]:
    model, ref = _net()
    _wrap(model)
    model.set_reshard_after_backward(False)  # type: ignore[attr-defined]
    kept: list[bool] = []

    def between(m: nn.Module, r: nn.Module) -> None:
        kept.append(all(g.is_gathered for mod in m.modules() if (s := state_of(mod))
                        for g in s.groups))
        if edit:  # the main weights change inside the window: kept weights are stale
            with torch.no_grad():
                for p in (*m.parameters(), *r.parameters()):
                    p.mul_(0.9)

    result = _train(model, ref, steps=3, micro=2, count_step=1, between=between)
    result["kept"] = kept
    result["gathered_after_step"] = any(
        g.is_gathered for m in model.modules() if (s := state_of(m)) for g in s.groups
    )
    return result


@pytest.mark.parametrize("edit", [False, True], ids=["accumulate", "edit-inside-window"])
def test_reshard_after_backward_false(ranks: RankPools, edit: bool) -> None:
    """Kept from a non-last backward to the next forward (one all-gather fewer per group and
    window of 2); freed by the last backward; gathered again when the weights changed."""
    results = ranks.run(_reshard_after_backward_worker, 2, edit, timeout_s=TIMEOUT_S)
    _check_training(results)
    for rank, r in enumerate(results):
        assert all(r["kept"]) and r["kept"], f"rank {rank}: kept {r['kept']}"
        assert not r["gathered_after_step"], f"rank {rank}: weights kept past the last backward"
        gathers = (4 if edit else 3) * r["groups"]
        assert r["counts"] == (gathers, 2 * r["groups"]), (rank, r["counts"], gathers)
