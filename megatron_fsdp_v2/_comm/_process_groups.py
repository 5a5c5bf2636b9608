"""The library's process groups: the default mesh, and the communication group of each unit,
created with the collective timeout (cached in ``_registry``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .. import _registry
from ._backends import backend_impl, collective_device, collective_device_type, group_timeout

__all__ = [
    "DEFAULT_TIMEOUT", "LAUNCH_HINT", "clear_process_groups", "unit_process_group", "default_mesh",
    "process_group_alive", "library_process_groups", "mesh_process_group",
    "post_forward_process_group", "timeout_process_group", "whole_mesh_process_group",
]

LAUNCH_HINT = (
    "launch with torchrun (e.g. `torchrun --nproc_per_node=2 train.py`) and call "
    "torch.distributed.init_process_group('nccl' on GPUs or 'gloo' on CPU) before fully_shard"
)

# Default timeout of the library's collectives (see ``unit_process_group``): well under torch's
# default (10 minutes), so a rank that died or diverged fails the others in bounded time.
DEFAULT_TIMEOUT = timedelta(minutes=5)


def process_group_alive(process_group: dist.ProcessGroup) -> bool:
    """Whether ``process_group`` is still registered (not destroyed by
    ``destroy_process_group``)."""
    try:
        dist.get_process_group_ranks(process_group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the whole world, on ``cuda`` or ``cpu`` (see the comment inside)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"fully_shard needs an initialized default process group: {LAUNCH_HINT}")
    # "cuda" when the default group has a CUDA backend of its own (NCCL, whatever string named
    # it: "nccl", "cuda:nccl", "cpu:gloo,cuda:nccl", or no backend at all on a GPU machine) and
    # this process can use CUDA: torchrun with one GPU per rank. "cpu" otherwise, gloo included
    # (it lists cuda too, but through host copies; see [Note: backend detection]).
    device_type = collective_device_type()
    mesh = _registry.default_meshes.get(device_type)
    if mesh is None or not process_group_alive(mesh.get_group()):
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        _registry.default_meshes[device_type] = mesh
    return mesh


# ---------------------------------------------------------------------- communication group
# [Note: collective timeout]
# All of the library's collectives run on a process group over the mesh's ranks with
# ``timeout`` (default DEFAULT_TIMEOUT). When a rank fails (an exception in forward, backward or
# the optimizer step) and leaves the others inside a collective, they raise after ``timeout``
# instead of waiting for torch's default (10 minutes) or forever: gloo raises from the
# collective (or from ``work.wait()``); NCCL's watchdog aborts the communicator and, by default,
# the process, which torchrun then reports.
#
# Which group (``timeout_process_group``), cached per (mesh ranks, timeout, backend config, axis):
# * the mesh's own group when it already has that timeout, or ``timeout`` is ``None``: nothing
#   is created (no collective, no extra NCCL communicator);
# * else a group split from the mesh's group with ``dist.split_group`` when the default group is
#   bound to a device (``init_process_group(..., device_id=...)``, as examples/train.py does).
#   There ``new_group`` would not do: torch creates every new group as an ``ncclCommSplit`` of
#   the *default* group's communicator, a collective over the whole job, so ranks that create
#   different groups (pipeline stages with their own meshes or timeouts) would hang in it, even
#   with ``use_local_synchronization``. ``split_group`` splits the mesh's communicator instead:
#   only the mesh's ranks take part;
# * else (no bound device: gloo, or NCCL initialised lazily) ``new_group`` over the mesh's
#   ranks, with ``use_local_synchronization`` for a sub-mesh so only its members take part:
#   without a bound device torch creates the group from the store among the members, and
#   ``split_group`` is not available (it needs a bound device).
# Creation is collective over the mesh's ranks only; every rank of a mesh makes the same
# ``fully_shard`` calls in the same order (wrapping is identical on every rank), so the
# creations match. So a model of many units uses one group per distinct timeout and axis. On
# a 2-D (HSDP) mesh each axis gets its own: the inner (``"shard"``) group, created first, then
# the outer one. The whole-mesh group of HSDP with outer ``optim`` (axis ``"mesh"``) has no
# mesh group over exactly its ranks to start from when the mesh is a sub-mesh of a larger one:
# with a bound device it is split from torch's flattened mesh (``mesh._flatten()``, which torch
# creates collectively over the whole job), without one it is a members-only ``new_group``.
#
# A limit that comes from torch, not from these calls: torch names a new group from a counter
# that each rank advances per group it creates. Ranks of different sub-meshes that create
# different numbers of groups (here: different numbers of distinct timeouts) end up with
# different counters, and a later group created over ranks of both (a ``new_group`` of the
# job, a new mesh) then gets different names on different ranks and hangs. Create every mesh
# before the first ``fully_shard``, give every sub-mesh the same number of distinct timeouts,
# or pass ``timeout=None`` (the mesh's groups, nothing created). On torch 2.11 to 2.13 the
# library's own groups need more care, see [Note: group names before torch 2.14].

# [Note: group names before torch 2.14]
# A group created by its members alone (``new_group(..., use_local_synchronization=True)``,
# ``split_group``) is named by a hash of its ranks and, before torch 2.14, of how many groups
# this process belongs to (``len(_world.pg_names)``; 2.14 hashes a creation counter instead).
# The name is the store prefix under which the members meet, so members that belong to
# different numbers of groups (ranks of two pipeline stages that created different groups, a
# rank that was left out of an earlier ``new_group``) compute different names: gloo then fails
# with "Connection refused" on one rank and the others hang. The count also falls when groups
# are destroyed, so a later group over the same ranks can get the name of a destroyed one, and
# its members then read the stale addresses the old group left in the store (the same
# "Connection refused"). So on those releases the members first agree on the count to be named
# with: at least one more than any library group of this process was named with, and at least
# every member's (a MAX all-reduce of one integer over groups that connect them, once per
# library group created, at wrap time); a member below it creates one-rank gloo groups (no
# peer, no communicator) until it is level. The name torch then computes is the same on every
# member and new in the job. This is the only version branch of the module
# (``_NAMES_COUNT_MEMBERSHIPS``); it reads torch's group table and changes nothing in it.
_NAMES_COUNT_MEMBERSHIPS = tuple(
    int(part) for part in str(torch.__version__).split("+")[0].split(".")[:2]) < (2, 14)


def _level_group_names(connecting: Sequence[dist.ProcessGroup]) -> None:
    """Before a members-only group is created, make this process belong to as many groups as
    the other members, and to more than when it named the last one (torch < 2.14, see
    [Note: group names before torch 2.14]). The groups in
    ``connecting`` must chain every member of the new group (its parent, or the dimensions of
    a mesh): a MAX all-reduce over each in turn gives every member the maximum."""
    if not _NAMES_COUNT_MEMBERSHIPS or dist.get_backend() == "fake":
        return  # 2.14 on; or the estimator's fake world, where no member meets another
    memberships = len(distributed_c10d._world.pg_names)
    count = torch.tensor([max(memberships, _registry.group_names_level[0] + 1)], dtype=torch.int64)
    for group in connecting:
        if dist.get_world_size(group) > 1:
            on_device = count.to(collective_device(group))
            dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=group)
            count = on_device.cpu()
    for _ in range(int(count.item()) - memberships):
        dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True,
                       group_desc="megatron_fsdp_v2 group-name level (torch < 2.14)")
    _registry.group_names_level[0] = int(count.item())


def unit_process_group(
    mesh: DeviceMesh, timeout: timedelta | None, axis: str = "shard"
) -> dist.ProcessGroup:
    """The process group the units on the 1-D ``mesh`` communicate on: the mesh's own group when
    ``timeout`` is ``None`` or the mesh has one rank, else :func:`timeout_process_group` of it.
    ``axis``: ``"shard"`` (a 1-D mesh, or the inner axis of a 2-D one) or ``"outer"`` (HSDP's
    replicate axis)."""
    mesh_process_group = mesh.get_group()
    if timeout is None or mesh.size() == 1:
        return mesh_process_group
    return timeout_process_group(mesh_process_group, timeout, axis)


def mesh_process_group(mesh: DeviceMesh, timeout: timedelta | None) -> dist.ProcessGroup:
    """A process group over every rank of the (2-D) ``mesh``, axis ``"mesh"``: where HSDP with
    outer ``optim`` all-reduces gradient norms (each rank holds a distinct sub-shard). With
    ``timeout`` ``None``: the flattened mesh's own group."""
    if timeout is None:
        return mesh._flatten().get_group()
    return whole_mesh_process_group(mesh, timeout)


def whole_mesh_process_group(mesh: DeviceMesh, timeout: timedelta | None) -> dist.ProcessGroup:
    """A group over every rank of ``mesh`` with ``timeout`` (``None``: torch's default, or the
    default group's when the mesh spans the job), axis ``"mesh"``, cached; collective over the
    mesh's ranks on its first call (see the note above for a sub-mesh with a bound device)."""
    ranks = tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))
    if len(ranks) == dist.get_world_size():
        world = dist.group.WORLD
        assert world is not None  # initialized: the mesh exists
        return timeout_process_group(world, timeout, "mesh")
    if _splits_communicators(mesh.get_group(0)):
        return timeout_process_group(mesh._flatten().get_group(), timeout, "mesh")
    config = str(dist.get_backend_config(mesh.get_group(0)))
    return _cached(_key(ranks, timeout, config, "mesh"), lambda: _members_process_group(
        ranks, config, timeout, "mesh", [mesh.get_group(dim) for dim in range(mesh.ndim)]))


def post_forward_process_group(
    parent: dist.ProcessGroup, size: int, timeout: timedelta | None
) -> dist.ProcessGroup:
    """The group of ``size`` consecutive ranks of ``parent`` (a unit's shard axis) that this
    rank belongs to, axis ``"post_forward"``: where ``reshard_after_forward=<size>`` gathers
    before backward (FSDP2's post-forward mesh: ``parent``'s ranks viewed as ``(-1, size)``).
    Cached per (ranks, timeout); on its first call collective over ``parent``'s ranks (split
    from its communicator where torch splits, see the note above) or over the members only."""
    ranks = tuple(dist.get_process_group_ranks(parent))
    if size < 1 or len(ranks) % size != 0:
        raise ValueError(f"post-forward groups of {size} ranks cannot tile {len(ranks)} ranks")
    local = dist.get_rank(parent)
    first = local - local % size
    members = ranks[first : first + size]
    config = str(dist.get_backend_config(parent))

    def create() -> dist.ProcessGroup:
        if _splits_communicators(parent):
            # Every rank of parent takes part once and lands in its own subgroup.
            _level_group_names([parent])
            process_group = dist.split_group(
                parent, split_ranks=[list(range(g, g + size)) for g in range(0, len(ranks), size)],
                timeout=timeout, group_desc=_describe("post_forward", timeout),
            )
            assert isinstance(process_group, dist.ProcessGroup)  # every rank is in one subgroup
            return process_group
        return _members_process_group(members, config, timeout, "post_forward", [parent])

    return _cached(_key(members, timeout, config, "post_forward"), create)


def timeout_process_group(
    parent: dist.ProcessGroup, timeout: timedelta | None, axis: str
) -> dist.ProcessGroup:
    """A group over ``parent``'s ranks with ``timeout``: ``parent`` itself when it has that
    timeout already (``None``: any), else one created from it (see the note above), once per
    (ranks, timeout, backend config, axis), cached in ``_registry.process_groups``. Collective over
    ``parent``'s ranks on its first call, and only theirs."""
    ranks = tuple(dist.get_process_group_ranks(parent))
    config = str(dist.get_backend_config(parent))

    def create() -> dist.ProcessGroup:
        if timeout is None or group_timeout(parent) == timeout:
            return parent
        if _splits_communicators(parent):
            _level_group_names([parent])
            process_group = dist.split_group(
                parent, split_ranks=[list(range(len(ranks)))], timeout=timeout,
                group_desc=_describe(axis, timeout),
            )
            assert isinstance(process_group, dist.ProcessGroup)  # every rank of parent is a member
            return process_group
        return _members_process_group(ranks, config, timeout, axis, [parent])

    return _cached(_key(ranks, timeout, config, axis), create)


def _splits_communicators(parent: dist.ProcessGroup) -> bool:
    """Whether torch creates new groups by splitting communicators: the default group is bound
    to a device and ``parent``'s backend for it can split (see the note above)."""
    world = dist.group.WORLD
    bound = getattr(world, "bound_device_id", None)
    if bound is None:
        return False
    try:
        return bool(backend_impl(parent, bound).supports_splitting)
    except (AttributeError, RuntimeError, ValueError):
        return False


def _members_process_group(
    ranks: tuple[int, ...], config: str, timeout: timedelta | None, axis: str,
    connecting: Sequence[dist.ProcessGroup],
) -> dist.ProcessGroup:
    """``new_group`` over ``ranks`` with ``timeout``; only the members take part when it is not
    the whole job (``use_local_synchronization``: then ``connecting``, groups that chain every
    member, level torch's names first; see [Note: group names before torch 2.14])."""
    covers_world = len(ranks) == dist.get_world_size()
    if not covers_world:
        _level_group_names(connecting)
    process_group = dist.new_group(
        list(ranks),
        timeout=timeout,
        backend=None if config == str(dist.get_backend_config()) else config,
        use_local_synchronization=not covers_world,
        group_desc=_describe(axis, timeout),
    )
    assert isinstance(process_group, dist.ProcessGroup)  # every caller is a member of the mesh
    return process_group


_Key = tuple[tuple[int, ...], float, str, str]


def _key(ranks: tuple[int, ...], timeout: timedelta | None, config: str, axis: str) -> _Key:
    return (ranks, -1.0 if timeout is None else timeout.total_seconds(), config, axis)


def _describe(axis: str, timeout: timedelta | None) -> str:
    seconds = -1.0 if timeout is None else timeout.total_seconds()
    return f"megatron_fsdp_v2 {axis} (timeout {seconds:g}s)"


def _cached(key: _Key, create: Callable[[], dist.ProcessGroup]) -> dist.ProcessGroup:
    process_group = _registry.process_groups.get(key)
    if process_group is None or not process_group_alive(process_group):
        process_group = _registry.process_groups[key] = create()
    return process_group


def clear_process_groups() -> None:
    """Forget the cached groups, so the next ``fully_shard`` creates fresh ones (tests: after a
    collective timed out, its group no longer matches across ranks and must not be reused)."""
    _registry.process_groups.clear()


def library_process_groups() -> list[dist.ProcessGroup]:
    """The distinct live process groups ``unit_process_group`` created in this process for the inner
    (``"shard"``) axis, the one every step collective but HSDP's outer ones runs on, and the
    whole-mesh (``"mesh"``) groups of HSDP with outer ``optim``: the groups gradient norms are
    all-reduced over (an outer-optim job has two, so ``clip_grad_norm_``'s fallback for an empty
    list does not apply to it). The same on every rank of a mesh, because every rank makes the
    same ``fully_shard`` calls."""
    groups: list[dist.ProcessGroup] = []
    for key, group in _registry.process_groups.items():
        if key[3] not in ("shard", "mesh"):
            continue
        if process_group_alive(group) and all(group is not g for g in groups):
            groups.append(group)
    return groups
