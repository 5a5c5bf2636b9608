"""The mesh a unit lives on: 1-D (data parallel), or 2-D for HSDP (outer replicate axis x inner
shard axis, see design.md §9), validated and split into its axes. No collective, except what
creating the default mesh does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .._comm._comm_groups import LAUNCH_HINT, default_mesh
from ..api import ShardingStrategy

__all__ = ["MeshAxes", "parse_outer_strategy", "validate_mesh"]


@dataclass(frozen=True)
class MeshAxes:
    """The mesh a unit lives on, split into its axes. ``mesh`` is what the optimizer-facing
    DTensors live on; ``inner`` (1-D) is the axis the sharding strategy, the layout and the
    step's collectives run over; ``outer`` (1-D) is HSDP's replicate axis (dim 0 of a 2-D mesh),
    ``None`` on a 1-D mesh."""

    mesh: DeviceMesh
    inner: DeviceMesh
    outer: DeviceMesh | None = None


_HSDP_MESH_HINT = (
    "init_device_mesh(device_type, (R, S), mesh_dim_names=('replicate', 'shard')): dim 0 is "
    "the outer (replicate) axis, dim 1 the inner (shard) axis"
)


def parse_outer_strategy(value: Any) -> ShardingStrategy:
    """``outer_dp_sharding_strategy``: ``"no_shard"`` or ``"optim"`` (or their codes 0, 1)."""
    strategy = ShardingStrategy.parse(value)  # TypeError/ValueError for anything else
    if strategy not in (ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM):
        raise ValueError(
            f"outer_dp_sharding_strategy must be 'no_shard' or 'optim', got {strategy.value!r}: "
            "the outer (replicate) axis of a 2-D mesh keeps gradients replicated ('no_shard') "
            "or shards optimizer state ('optim'); the inner axis takes sharding_strategy"
        )
    return strategy


def validate_mesh(
    mesh: DeviceMesh | None, outer_strategy: ShardingStrategy = ShardingStrategy.NO_SHARD,
    strategy: ShardingStrategy = ShardingStrategy.OPTIM_GRADS_PARAMS,
) -> MeshAxes:
    """Check ``mesh`` (1-D, or 2-D for HSDP) against ``outer_strategy`` and the inner
    ``strategy``; no collective, except what creating the default mesh does."""
    if mesh is None:
        if outer_strategy is not ShardingStrategy.NO_SHARD:
            raise ValueError(_outer_on_1d(outer_strategy, "the default (1-D) mesh"))
        mesh = default_mesh()
        return MeshAxes(mesh, mesh)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.DeviceMesh (e.g. init_device_mesh('cuda', "
            f"(world_size,))) or None, got {type(mesh).__name__}"
        )
    if not dist.is_initialized():
        raise ValueError(f"fully_shard needs an initialized default process group: {LAUNCH_HINT}")
    if mesh.ndim == 1:
        if outer_strategy is not ShardingStrategy.NO_SHARD:
            shape = tuple(mesh.shape)
            raise ValueError(_outer_on_1d(outer_strategy, f"a 1-D mesh of shape {shape}"))
        return MeshAxes(mesh, mesh)
    if mesh.ndim != 2:
        raise ValueError(
            f"mesh must be 1-D (data parallel) or 2-D (HSDP: replicate x shard), got a "
            f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)}; pass a 1-D sub-mesh (e.g. "
            f"mesh['dp']) or a 2-D {_HSDP_MESH_HINT}"
        )
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"a 2-D mesh (HSDP) needs dimension names, got an unnamed mesh of shape "
            f"{tuple(mesh.shape)}; build it with {_HSDP_MESH_HINT}"
        )
    if (
        outer_strategy is ShardingStrategy.OPTIM
        and strategy is not ShardingStrategy.OPTIM_GRADS_PARAMS
    ):
        raise ValueError(
            "outer_dp_sharding_strategy='optim' (optimizer state sharded across the outer "
            "replicas) needs sharding_strategy='optim_grads_params' along the inner axis, got "
            f"sharding_strategy={strategy.value!r}; use outer_dp_sharding_strategy='no_shard' "
            "with it (replicas all-reduce gradients once per window)"
        )
    return MeshAxes(mesh, inner=mesh[names[1]], outer=mesh[names[0]])


def _outer_on_1d(outer_strategy: ShardingStrategy, what: str) -> str:
    return (
        f"outer_dp_sharding_strategy={outer_strategy.value!r} needs a 2-D mesh (HSDP), got "
        f"{what}; pass mesh={_HSDP_MESH_HINT}, or leave outer_dp_sharding_strategy at its "
        "default 'no_shard'"
    )
