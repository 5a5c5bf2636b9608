"""``fully_shard([m1, m2])``: one unit over several modules, as FSDP2 (see [Note: several modules
as one unit] in ``megatron_fsdp_v2/_frontend/_module_lists.py``).

A tiny model whose root forward runs ``norm`` and whose loss calls ``head`` outside it, in two
chunks (torchtitan's pattern), wrapped ``[norm, head]`` + root, trains for every strategy and
both ``reshard_after_forward`` settings to single-process numbers (losses and full parameters),
issues one gradient reduction per flat group per step (not one per call of a member, as FSDP2
would), and changes each member's class to ``FSDP<Class>``. Built on the meta device (as
torchtitan does), the list unit is materialized with the root's pass, or by a state dict of one
member, or left to ``to_empty`` and the user's init. Bad lists raise before any collective,
leaving the modules untouched.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from megatron_fsdp_v2 import FSDPModule, fully_shard

# private: which modules share one unit's state, and its parameter groups
from megatron_fsdp_v2._registry import state_of, unit_states

from _models import all_ranks_ok
from _pool import RankPools

TIMEOUT_S = 240
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


class HeadOutside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.body(x)))  # the head is the loss's


def _loss(model: HeadOutside, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    hidden = model(x)
    parts = [F.cross_entropy(model.head(h), t, reduction="sum")
             for h, t in zip(hidden.chunk(2), y.chunk(2))]
    return sum(parts) / y.numel()  # type: ignore[return-value]


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach()


def _reductions(comm: CommDebugMode) -> int:
    return sum(n for op, n in comm.get_comm_counts().items()
               if "reduce_scatter" in str(op) or "allreduce" in str(op)
               or "all_reduce" in str(op))


def _reset_in_module_order(model: nn.Module) -> None:
    """What torchtitan's ``init_weights`` does after ``to_empty``: initialize in place through
    the (DTensor) parameters; here in construction order, so the draws are the device-built
    model's."""
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.LayerNorm)):
                module.reset_parameters()


def _worker(rank: int, world: int, strategy: str, keep: bool, init: str = "device") -> list[str]:
    """``init``: ``"device"`` (built on the CPU), ``"meta"`` (built on meta, materialized by the
    library at the first forward) or ``"to_empty"`` (built on meta, then torchtitan's flow:
    ``to_empty`` and an in-place init through the DTensor parameters)."""
    torch.manual_seed(0)
    model = HeadOutside() if init == "device" else None
    ref = copy.deepcopy(model) if model is not None else HeadOutside()
    if model is None:
        torch.manual_seed(0)  # the library draws at materialization as construction drew
        with torch.device("meta"):
            model = HeadOutside()
    returned = fully_shard([model.norm, model.head], sharding_strategy=strategy,
                           reshard_after_forward=None if not keep else False)
    fully_shard(model, sharding_strategy=strategy)
    if init == "to_empty":
        model.to_empty(device="cpu")
        _reset_in_module_order(model)
    errors = []
    if not (isinstance(returned, list) and returned[0] is model.norm):
        errors.append(f"fully_shard returned {type(returned).__name__}, want the list")
    names = [type(model.norm).__name__, type(model.head).__name__]
    if names != ["FSDPLayerNorm", "FSDPLinear"] or not isinstance(model.head, FSDPModule):
        errors.append(f"member classes {names}")
    if state_of(model.norm) is not state_of(model.head):
        errors.append("the members do not share one unit state")
    groups = sum(len(s.groups) for _, s in unit_states(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)  # not the global stream: materialization draws there
    for step in range(3):
        x = torch.randn(4 * world, 6, generator=g)
        y = torch.randint(0, 5, (4 * world,), generator=g)
        mine = slice(4 * rank, 4 * rank + 4)
        with CommDebugMode() as comm:
            loss = _loss(model, x[mine], y[mine])
            loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = _loss(ref, x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if not torch.allclose(mean / world, ref_loss.detach(), rtol=1e-5, atol=1e-6):
            errors.append(f"step {step}: loss {float(mean) / world} vs {float(ref_loss)}")
        if _reductions(comm) != groups:
            errors.append(f"step {step}: {_reductions(comm)} reductions, want one per group "
                          f"({groups}): {dict(comm.get_comm_counts())}")
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if not torch.allclose(_full(p), ref_params[name].detach(), rtol=1e-5, atol=1e-6):
            errors.append(f"parameter {name} differs from single-process training")
    if not all_ranks_ok(not errors):
        errors = errors or ["failed on another rank"]
    return [f"{strategy} keep={keep} rank {rank}: {e}" for e in errors]


@pytest.mark.parametrize("keep", [False, True], ids=["reshard", "keep"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_list_unit_matches_single_process(ranks: RankPools, strategy: str, keep: bool) -> None:
    if keep and strategy != "optim_grads_params":
        pytest.skip("reshard_after_forward=False only changes ZeRO-3")
    failures = [e for r in ranks.run(_worker, 2, strategy, keep, timeout_s=TIMEOUT_S) for e in r]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("init,strategy", [("meta", "optim_grads_params"),
                                           ("to_empty", "optim_grads")])
def test_list_unit_built_on_meta(ranks: RankPools, init: str, strategy: str) -> None:
    """torchtitan wraps ``[norm, output]`` on the meta device. Materialized by the library
    (the list unit is in the root's pass, in construction order) or by ``to_empty`` and an
    in-place init, the model starts from the device-built weights and trains to
    single-process numbers."""
    failures = [e for r in ranks.run(_worker, 2, strategy, False, init, timeout_s=TIMEOUT_S)
                for e in r]
    assert not failures, "\n".join(failures[:20])


def _member_state_dict_worker(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = HeadOutside()
    fully_shard([model.norm, model.head])
    fully_shard(model)
    model.head.state_dict()  # materializes the whole [norm, head] unit, not the root's
    errors = []
    norm_weight = model.norm.weight.full_tensor()  # type: ignore[operator]
    if not torch.equal(norm_weight, torch.ones(8)):  # LayerNorm.reset_parameters: ones
        errors.append(f"norm.weight {norm_weight.tolist()}, want ones (the unit's other member)")
    if model.head.weight.full_tensor().abs().sum() == 0:  # type: ignore[operator]
        errors.append("head.weight still zero after its state_dict()")
    return [f"rank {rank}: {e}" for e in errors]


def test_state_dict_of_one_member_materializes_the_unit(ranks: RankPools) -> None:
    failures = [e for r in ranks.run(_member_state_dict_worker, 2, timeout_s=TIMEOUT_S)
                for e in r]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case,error,needle", [
    ("empty", ValueError, "empty list"),
    ("not_module", TypeError, "not an nn.Module"),
    ("twice", ValueError, "is twice"),
    ("nested", ValueError, "inside item 0"),
])
def test_bad_lists_raise_before_any_collective(case: str, error: type, needle: str) -> None:
    """No process group exists here: the check runs before anything needs one."""
    model = HeadOutside()
    outer = nn.Sequential(model.body, model.norm)
    modules: Any = {
        "empty": [], "not_module": [model.norm, model.head.weight],
        "twice": [model.norm, model.norm], "nested": [outer, model.norm],
    }[case]
    with pytest.raises(error, match=needle):
        fully_shard(modules)
    assert type(model.norm) is nn.LayerNorm and state_of(model.norm) is None
