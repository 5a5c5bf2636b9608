"""The rank pools release process groups (see [Note: rank pools] in
``megatron_fsdp_v2/testing/_pool.py``): ``release_process_groups`` leaves only the default group,
and the destroyed groups' gloo threads end even when DTensor's caches held meshes over them."""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from megatron_fsdp_v2.testing import RankPools, release_process_groups
from megatron_fsdp_v2.testing._pool import MAX_IDLE_PROCESS_GROUPS

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="counts threads by name in /proc")


def _gloo_transport_threads() -> int:
    """This process's gloo transport loops: one per live gloo group (the default one included)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == "gloo_tcp_loop"
        except OSError:  # the thread ended meanwhile
            pass
    return count


def _groups_besides_default() -> int:
    return len(dist.distributed_c10d._world.pg_map) - 1


def _make_groups(world: int, n: int, *, through_dtensor: bool) -> None:
    """``n`` new groups over every rank, each used once; with ``through_dtensor`` each is the
    group of a mesh that redistributes a DTensor (which fills DTensor's process-wide caches)."""
    for _ in range(n):
        group = dist.new_group(list(range(world)))
        if through_dtensor:
            mesh = DeviceMesh.from_group(group, "cpu")
            dtensor = distribute_tensor(torch.arange(8.0).view(4, 2), mesh, [Shard(0)])
            full = dtensor.redistribute(mesh, [Replicate()]).to_local()
            assert torch.equal(full, torch.arange(8.0).view(4, 2))
        else:
            dist.all_reduce(torch.ones(1), group=group)


def _release_worker(rank: int, world: int, through_dtensor: bool) -> dict[str, Any]:
    release_process_groups(more_than=0)  # start from the default group alone
    gc.collect()
    threads_before = _gloo_transport_threads()
    _make_groups(world, MAX_IDLE_PROCESS_GROUPS, through_dtensor=through_dtensor)
    kept = release_process_groups()  # not above the limit: nothing happens
    groups_kept = _groups_besides_default()
    threads_kept = _gloo_transport_threads()
    _make_groups(world, 1, through_dtensor=through_dtensor)
    released = release_process_groups()
    return dict(kept=kept, groups_kept=groups_kept, threads_kept=threads_kept - threads_before,
                released=released, groups_after=_groups_besides_default(),
                threads_after=_gloo_transport_threads() - threads_before)


@pytest.mark.parametrize("through_dtensor", [False, True], ids=["plain", "dtensor_caches"])
def test_release_process_groups_ends_their_threads(ranks: RankPools,
                                                   through_dtensor: bool) -> None:
    for result in ranks.run(_release_worker, 2, through_dtensor):
        assert not result["kept"] and result["groups_kept"] == MAX_IDLE_PROCESS_GROUPS
        assert result["threads_kept"] == MAX_IDLE_PROCESS_GROUPS, result
        assert result["released"] and result["groups_after"] == 0, result
        # Every destroyed group's transport thread has ended (with the DTensor case: the caches
        # that held the meshes were emptied).
        assert result["threads_after"] == 0, result
