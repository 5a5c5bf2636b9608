"""The library's process groups: the default mesh, and the communication group of each unit,
created with the collective timeout (cached in ``_registry``)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import _registry

__all__ = [
    "DEFAULT_TIMEOUT", "LAUNCH_HINT", "clear_comm_groups", "comm_group", "default_mesh",
    "group_alive", "library_comm_groups", "timeout_group", "mesh_comm_group",
]

LAUNCH_HINT = (
    "launch with torchrun (e.g. `torchrun --nproc_per_node=2 train.py`) and call "
    "torch.distributed.init_process_group('nccl' on GPUs or 'gloo' on CPU) before fully_shard"
)

# Default timeout of the library's collectives (see ``comm_group``): well under torch's default
# (10 minutes), so a rank that died or diverged fails the others in bounded time.
DEFAULT_TIMEOUT = timedelta(minutes=5)


def group_alive(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still registered (not destroyed by ``destroy_process_group``)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the whole world: ``cuda`` for NCCL, ``cpu`` otherwise (gloo)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"fully_shard needs an initialized default process group: {LAUNCH_HINT}")
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = _registry.default_meshes.get(device_type)
    if mesh is None or not group_alive(mesh.get_group()):
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        _registry.default_meshes[device_type] = mesh
    return mesh


# ---------------------------------------------------------------------- communication group
# [Note: collective timeout]
# All of the library's collectives run on a process group created here, over the mesh's ranks,
# with ``timeout`` (default DEFAULT_TIMEOUT). When a rank fails (an exception in forward,
# backward or the optimizer step) and leaves the others inside a collective, they raise after
# ``timeout`` instead of waiting for torch's default (10 minutes) or forever: gloo raises from the
# collective (or from ``work.wait()``); NCCL's watchdog aborts the communicator and, by default,
# the process, which torchrun then reports. ``new_group`` is itself collective over the mesh's
# ranks: ``fully_shard`` creates the group on its first call with a given (mesh, timeout) and
# every rank makes the same calls in the same order (wrapping is identical on every rank), so
# the creations match. The group is cached per (mesh ranks, timeout, backend, axis), so a model of
# many units uses one group (one NCCL communicator) per distinct timeout and axis. On a 2-D (HSDP)
# mesh each axis gets its own: the inner (``"shard"``) group, created first, then the outer one;
# both are sub-meshes, so only their members call ``new_group`` (``use_local_synchronization``).

def comm_group(
    mesh: DeviceMesh, timeout: timedelta | None, axis: str = "shard"
) -> dist.ProcessGroup:
    """The process group the units on the 1-D ``mesh`` communicate on: the mesh's own group when
    ``timeout`` is ``None`` or the mesh has one rank, else a group over the mesh's ranks with that
    timeout (created once, then cached). ``axis``: ``"shard"`` (a 1-D mesh, or the inner axis of
    a 2-D one) or ``"outer"`` (HSDP's replicate axis)."""
    mesh_group = mesh.get_group()
    if timeout is None or mesh.size() == 1:
        return mesh_group
    ranks = tuple(dist.get_process_group_ranks(mesh_group))
    return timeout_group(ranks, str(dist.get_backend(mesh_group)), timeout, axis)


def mesh_comm_group(mesh: DeviceMesh, timeout: timedelta | None) -> dist.ProcessGroup:
    """A process group over every rank of the (2-D) ``mesh``, axis ``"mesh"``: where HSDP with
    outer ``optim`` all-reduces gradient norms (each rank holds a distinct sub-shard). With
    ``timeout`` ``None``: the flattened mesh's own group."""
    if timeout is None:
        return mesh._flatten().get_group()
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    backend = str(dist.get_backend(mesh.get_group(0)))
    return timeout_group(ranks, backend, timeout, "mesh")


def timeout_group(
    ranks: tuple[int, ...], backend: str, timeout: timedelta | None, axis: str
) -> dist.ProcessGroup:
    """A group over ``ranks`` with ``timeout`` (``None``: torch's default), created once per
    (ranks, timeout, backend, axis) and cached in ``_registry.comm_groups``. Collective over
    ``ranks`` on its first call."""
    seconds = -1.0 if timeout is None else timeout.total_seconds()
    key = (ranks, seconds, backend, axis)
    group = _registry.comm_groups.get(key)
    if group is not None and group_alive(group):
        return group
    covers_world = len(ranks) == dist.get_world_size()
    group = dist.new_group(
        list(ranks),
        timeout=timeout,
        backend=None if backend == str(dist.get_backend()) else backend,
        # A sub-mesh (e.g. mesh["dp"] of a 2-D mesh): only its members call new_group.
        use_local_synchronization=not covers_world,
        group_desc=f"megatron_fsdp_v2 {axis} (timeout {seconds:g}s)",
    )
    assert isinstance(group, dist.ProcessGroup)  # every caller is a member of the mesh
    _registry.comm_groups[key] = group
    return group


def clear_comm_groups() -> None:
    """Forget the cached groups, so the next ``fully_shard`` creates fresh ones (tests: after a
    collective timed out, its group no longer matches across ranks and must not be reused)."""
    _registry.comm_groups.clear()


def library_comm_groups() -> list[dist.ProcessGroup]:
    """The distinct live process groups ``comm_group`` created in this process for the inner
    (``"shard"``) axis, the one every step collective but HSDP's outer ones runs on, and the
    whole-mesh (``"mesh"``) groups of HSDP with outer ``optim``: the groups gradient norms are
    all-reduced over (an outer-optim job has two, so ``clip_grad_norm_``'s fallback for an empty
    list does not apply to it). The same on every rank of a mesh, because every rank makes the
    same ``fully_shard`` calls."""
    groups: list[dist.ProcessGroup] = []
    for key, group in _registry.comm_groups.items():
        if key[3] not in ("shard", "mesh"):
            continue
        if group_alive(group) and all(group is not g for g in groups):
            groups.append(group)
    return groups
