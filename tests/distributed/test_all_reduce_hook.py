"""FSDP2's ``set_all_reduce_hook`` ([Note: the all-reduce hook] in
``megatron_fsdp_v2/_runtime/_all_reduce_hook.py``), on 4 ranks, with FSDP2 running the same
script as the control and single-process training as the reference:

* plain FSDP over 2 ranks whose hook implements the replica all-reduce itself (a sum) over the
  other mesh dim (2 replicas): trains like one process on the global batch of all 4 ranks with
  twice the gradient, with gradients accumulated across micro-batches and across steps (no
  ``zero_grad`` between two: the hook must not see the earlier step's again);
* HSDP (2 x 2): the hook runs after the outer all-reduce, once per unit and window, and what it
  does to the gradient (doubling it) is what the optimizer steps on.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

from megatron_fsdp_v2 import fully_shard

# private: counts the units' parameter groups (state_of(unit).groups)
from megatron_fsdp_v2._registry import state_of

from _models import SmallMLP, all_ranks_ok
from _pool import RankPools
from _training import train_steps

TIMEOUT_S = 240
STEPS, MICRO, ROWS = 3, 2, 2


def _global_mean_losses(model: nn.Module, rank: int | None, lr: float, mark: bool
                        ) -> list[float]:
    """SGD steps of ``MICRO`` micro-batches, each ``ROWS`` rows per rank of 4: this rank's rows,
    or all of them (``rank`` None: the reference). Gradients are not cleared after step 1, so
    step 2 steps on the sum of two steps' gradients. Returns the global mean loss per step."""
    g = torch.Generator().manual_seed(1)
    steps = [[(torch.randn(4 * ROWS, 5, generator=g), torch.randn(4 * ROWS, 3, generator=g))
              for _ in range(MICRO)] for _ in range(STEPS)]

    def rows(batch: tuple[torch.Tensor, torch.Tensor], rank: int | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        mine = slice(None) if rank is None else slice(ROWS * rank, ROWS * rank + ROWS)
        return batch[0][mine], batch[1][mine]

    per_step = train_steps(model, torch.optim.SGD(model.parameters(), lr=lr), steps,
                           lambda m, b: F.mse_loss(m(b[0]), b[1]), rank=rank, select=rows,
                           mark="last_backward" if mark else None, keep_grads_after={1})
    losses = []
    for step_losses in per_step:
        total = torch.zeros(())
        for loss in step_losses:
            total += loss
        if rank is not None:
            dist.all_reduce(total)
            total /= 4
        losses.append(float(total))
    return losses


def _wrap(model: SmallMLP, mesh: DeviceMesh, ours: bool, strategy: str) -> SmallMLP:
    if ours:
        fully_shard(model.a, mesh=mesh, sharding_strategy=strategy)
        fully_shard(model, mesh=mesh, sharding_strategy=strategy)
    else:
        fsdp2_fully_shard(model.a, mesh=mesh)
        fsdp2_fully_shard(model, mesh=mesh)
    return model


def _worker(rank: int, world: int, case: str, strategy: str) -> list[str]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    torch.manual_seed(0)
    base = SmallMLP()
    calls: list[int] = []
    # Each hook doubles the average over all 4 ranks (the reference: lr doubled), so a hook
    # applied again to a previous step's gradients (step 2 accumulates onto step 1's) shows.
    lr = 0.05
    if case == "custom_replicas":  # FSDP over "shard"; the hook sums over "rep"
        dp_mesh = mesh["shard"]
        rep_group = mesh["rep"].get_group()

        def hook(reduced: torch.Tensor) -> None:
            dist.all_reduce(reduced, group=rep_group)
    else:  # HSDP
        dp_mesh = mesh

        def hook(reduced: torch.Tensor) -> None:
            calls.append(reduced.numel())
            reduced.mul_(2)

    ref = copy.deepcopy(base)
    want = _global_mean_losses(ref, None, 2 * lr, False)
    errors, units = [], []
    for who in ("ours", "FSDP2 (control)"):
        if who != "ours" and strategy != "optim_grads_params":
            continue  # FSDP2 is ZeRO-3
        model = _wrap(copy.deepcopy(base), dp_mesh, who == "ours", strategy)
        units.append(model)
        for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
            unit.set_all_reduce_hook(hook)
        calls.clear()
        losses = _global_mean_losses(model, rank, lr, mark=who == "ours")
        if not torch.allclose(torch.tensor(losses), torch.tensor(want), rtol=1e-5):
            errors.append(f"{who}: losses {losses} vs single process {want}")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if not torch.allclose(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6):
                errors.append(f"{who}: parameter {name} differs from single-process training")
        groups = sum(len(s.groups) for m in model.modules() if (s := state_of(m)) is not None)
        if who == "ours" and case == "hsdp" and len(calls) != groups * STEPS:
            errors.append(f"hook ran {len(calls)} times, want once per group ({groups}) and "
                          "step")
    if case == "hsdp":  # FSDP2's rules for the arguments
        for kwargs, error in ((dict(hook=1), TypeError),
                              (dict(hook=hook, stream=object()), ValueError)):
            try:
                units[0].set_all_reduce_hook(**kwargs)  # type: ignore[operator]
                errors.append(f"set_all_reduce_hook({kwargs}) accepted")
            except error as e:
                if "set_all_reduce_hook" not in str(e) and "hook" not in str(e):
                    errors.append(f"unclear error: {e}")
    if not all_ranks_ok(not errors):
        errors = errors or ["failed on another rank"]
    return [f"{case} {strategy} rank {rank}: {e}" for e in errors]


@pytest.mark.parametrize("case,strategy", [
    ("custom_replicas", "optim_grads_params"),
    ("custom_replicas", "no_shard"),
    ("hsdp", "optim_grads_params"),
])
def test_all_reduce_hook(ranks: RankPools, case: str, strategy: str) -> None:
    failures = [e for r in ranks.run(_worker, 4, case, strategy, timeout_s=TIMEOUT_S)
                for e in r]
    assert not failures, "\n".join(failures[:20])
