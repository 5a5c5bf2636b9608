"""Infinity norms of DTensors whose local shard is empty (``precompute_float8_dynamic_scale_for_
fsdp``'s ``torch._foreach_norm(weights, ord=inf)`` over FP8 parameters).

A flat buffer's row layout can leave a rank without any row of a parameter, so its local shard
of that parameter's DTensor is empty. DTensor computes a sharded norm as a local norm per rank
reduced across ranks, and the local infinity norm of an empty tensor raises (a max has no
identity in general), on that rank only. Norms are non-negative, so 0 is the identity of their
max: a one-row all-zero stand-in for the empty local shard gives the same reduced value, with
DTensor's own sharding propagation and reduction (the same single all-reduce). Finite orders
need nothing (an empty sum is 0).

Only tensors that may be the library's (parameters, gradients, optimizer states and tensors that
keep their size) are stood in for, decided by tensor as every DTensor path on a registered mesh
([Note: deciding by tensor] in ``_redistribute.py``): anything else, on any mesh, is torch's,
with torch's error for an empty ``torch.chunk`` shard.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ._redistribute import chunk_rows
from ._uneven_gather import dp_sharded_mesh_dims
from ._uneven_meshes import mesh_is_registered, tp_dims_of

__all__ = ["stand_in_empty_shards"]


def stand_in_empty_shards(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """``aten._foreach_norm.Scalar``'s arguments with each DTensor whose local shard is empty
    (and whose global tensor is not) replaced by one over an all-zero row, for an infinite order;
    None when nothing needs replacing."""
    tensors, *rest = args
    order = rest[0] if rest else kwargs.get("ord", 2)
    if not (isinstance(order, (int, float)) and math.isinf(order) and order > 0):
        return None
    if not any(_empty_local(t) for t in tensors):
        return None
    replaced = [_zero_row(t) if _empty_local(t) else t for t in tensors]
    return (replaced, *rest), kwargs


def _empty_local(t: Any) -> bool:
    return (isinstance(t, DTensor) and t._local_tensor.numel() == 0 and t.numel() > 0
            and _may_hold_our_rows(t))


def _may_hold_our_rows(t: DTensor) -> bool:
    mesh = t.device_mesh
    if not mesh_is_registered(mesh):
        return False
    sharded = dp_sharded_mesh_dims(t.placements, mesh, tp_dims_of(mesh))
    return bool(sharded) and not chunk_rows(
        t._local_tensor, t._spec, sharded, f"the infinity norm of a DTensor {t.placements}")


def _zero_row(t: DTensor) -> DTensor:
    local = t._local_tensor
    zero = torch.zeros((1, *local.shape[1:]), dtype=local.dtype, device=local.device)
    return DTensor.from_local(zero, t.device_mesh, t.placements, run_check=False,
                              shape=t.shape, stride=t.stride())
