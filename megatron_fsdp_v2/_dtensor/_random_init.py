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
temporary full-size tensor per call, at init time. The handler is registered in DTensor's op
table for the in-place random ops by ``_torch_patches/_random_ops.py``.

Which DTensors it draws for is decided by tensor, as everywhere on a registered mesh ([Note:
deciding by tensor] in ``_redistribute.py``): one whose data-parallel sharded dims have sizes no
parameter on the mesh has dim 0 of (the user's ``distribute_tensor`` results, activations) holds
``torch.chunk`` rows and draws what DTensor draws for it, with FSDP2 as without the library;
so does one sharded over no data-parallel dim whose dim 0 no parameter has (a replicated
parameter of ours, ``no_shard``'s, is drawn here, so that ``generator=`` is honoured and the
values are the single-process ones), and DTensor's nested ``Shard(d)`` over dp next to a TP
``Shard(d)`` (never a unit's). DTensors on other meshes, or with a ``Partial`` placement, take
DTensor's own path too.

FSDP x TP (the optimizer-facing DTensors on the dp x TP mesh of [Note: 2-D parameters] in
``_tp_params.py``, DTensor TP parameters and ``spmd_types``-annotated plain ones alike, e.g.
``(_StridedShard(0, sf=2), Shard(0))``): the full tensor is drawn the same way, this rank's
TP-local piece is cut out of it at DTensor's own ``torch.chunk`` offsets (TP's shards are
DTensor's, only the dp dims hold uneven rows), and this rank's dp rows out of that piece, the
row offset found as above over the dp mesh dimensions (their groups hold ranks of one TP
coordinate, whose TP-local tensors are the same tensor). A ``_StridedShard`` dp placement is
read as what the library means by it: consecutive rows of the TP-local tensor (a plain dp
``Shard(d)`` next to a TP ``Shard(d)``, from ``distribute_tensor`` on the root mesh, is
DTensor's nested layout and DTensor's to draw, above).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._redistribute import chunk_rows
from ._uneven_gather import dp_sharded_mesh_dims, gather_sizes, is_shard_like
from ._uneven_meshes import mesh_kind, row_counts_of, tp_dims_of

__all__ = ["random_op"]


def _on_our_mesh(dtensor: Any, tp_dims: tuple[int, ...]) -> bool:
    """On a registered mesh, with ``Shard``/``Replicate`` placements only (and, on a dp x TP
    mesh, the ``_StridedShard`` dp placement of [Note: 2-D parameters])."""
    return (
        isinstance(dtensor, DTensor)
        and mesh_kind(dtensor.device_mesh) is not None
        and all(p.is_shard() or p.is_replicate()
                or (bool(tp_dims) and k not in tp_dims and is_shard_like(p))
                for k, p in enumerate(dtensor.placements))
    )


def _sharded_dims(dtensor: Any, tp_dims: tuple[int, ...]) -> list[tuple[int, int]]:
    """(mesh dim, tensor dim) of every data-parallel mesh dimension of size > 1 ``dtensor`` is
    sharded over (the fully_shard rows; not the TP dims ``tp_dims``)."""
    placements = dtensor.placements
    return [(k, cast(Shard, placements[k]).dim % dtensor.ndim)
            for k in dp_sharded_mesh_dims(placements, dtensor.device_mesh, tp_dims)]


def _row_offset(dtensor: Any, sharded: list[tuple[int, int]]) -> int:
    """Where this rank's rows start along the sharded tensor dimension (of the TP-local tensor
    on a dp x TP mesh). One mesh dimension: ranks hold consecutive rows in mesh order. Two (HSDP
    outer ``optim``, ``(Shard(0), Shard(0))``): sub-shard ``s * R + r`` for outer rank ``r``,
    inner rank ``s``."""
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


def _nested_tp_shard(dtensor: Any, tp_dims: tuple[int, ...]) -> bool:
    """A plain dp ``Shard(d)`` next to a TP ``Shard(d)``: DTensor's nested meaning (dp chunk
    first, e.g. ``distribute_tensor`` on the root mesh), never a unit's (those are
    ``_StridedShard``), as ``_redistribute._redistribute_2d`` reads it: ``torch.chunk`` pieces
    on every mesh dim."""
    placements = dtensor.placements
    tp_shard = {cast(Shard, placements[k]).dim % dtensor.ndim for k in tp_dims
                if placements[k].is_shard()}
    return any(p.is_shard() and cast(Shard, p).dim % dtensor.ndim in tp_shard
               for k, p in enumerate(placements) if k not in tp_dims)


def _tp_piece(full: torch.Tensor, dtensor: Any, tp_dims: tuple[int, ...]) -> torch.Tensor:
    """This rank's TP-local piece of ``full`` (a view): DTensor's own offsets for the TP
    placements, the dp dims read as ``Replicate()``."""
    return _piece(full, dtensor, tuple(p if k in tp_dims else Replicate()
                                       for k, p in enumerate(dtensor.placements)))


def _piece(full: torch.Tensor, dtensor: Any, placements: tuple[Any, ...]) -> torch.Tensor:
    """The part of ``full`` DTensor's ``torch.chunk`` layout gives this rank under
    ``placements`` (a view)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh,
                                                           placements)
    piece = full
    for d, (size, offset) in enumerate(zip(shape, offsets)):
        if size != full.shape[d]:
            piece = piece.narrow(d, offset, size)
    return piece


def _may_hold_our_rows(dtensor: Any, sharded: list[tuple[int, int]], op_call: Any) -> bool:
    """Whether ``dtensor`` may be a parameter of ours or keep one's size (its gradient, state,
    a derived tensor), decided from the spec alone, the same on every rank ([Note: deciding by
    tensor] in ``_redistribute.py``): sharded over dp, by :func:`chunk_rows`, which also raises
    where a tensor called ``torch.chunk``'s holds other rows; sharded over no dp dim, by the
    size of dim 0."""
    if sharded:
        what = f"{op_call} on a DTensor {tuple(dtensor.placements)} on {dtensor.device_mesh}"
        return not chunk_rows(dtensor._local_tensor, dtensor._spec, [k for k, _ in sharded],
                              what)
    counts = row_counts_of(dtensor.device_mesh)
    return dtensor.ndim > 0 and dtensor.shape[0] in counts


def random_op(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``dtensor.<random op>_(...)`` (see [Note: random init of uneven shards]), or
    ``NotImplemented`` for DTensor's own path (not on a registered mesh, ``Partial``, or a
    tensor that cannot be ours)."""
    target = args[0]
    tp_dims = tp_dims_of(target.device_mesh) if isinstance(target, DTensor) else ()
    if not _on_our_mesh(target, tp_dims):
        return NotImplemented
    if _nested_tp_shard(target, tp_dims):
        return NotImplemented  # DTensor's nested torch.chunk pieces: never a unit's
    sharded = _sharded_dims(target, tp_dims)
    if not _may_hold_our_rows(target, sharded, op_call):
        return NotImplemented
    local = target._local_tensor
    offset = _row_offset(target, sharded) if sharded else 0
    full = torch.empty(target.shape, dtype=local.dtype, device=local.device)
    op_call(full, *args[1:], **kwargs)
    piece = _tp_piece(full, target, tp_dims) if tp_dims else full
    if sharded:
        piece = piece.narrow(sharded[0][1], offset, local.shape[sharded[0][1]])
    with torch.no_grad():
        local.copy_(piece)
    return target
