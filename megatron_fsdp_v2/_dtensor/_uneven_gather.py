"""The gather that is right for uneven shards: the local tensors of the ranks along one mesh
dimension, concatenated in mesh order whatever their sizes (see [Note: uneven redistribution] in
``_redistribute.py``), and the small all-gather of per-rank sizes the other interceptions use to
find this rank's rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

__all__ = ["ALTERNATIVE", "dp_sharded_mesh_dims", "gather_shard", "gather_sizes", "is_shard_like"]

# What every refusal of an uneven DTensor path points to.
ALTERNATIVE = (
    "use megatron_fsdp_v2.checkpoint.get_full_state_dict(model) for full weights, or "
    "megatron_fsdp_v2.checkpoint.get_state_dict / save for weights with optimizer state"
)

_MAX_DIMS = 8


def is_shard_like(placement: Placement) -> bool:
    """``Shard`` or ``_StridedShard``: the local tensor is a part of the tensor."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.is_shard() or isinstance(placement, _StridedShard)


def dp_sharded_mesh_dims(placements: Sequence[Placement], mesh: DeviceMesh,
                         tp_dims: tuple[int, ...] = ()) -> list[int]:
    """The mesh dimensions of size > 1 that ``placements`` shard, tensor parallelism's
    ``tp_dims`` left out: where the library's rows may be."""
    return [k for k, p in enumerate(placements)
            if k not in tp_dims and is_shard_like(p) and mesh.size(k) > 1]


def _signature(local: torch.Tensor, dim: int, shape: tuple[int, ...] | None) -> list[int]:
    """What every rank of one gather must agree on, after this rank's size along ``dim``: the
    global shape (``-2`` when unknown), the rank and the element type."""
    global_shape = list(shape) if shape is not None else [-2] * local.dim()
    dtype = local.dtype
    return [
        local.shape[dim], local.dim(), dtype.itemsize, int(dtype.is_floating_point),
        int(dtype.is_complex), *(global_shape + [-1] * (_MAX_DIMS - len(global_shape))),
    ]


def gather_shard(
    local: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, dim: int,
    shape: tuple[int, ...] | None, what: str,
) -> torch.Tensor:
    """Concatenate along ``dim`` the local tensors of the ranks along ``mesh_dim``, in mesh
    order, whatever their sizes: two all-gathers (the sizes with a signature of the tensor,
    then the padded shards)."""
    process_group = mesh.get_group(mesh_dim)
    n = mesh.size(mesh_dim)
    if local.dim() > _MAX_DIMS:
        raise NotImplementedError(f"{what}: more than {_MAX_DIMS} dimensions; {ALTERNATIVE}")
    own = torch.tensor(_signature(local, dim, shape), dtype=torch.int64, device=local.device)
    everyone = torch.empty(n * own.numel(), dtype=torch.int64, device=local.device)
    dist.all_gather_into_tensor(everyone, own, group=process_group)
    rows = everyone.view(n, -1).tolist()
    sizes = [int(r[0]) for r in rows]
    # Every rank sees the same rows, so every rank raises together below.
    if any(r[1:] != rows[0][1:] for r in rows):
        raise RuntimeError(
            f"{what}: the ranks along mesh dimension {mesh_dim} are gathering different "
            "tensors (global shape or dtype differ), so nothing was gathered. A fully_shard "
            "rank whose shard of a parameter is empty has grad None and no optimizer state for "
            "it, so code that walks gradients or optimizer states rank by rank (e.g. torch's "
            "get_optimizer_state_dict(full_state_dict=True)) pairs different tensors; "
            f"{ALTERNATIVE}"
        )
    if shape is not None and sum(sizes) != shape[dim]:
        raise RuntimeError(
            f"{what}: the local tensors along mesh dimension {mesh_dim} hold {sizes} entries "
            f"of dim {dim}, which do not add up to the global size {shape[dim]}: they are not "
            f"a partition of the tensor; {ALTERNATIVE}"
        )
    rows_first = local.movedim(dim, 0)
    most = max(sizes)
    padded = rows_first.new_zeros((most, *rows_first.shape[1:]))
    padded[: rows_first.shape[0]].copy_(rows_first)
    out = rows_first.new_empty((n * most, *rows_first.shape[1:]))
    dist.all_gather_into_tensor(out, padded, group=process_group)
    pieces = [out[k * most : k * most + size] for k, size in enumerate(sizes)]
    return torch.cat(pieces).movedim(0, dim).contiguous()


def gather_sizes(
    own: list[int], device: torch.device, mesh: DeviceMesh, mesh_dim: int
) -> list[list[int]]:
    """``own`` of every rank along ``mesh_dim``, in mesh order (one all-gather)."""
    n = mesh.size(mesh_dim)
    mine = torch.tensor(own, dtype=torch.int64, device=device)
    out = torch.empty(n * len(own), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, mine, group=mesh.get_group(mesh_dim))
    return [[int(v) for v in row] for row in out.view(n, -1).tolist()]
