"""torchtitan's seed-checkpoint flow: a full (unsharded) state dict loaded with torch's
``set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True[,
broadcast_from_rank0=True]))`` into a fully_shard model at world 3, where shards are uneven and
some empty, for every strategy. With broadcast, only rank 0 passes the state dict and the others
pass ``{}``, as torchtitan does.

After the load every parameter's ``full_tensor()`` must equal the state dict bitwise, and a
training step must match single-process torch on the same weights. The optimizer's full state
dict (``set_optimizer_state_dict(..., full_state_dict=True)``, with and without broadcast) is
loaded the same way and checked by a further step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import distribute_tensor

from megatron_fsdp_v2 import fully_shard

from _models import ThinMLP, agree, assert_close_to_reference
from _pool import RankPools

TIMEOUT_S = 240
pytestmark = pytest.mark.timeout(900)
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 5, generator=g), torch.randn(6, 1, generator=g)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _full_params_equal(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        got = p.full_tensor()
        assert torch.equal(got, full[name]), f"{name}: full_tensor() differs from the state dict"


def _seed_worker(rank: int, world: int, strategy: str, broadcast: bool) -> None:
    torch.manual_seed(0)
    seed = ThinMLP()  # the seed checkpoint's model
    full = {k: v.detach().clone() for k, v in seed.state_dict().items()}
    torch.manual_seed(1)  # other initial weights, so a load that did nothing shows
    model = ThinMLP()
    fully_shard(model.a, sharding_strategy=strategy, timeout=30)
    fully_shard(model, sharding_strategy=strategy, timeout=30)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    # torch rewrites the dict it is given (values become DTensors): give it a copy.
    given = {k: v.clone() for k, v in full.items()} if not broadcast or rank == 0 else {}
    set_model_state_dict(model, given, options=opts)
    agree(f"{strategy} broadcast={broadcast}: weights after the load",
          lambda: _full_params_equal(model, full))
    if not broadcast:
        # The same by hand: DTensor-layout (torch.chunk) entries through load_state_dict, which
        # DTensor copy_ gathers and cuts at our rows (the rows differ on some ranks only).
        for p in model.parameters():
            p.detach().zero_()
        model.load_state_dict({
            name: distribute_tensor(full[name], p.device_mesh, list(p.placements))
            for name, p in model.named_parameters()
        })
        agree(f"{strategy}: weights after load_state_dict of distribute_tensor entries",
              lambda: _full_params_equal(model, full))

    # One step against single-process torch from the same weights.
    ref = copy.deepcopy(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    loss, ref_loss = _step(model, opt, 1), _step(ref, ref_opt, 1)
    agree(f"{strategy} broadcast={broadcast}: first loss",
          lambda: torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0))
    agree(f"{strategy} broadcast={broadcast}: parameters after a step",
          lambda: assert_close_to_reference(model, ref, rtol=1e-6, atol=1e-7))

    # The optimizer: the reference's full state dict (after its second step) into a fresh one.
    _step(ref, ref_opt, 2)
    full_osd = get_optimizer_state_dict(ref, ref_opt, options=StateDictOptions(
        full_state_dict=True))
    set_model_state_dict(model, {k: v.detach().clone() for k, v in ref.state_dict().items()}
                         if not broadcast or rank == 0 else {}, options=opts)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    osd: dict[str, Any] = copy.deepcopy(full_osd) if not broadcast or rank == 0 else {}
    set_optimizer_state_dict(model, fresh, osd, options=opts)
    loss, ref_loss = _step(model, fresh, 3), _step(ref, ref_opt, 3)
    agree(f"{strategy} broadcast={broadcast}: loss after the optimizer load",
          lambda: torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7))
    agree(f"{strategy} broadcast={broadcast}: parameters after the optimizer load and a step",
          lambda: assert_close_to_reference(model, ref, rtol=1e-5, atol=1e-6))


@pytest.mark.parametrize("broadcast", [False, True], ids=["every_rank", "broadcast"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_seed_checkpoint_through_torch_full_state_dict(ranks: RankPools, strategy: str,
                                                       broadcast: bool) -> None:
    ranks.run(_seed_worker, 3, strategy, broadcast, timeout_s=TIMEOUT_S)
