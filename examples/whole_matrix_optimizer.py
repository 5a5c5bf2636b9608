"""A matrix optimizer of your own on fully_shard parameters, with ``megatron_fsdp_v2.optim``.

    torchrun --nproc_per_node=2 examples/whole_matrix_optimizer.py

:class:`PolarSGD` steps each 2-D parameter along the exact polar factor of its gradient
(``U @ Vh`` of its SVD: what Muon's Newton-Schulz iteration approximates). The SVD needs the
whole matrix while each rank holds some rows of it, so the step uses
:class:`megatron_fsdp_v2.optim.WholeMatrices`: each matrix has one owner rank, the gradient rows
go there in one all-to-all per process group, the owner computes the SVD once, and each rank
gets its rows of the result back in another all-to-all.

Run under torchrun it trains a small MLP for a few steps next to a single-process copy stepped
by the same rule on the same full gradients (gathered from the ranks: a batch gradient has low
rank, so its polar factor is not defined by the values alone and two sums in another order
could give another one), and rank 0 prints the largest difference (0.0: the same bits).
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import fully_shard
from megatron_fsdp_v2.optim import WholeMatrices


def polar_factor(matrix: torch.Tensor) -> torch.Tensor:
    """The orthogonal factor of ``matrix`` (``U @ Vh`` of its reduced SVD)."""
    u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    return u @ vh


class PolarSGD(torch.optim.Optimizer):
    """``p -= lr * polar_factor(p.grad)`` for 2-D parameters managed by ``fully_shard``."""

    def __init__(self, params: object, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})  # type: ignore[arg-type]
        self._plan: WholeMatrices | None = None

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        params = [p for group in self.param_groups for p in group["params"]]
        lrs = [group["lr"] for group in self.param_groups for _ in group["params"]]
        if self._plan is None or self._plan.params != params:
            self._plan = WholeMatrices(params)  # owners once; every rank the same
        # A parameter without a gradient on this rank still sends its rows (zeros), marked
        # absent; an owner gets None where no rank had one.
        local_grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p))
                       for p in params]
        wholes = self._plan.to_owners(local_grads, present=[p.grad is not None for p in params])
        results = {i: None if whole is None else polar_factor(whole)
                   for i, whole in wholes.items()}
        for p, rows, lr in zip(params, self._plan.from_owners(results), lrs):
            if rows is not None:
                _local(p).add_(rows, alpha=-lr)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def reference_step(model: nn.Module, lr: float) -> None:
    """The same rule in one process, on whole gradients."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(polar_factor(p.grad), alpha=-lr)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Tanh(), nn.Linear(32, 8, bias=False))
    reference = copy.deepcopy(model)
    for layer in (model[0], model[2]):
        fully_shard(layer, sharding_strategy="optim_grads_params")
    fully_shard(model, sharding_strategy="optim_grads_params")
    optimizer = PolarSGD(model.parameters(), lr=0.05)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * world, 16, generator=g), torch.randn(2 * world, 8, generator=g)
        rows = slice(2 * rank, 2 * rank + 2)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            q.grad = p.grad.full_tensor()  # the reference steps on the same full gradients
        optimizer.step()
        optimizer.zero_grad()
        reference_step(reference, 0.05)
        reference.zero_grad()
    worst = max((p.full_tensor() - q).abs().max().item()
                for p, q in zip(model.parameters(), reference.parameters()))
    if rank == 0:
        print(f"PolarSGD on {world} ranks vs one process, largest difference: {worst:.3e}")
    dist.destroy_process_group()


if __name__ == "__main__" and "LOCAL_RANK" in os.environ:
    main()
