"""``dst.copy_(src)`` between two DTensors of the same placements whose rows differ (one of the
library's uneven shards and a ``torch.chunk`` one), on a mesh ``fully_shard`` registered (see
[Note: uneven redistribution] in ``_redistribute.py``). Installed as DTensor's ``aten.copy_``
handler by ``_torch_patches/_copy_handler.py``."""

from __future__ import annotations

from typing import Any, cast

from torch.distributed.tensor import Replicate, Shard

from ._chunk_metadata import ROWS_ATTR
from ._redistribute import chunk_rows
from ._uneven_gather import ALTERNATIVE, dp_sharded_mesh_dims, gather_sizes, is_shard_like
from ._uneven_meshes import any_mesh_registered, mesh_kind, tp_dims_of

__all__ = ["copy_rows"]


def copy_rows(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``dst.copy_(src)`` for DTensors, or ``NotImplemented`` for DTensor's own ``copy_``.

    Same placements do not mean same rows: one of ours and a ``torch.chunk`` one
    (``distribute_tensor``) differ, and DTensor would copy local tensor to local tensor,
    silently (a 0- or 1-row local tensor broadcasts). On a registered mesh, when ``src`` is
    sharded like ``dst`` along one mesh dimension and does not carry the rows marker of the
    library's own state-dict conversions, compare both tensors' sizes on every rank (one small
    all-gather); if they differ, gather ``src`` and keep ``dst``'s rows."""
    dst, src = args[0], args[1]
    dims = _copy_needs_check(dst, src)
    if dims is None or hasattr(src._local_tensor, ROWS_ATTR):
        return NotImplemented
    k, dim = dims
    mesh = dst.device_mesh
    what = f"DTensor copy_ of {src.placements} into {dst.placements}"
    # [Note: deciding by tensor] in _redistribute.py: two DTensors whose dp-sharded sizes no
    # parameter has hold torch.chunk rows both (checked): a local copy.
    tp_dims = tp_dims_of(mesh)
    dp_sharded = dp_sharded_mesh_dims(dst.placements, mesh, tp_dims)
    if dp_sharded and all(chunk_rows(t._local_tensor, t._spec, dp_sharded, what)
                          for t in (dst, src)):
        return NotImplemented
    if mesh_kind(mesh) and sum(1 for n, p in enumerate(dst.placements)
                               if is_shard_like(p) and mesh.size(n) > 1) > 1:
        raise NotImplementedError(
            f"{what} on a mesh used with outer_dp_sharding_strategy='optim': the two may hold "
            f"their sub-shards in different orders; {ALTERNATIVE}, and "
            "megatron_fsdp_v2.checkpoint.load_full_state_dict to load full weights"
        )
    table = gather_sizes(
        [dst._local_tensor.shape[dim], src._local_tensor.shape[dim]], dst._local_tensor.device,
        mesh, k,
    )
    if all(a == b for a, b in table):
        return NotImplemented
    if sum(row[1] for row in table) != dst.shape[dim]:
        raise ValueError(f"{what}: source rows {[r[1] for r in table]} do not tile dim {dim}")
    replicated = src._spec.placements[:k] + (Replicate(),) + src._spec.placements[k + 1 :]
    full = src.redistribute(mesh, replicated).to_local()  # the right gather (see above)
    rank = mesh.get_local_rank(k)
    offset = sum(row[0] for row in table[:rank])
    rows = full.narrow(dim, offset, table[rank][0])
    dst._local_tensor.copy_(rows, *args[2:], **kwargs)
    return dst


def _copy_needs_check(dst: Any, src: Any) -> tuple[int, int] | None:
    """(mesh dim, tensor dim) of the one sharded mesh dimension of two DTensors on a registered
    mesh with the same placements; None when there is nothing to check."""
    from torch.distributed.tensor import DTensor

    if not (isinstance(dst, DTensor) and isinstance(src, DTensor)) or not any_mesh_registered():
        return None
    mesh = dst.device_mesh
    if src.device_mesh != mesh or src.placements != dst.placements or dst.shape != src.shape:
        return None
    if mesh_kind(mesh) is None:
        return None
    sharded = [
        (k, cast(Shard, p).dim % dst.ndim) for k, p in enumerate(dst.placements)
        if p.is_shard() and mesh.size(k) > 1
    ]
    return sharded[-1] if sharded else None
