"""Training helpers that understand sharded DTensor gradients."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from . import ops

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip gradients to a global norm, like ``torch.nn.utils.clip_grad_norm_``, with one
    fused sum of squares per rank and one all-reduce (per mesh) for sharded gradients.

    Works on the DTensor parameters of :func:`fully_shard` modules (uneven and empty shards
    included) and on plain parameters, which are taken to be replicated. Returns the total norm
    as a plain tensor, identical on every rank. Only the 2-norm and the inf-norm are supported.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = list(parameters)
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"clip_grad_norm_ supports norm_type 2.0 or inf, got {norm_type}")
    # Whether a collective is needed is decided from the parameters, never the gradients, so
    # that every rank issues the same collectives even when its local shard is empty.
    sharded: dict[int, tuple[dist.ProcessGroup, list[torch.Tensor]]] = {}
    replicated: list[torch.Tensor] = []
    device: torch.device | None = None
    for p in params:
        grad = p.grad
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements):
            # The library's own group for fully_shard parameters (it carries the collective
            # timeout, see fully_shard's ``timeout``); the mesh's group otherwise.
            owner = getattr(p, "_mfsdp_param_group", None)
            group = owner.process_group if owner is not None else p.device_mesh.get_group()
            entry = sharded.setdefault(id(group), (group, []))
            if grad is not None:
                entry[1].append(grad.to_local())
            device = device or p.to_local().device
        elif grad is not None:
            replicated.append(grad.to_local() if isinstance(grad, DTensor) else grad)
            device = device or grad.device
    if device is None:
        return torch.zeros(())
    if norm_type == 2.0:
        total = ops.multi_tensor_sum_of_squares(replicated, device=device)
        for group, local_grads in sharded.values():
            partial = ops.multi_tensor_sum_of_squares(local_grads, device=device)
            dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
            total = total + partial
        total_norm = total.sqrt()
    else:
        total_norm = torch.zeros((), dtype=torch.float32, device=device)
        for g in replicated:
            total_norm = torch.maximum(total_norm, g.detach().abs().max().float())
        for group, local_grads in sharded.values():
            partial = torch.zeros((), dtype=torch.float32, device=device)
            for g in local_grads:
                if g.numel():
                    partial = torch.maximum(partial, g.detach().abs().max().float())
            dist.all_reduce(partial, op=dist.ReduceOp.MAX, group=group)
            total_norm = torch.maximum(total_norm, partial)
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    local = replicated + [g for _, gs in sharded.values() for g in gs]
    if local:
        torch._foreach_mul_(local, clip_coef.to(local[0].dtype))
    return total_norm
