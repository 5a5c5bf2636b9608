"""The mesh a unit lives on: 1-D (data parallel), or 2-D for HSDP (outer replicate axis x inner
shard axis, see design.md §9), validated and split into its axes. No collective, except what
creating the default mesh does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .._comm._process_groups import LAUNCH_HINT, default_mesh
from .._dtensor._tp_params import SpmdMesh
from ..api import ShardingStrategy

__all__ = ["MeshAxes", "parse_outer_strategy", "resolve_dp_mesh", "spmd_mesh_of",
           "validate_mesh"]


@dataclass(frozen=True)
class MeshAxes:
    """The mesh a unit lives on, split into its axes. ``mesh`` is what the optimizer-facing
    DTensors live on; ``inner`` (1-D) is the axis the sharding strategy, the layout and the
    step's collectives run over; ``outer`` (1-D) is HSDP's replicate axis (dim 0 of a 2-D mesh),
    ``None`` on a 1-D mesh. ``spmd``: the SPMD mesh ``mesh`` was taken from with FSDP2's
    ``dp_mesh_dims``, else ``None``."""

    mesh: DeviceMesh
    inner: DeviceMesh
    outer: DeviceMesh | None = None
    spmd: SpmdMesh | None = None


_HSDP_MESH_HINT = (
    "init_device_mesh(device_type, (R, S), mesh_dim_names=('replicate', 'shard')): dim 0 is "
    "the outer (replicate) axis, dim 1 the inner (shard) axis"
)


# [Note: SPMD meshes and dp_mesh_dims]
# FSDP2's ``dp_mesh_dims`` (torch's ``DataParallelMeshDims(shard=..., replicate=...)``) names
# which dims of one SPMD mesh (e.g. ``("dp_replicate", "dp_shard", "cp", "tp")``) are data
# parallel; the others belong to other parallelisms. :func:`resolve_dp_mesh` turns that into
# the mesh this library shards over, exactly as FSDP2 does: the ``shard`` dims (flattened into
# one dim when several, e.g. ``("dp_shard", "cp")``) are the inner axis; with ``replicate``
# dims too (flattened likewise) the result is the 2-D ``(replicate, shard)`` HSDP mesh; a
# ``replicate`` without ``shard`` (FSDP2's DDP mode) is the replicate dims' 1-D mesh with
# ``sharding_strategy="no_shard"`` (another strategy is refused: it would shard over what
# FSDP2 replicates over). The other dims may have any
# size: parameters split over them (tensor, context or expert parallel) are DTensors on the
# SPMD mesh, ``Replicate()`` on the dp dims, and take the FSDP x TP path with the placements on
# the other dims as their TP part (:func:`spmd_mesh_of` hands the mesh and the dp dim names to
# the parameter checks; [Note: SPMD parameters] in ``_dtensor/_tp_params.py``). DTensors on a
# TP sub-mesh of the same root mesh are accepted too (the ``mesh=mesh["dp"]`` way). Parameters
# may be plain tensors, as with any ``mesh=`` (replicated over the other dims); FSDP2 requires
# DTensors on the SPMD mesh there.


def _flat_submesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The 1-D mesh over the named dims of ``mesh`` (flattened when several, as FSDP2)."""
    if len(names) == 1:
        return mesh[names[0]]
    ordered = tuple(n for n in mesh.mesh_dim_names or () if n in names)
    return mesh[ordered]._flatten("_".join(ordered))


def _dim_names(value: Any, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else tuple(value)
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"dp_mesh_dims.{field} must be a mesh dim name or a tuple of names, got {value!r}"
        )
    return names


def resolve_dp_mesh(mesh: DeviceMesh | None, dp_mesh_dims: Any,
                    strategy: ShardingStrategy = ShardingStrategy.OPTIM_GRADS_PARAMS
                    ) -> DeviceMesh | None:
    """The data-parallel mesh ``fully_shard`` works on: ``mesh`` itself, or with
    ``dp_mesh_dims`` its data-parallel dims as a 1-D (shard, or replicate only with
    ``no_shard``) or 2-D (replicate, shard) mesh (see [Note: SPMD meshes and dp_mesh_dims]). No
    collective, except flattening several dims into one (which creates that group, as FSDP2
    does)."""
    if dp_mesh_dims is None:
        return mesh
    if not (hasattr(dp_mesh_dims, "shard") and hasattr(dp_mesh_dims, "replicate")):
        raise TypeError(
            "dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims(shard=..., "
            f"replicate=...), got {type(dp_mesh_dims).__name__}"
        )
    if not isinstance(mesh, DeviceMesh) or mesh.mesh_dim_names is None:
        raise ValueError(
            "dp_mesh_dims names dims of mesh, so mesh must be a DeviceMesh with dimension names "
            "(init_device_mesh(..., mesh_dim_names=(...))), got "
            f"{'an unnamed mesh' if isinstance(mesh, DeviceMesh) else type(mesh).__name__}"
        )
    shard = _dim_names(dp_mesh_dims.shard, "shard")
    replicate = _dim_names(dp_mesh_dims.replicate, "replicate")
    all_names = mesh.mesh_dim_names
    for name in shard + replicate:
        if name not in all_names:
            raise ValueError(
                f"dp_mesh_dims names the mesh dim {name!r}, which the mesh does not have "
                f"(its dims: {all_names})"
            )
    if set(shard) & set(replicate) or len(set(shard + replicate)) != len(shard + replicate):
        raise ValueError(
            f"dp_mesh_dims names a mesh dim twice: shard={shard}, replicate={replicate}"
        )
    if not shard:
        if strategy is not ShardingStrategy.NO_SHARD:
            raise ValueError(
                f"dp_mesh_dims with replicate={replicate} and no shard dims is FSDP2's "
                "replicated, DDP-like mode: pass sharding_strategy='no_shard' with it "
                "(parameters replicated, gradients all-reduced over the replicate dims), got "
                f"sharding_strategy={strategy.value!r}"
            )
        return _flat_submesh(mesh, replicate)
    shard_mesh = _flat_submesh(mesh, shard)
    if not replicate:
        return shard_mesh
    return DeviceMesh._concatenate([_flat_submesh(mesh, replicate), shard_mesh])


def spmd_mesh_of(mesh: DeviceMesh | None, dp_mesh_dims: Any) -> SpmdMesh | None:
    """The SPMD mesh and its data-parallel dim names, for ``dp_mesh_dims`` that
    :func:`resolve_dp_mesh` accepted; ``None`` without ``dp_mesh_dims``."""
    if dp_mesh_dims is None or mesh is None:
        return None
    names = (_dim_names(dp_mesh_dims.shard, "shard")
             + _dim_names(dp_mesh_dims.replicate, "replicate"))
    return SpmdMesh(mesh, names)


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
