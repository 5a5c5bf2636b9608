"""The meshes ``fully_shard`` shards over, whose ``Shard`` DTensors may hold uneven row ranges
(see [Note: uneven redistribution] in ``_redistribute.py``). Every DTensor interception of the
library asks :func:`mesh_kind` first and leaves DTensors on other meshes to torch. This module
is the one reader and writer of the registry's list of those meshes (``_registry.uneven_meshes``,
registered by the frontend's wiring): the other DTensor paths ask it."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from .. import _registry

__all__ = [
    "any_mesh_registered", "mesh_is_registered", "mesh_kind", "register_mesh", "row_counts_of",
    "tp_dims_of",
]


def register_mesh(mesh: DeviceMesh, *, outer_optim: bool, tp_dims: tuple[int, ...] = (),
                  row_counts: tuple[int, ...] = ()) -> None:
    """Mark ``mesh`` as one whose ``Shard`` DTensors may hold uneven row ranges; ``outer_optim``:
    a 2-D mesh whose units shard over both dimensions in inner-first order. ``tp_dims``: the
    mesh dimensions that are tensor parallelism's (a dp x TP mesh of 2-D parameters, see [Note:
    2-D parameters] in ``_tp_params.py``): their shards are DTensor's own ``torch.chunk``
    pieces; only the other (dp) dimensions hold uneven rows. ``row_counts``: the global dim-0
    sizes of the parameters whose optimizer-facing DTensors live on it (the dimension the dp
    dims shard), which decide which DTensors there may hold our rows ([Note: deciding by
    tensor] in ``_redistribute.py``). The torch patches that read this are installed by
    ``fully_shard`` (``_torch_patches.install_all``)."""
    for entry in _registry.uneven_meshes:
        # Every unit builds its own dp x TP mesh object; equal ones are one entry.
        if entry[0] is mesh or (tp_dims and entry[2] == tuple(tp_dims) and entry[0] == mesh):
            entry[1] = entry[1] or outer_optim
            entry[3] = entry[3] | frozenset(row_counts)
            return
    _registry.uneven_meshes.append([mesh, outer_optim, tuple(tp_dims), frozenset(row_counts)])


def any_mesh_registered() -> bool:
    """Whether ``fully_shard`` registered any mesh (a cheap first test on torch's DTensor paths:
    without one, nothing of ours can be involved)."""
    return bool(_registry.uneven_meshes)


def mesh_is_registered(mesh: DeviceMesh) -> bool:
    """Whether ``fully_shard`` shards over ``mesh`` (its ``Shard`` DTensors may be uneven)."""
    return mesh_kind(mesh) is not None


def mesh_kind(mesh: DeviceMesh) -> bool | None:
    """``None``: not registered; else whether it is an outer-optim mesh."""
    found: bool | None = None
    for registered, outer_optim, *_ in _registry.uneven_meshes:
        if registered is mesh or registered == mesh:
            found = bool(found) or outer_optim
    return found


def tp_dims_of(mesh: DeviceMesh) -> tuple[int, ...]:
    """The tensor-parallel dimensions of a registered ``mesh`` (none for a dp-only mesh)."""
    for registered, _, tp_dims, _ in _registry.uneven_meshes:
        if (registered is mesh or registered == mesh) and tp_dims:
            return tuple(tp_dims)
    return ()


def row_counts_of(mesh: DeviceMesh) -> frozenset[int]:
    """The registered parameters' dim-0 sizes on a registered ``mesh`` (see
    :func:`register_mesh`); the same on every rank of the mesh, since every rank wraps the same
    modules and the sizes are global."""
    found: frozenset[int] = frozenset()
    for registered, _, _, counts in _registry.uneven_meshes:
        if registered is mesh or registered == mesh:
            found = found | counts
    return found
