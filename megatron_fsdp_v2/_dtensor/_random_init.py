"""In-place random ops (``nn.init.normal_``, ``uniform_``, ``trunc_normal_``, ``kaiming_*``,
``xavier_*``...) on the library's DTensor parameters and their kin: the values a single process
would draw, each rank keeping its own rows.

[Note: random init of uneven shards]
torchtitan initializes a model after ``fully_shard`` and ``to_empty`` by calling ``nn.init.*`` on
the DTensor parameters. DTensor draws a sharded tensor's local values by assuming ``torch.chunk``
rows: on a CUDA mesh its offset-based generator skips to the chunk's offset in the full tensor's
random stream, elsewhere every rank draws its local tensor from its own generator. Our rows
follow the flat buffers (see [Note: uneven redistribution] in ``_redistribute.py``), so either
way two ranks can draw the same values for different rows, or a rank's rows get another part of
the stream: a degraded initialization, without an error.

For a DTensor sharded along a mesh dimension of a mesh ``fully_shard`` registered,
:func:`_random_handler` instead draws the *full* tensor on every rank from the default (or given)
generator, exactly as single-process code would, and copies this rank's rows out (all of them
for ``Replicate()``, where DTensor's own path ignores an explicit ``generator=``): the values
equal, bitwise, those of the same init on the unsharded model with the same seed, and every
rank's generator advances alike. This rank's row offset comes from one small all-gather of the
ranks' row counts per sharded mesh dimension (the spec does not carry it). The cost is one
temporary full-size tensor per call, at init time. DTensors on other meshes, or with a
``Partial`` placement, take DTensor's own path. The handler is registered in DTensor's op table
for the in-place random ops by ``_torch_patches/_random_ops.py``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor, Shard

from ._uneven_gather import gather_sizes
from ._uneven_meshes import mesh_kind, tp_dims_of

__all__ = ["random_op"]


def _is_ours(dtensor: Any) -> bool:
    """On a registered mesh, with ``Shard``/``Replicate`` placements only."""
    from torch.distributed.tensor import DTensor

    return (
        isinstance(dtensor, DTensor)
        and mesh_kind(dtensor.device_mesh) is not None
        and all(p.is_shard() or p.is_replicate() for p in dtensor.placements)
    )


def _sharded_dims(dtensor: Any) -> list[tuple[int, int]]:
    """(mesh dim, tensor dim) of every mesh dimension of size > 1 ``dtensor`` is sharded over."""
    mesh = dtensor.device_mesh
    return [
        (k, cast(Shard, p).dim % dtensor.ndim) for k, p in enumerate(dtensor.placements)
        if p.is_shard() and mesh.size(k) > 1
    ]


def _row_offset(dtensor: Any, sharded: list[tuple[int, int]]) -> int:
    """Where this rank's rows start along the sharded tensor dimension. One mesh dimension:
    ranks hold consecutive rows in mesh order. Two (HSDP outer ``optim``, ``(Shard(0),
    Shard(0))``): sub-shard ``s * R + r`` for outer rank ``r``, inner rank ``s``."""
    mesh, local = dtensor.device_mesh, dtensor._local_tensor
    dim = sharded[0][1]
    if any(d != dim for _, d in sharded) or len(sharded) > 2:
        raise NotImplementedError(
            f"random init of a DTensor sharded as {dtensor.placements} on a mesh fully_shard "
            "uses: only one sharded tensor dimension is supported; initialize the model before "
            "fully_shard, or build it on the meta device and let fully_shard materialize it"
        )
    if len(sharded) == 1:
        k = sharded[0][0]
        sizes = [row[0] for row in gather_sizes([local.shape[dim]], local.device, mesh, k)]
        return sum(sizes[: mesh.get_local_rank(k)])
    (outer, _), (inner, _) = sharded
    # Sizes along the outer dimension at this inner rank, then those rows along the inner one:
    # table[s][r] is the size of sub-shard s * R + r.
    by_outer = [row[0] for row in gather_sizes([local.shape[dim]], local.device, mesh, outer)]
    table = gather_sizes(by_outer, local.device, mesh, inner)
    r, s = mesh.get_local_rank(outer), mesh.get_local_rank(inner)
    return sum(sum(row) for row in table[:s]) + sum(table[s][:r])


def random_op(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``dtensor.<random op>_(...)`` (see [Note: random init of uneven shards]), or
    ``NotImplemented`` for DTensor's own path (not on a registered mesh, or ``Partial``)."""
    target = args[0]
    if isinstance(target, DTensor) and tp_dims_of(target.device_mesh):
        raise NotImplementedError(
            f"random init of a DTensor on a data-parallel x tensor-parallel mesh "
            f"({target.placements}, FSDP x TP): not supported yet; initialize the model before "
            "parallelize_module/fully_shard, or load its weights (e.g. torch's "
            "set_model_state_dict with full_state_dict=True)"
        )
    if not _is_ours(target):
        return NotImplemented
    local = target._local_tensor
    sharded = _sharded_dims(target)
    offset = _row_offset(target, sharded) if sharded else 0
    full = torch.empty(target.shape, dtype=local.dtype, device=local.device)
    op_call(full, *args[1:], **kwargs)
    with torch.no_grad():
        local.copy_(full.narrow(sharded[0][1], offset, local.shape[sharded[0][1]])
                    if sharded else full)
    return target
