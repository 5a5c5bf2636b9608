"""Checkpoints across parallelisms: saved on dp=2 x tp=2 (FSDP x TP), loaded on a plain 1-D dp
mesh of 4 ranks (no TP), and back, model and optimizer state, with torch's
``get_state_dict``/``set_state_dict`` + DCP and with the library's ``checkpoint.save``/``load``.
Training resumed from each checkpoint gives the losses and the final parameters of an
uninterrupted dp x tp run (which itself matches single-process training,
``test_fsdp_tp.py``)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd
import torch.nn as nn
from _tp_common import (
    SEQ,
    apply_tp,
    batches,
    build_model,
    compare,
    compare_losses,
    dp_tp_mesh,
    full_values,
    loss_of,
    wrap_ours,
)
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp_v2 import checkpoint as mckpt

from _pool import RankPools

TIMEOUT_S = 400
STEPS, SAVED_AT, MOVED_AT = 4, 2, 3  # save after 2 steps, move back after 3


def _steps(model: nn.Module, opt: torch.optim.Optimizer, data: torch.Tensor, steps: range,
           dp_rank: int, dp: int) -> list[float]:
    """Marked AdamW steps on this dp rank's share of each global batch."""
    micro = data.shape[1]
    losses = []
    for step in steps:
        total = torch.zeros(())
        global_batch = data[step].reshape(micro, -1, SEQ + 1)
        for i in range(micro):
            model.set_is_last_backward(i == micro - 1)  # type: ignore[operator]
            mine = global_batch[i].chunk(dp)[dp_rank]
            loss = loss_of(model, mine) / micro
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def _save(api: str, model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    if api == "torch":
        model_sd, optim_sd = dsd.get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    else:
        mckpt.save(model, opt, checkpoint_id=path)


def _load(api: str, model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    if api == "torch":
        model_sd, optim_sd = dsd.get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        dsd.set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:
        mckpt.load(model, opt, checkpoint_id=path)


def _new_opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _round_trip_worker(rank: int, world: int, api: str, tp_strategy: str, dp_strategy: str,
                       root: str) -> None:
    mesh = dp_tp_mesh()
    tp_dp_rank = mesh.get_local_rank("dp")
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    data = batches(steps=STEPS, micro=2, dp=2)

    # The uninterrupted run on dp x tp, saving after SAVED_AT steps.
    model = wrap_ours(apply_tp(build_model(), mesh["tp"]), mesh["dp"], tp_strategy)
    opt = _new_opt(model)
    _steps(model, opt, data, range(SAVED_AT), tp_dp_rank, 2)
    _save(api, model, opt, os.path.join(root, "from_tp"))
    want_losses = _steps(model, opt, data, range(SAVED_AT, STEPS), tp_dp_rank, 2)
    want = full_values(model)

    # Loaded on a 1-D dp mesh of 4 ranks without TP: one step, saved again.
    plain = wrap_ours(build_model(seed=7), flat, dp_strategy)
    plain_opt = _new_opt(plain)
    _load(api, plain, plain_opt, os.path.join(root, "from_tp"))
    got = _steps(plain, plain_opt, data, range(SAVED_AT, MOVED_AT), rank, world)
    _save(api, plain, plain_opt, os.path.join(root, "from_dp"))

    # And back on dp x tp: the remaining steps.
    back = wrap_ours(apply_tp(build_model(seed=8), mesh["tp"]), mesh["dp"], tp_strategy)
    back_opt = _new_opt(back)
    _load(api, back, back_opt, os.path.join(root, "from_dp"))
    got += _steps(back, back_opt, data, range(MOVED_AT, STEPS), tp_dp_rank, 2)
    case = f"{api}: {tp_strategy} x TP -> 1-D {dp_strategy} -> {tp_strategy} x TP"
    compare_losses(f"{case}: resumed losses", got, want_losses)
    compare(f"{case}: final parameters", full_values(back), want)


CASES = [
    ("optim_grads_params", "optim"),
    ("optim", "optim_grads_params"),
    ("no_shard", "optim_grads"),
    ("optim_grads", "no_shard"),
]


@pytest.mark.parametrize("api", ["torch", "library"])
@pytest.mark.parametrize("tp_strategy,dp_strategy", CASES)
def test_round_trip(ranks: RankPools, tmp_path: object, api: str, tp_strategy: str,
                    dp_strategy: str) -> None:
    ranks.run(_round_trip_worker, 4, api, tp_strategy, dp_strategy, str(tmp_path),
              timeout_s=TIMEOUT_S)
