"""The library's process groups (issue 23, item 3; ``[Note: collective timeout]``): which group a
unit communicates on, which ranks take part in creating it, and how many are created.

* Sub-meshes of one job (pipeline stages: ranks {0,1} and {2,3} of a 2x2 mesh) wrap units with
  different timeouts in different orders: each stage creates its groups among its own ranks
  only, trains like single-process PyTorch, and the job can still create groups afterwards.
* A timeout the mesh's group already has creates nothing: the mesh's group is used.
* With a device-bound default group (``init_process_group(..., device_id=...)``) a group is split
  from the mesh's group (``dist.split_group``), never created with ``new_group`` (an
  ``ncclCommSplit`` of the whole job there). gloo cannot bind a device and torch's split needs
  one, so this case binds a CUDA device id to the gloo default group only while wrapping and
  replaces ``dist.split_group`` by a stand-in that records the call and creates the same group
  among the parent's ranks; ``dist.new_group`` raises meanwhile.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp_v2 import fully_shard

# private: forgets the cached library process groups between cases
from megatron_fsdp_v2._comm import _process_groups

# private: the timeout a process group was created with
from megatron_fsdp_v2._comm._backends import group_timeout

# private: the process group a unit communicates on
from megatron_fsdp_v2._registry import state_of

from _models import TinyGPT, agree, lm_loss, make_batches
from _pool import RankPools
from _training import train_against_reference

TIMEOUT_S = 180
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


def _stage_mesh() -> Any:
    """A 2x2 (pp, dp) mesh; this rank's data-parallel sub-mesh (its stage's two ranks). Forgets
    the library groups earlier cases on these ranks cached (a group is cached by ranks and
    timeout, not by mesh), so each case creates and counts its own."""
    _process_groups.clear_process_groups()
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"]


def _unit_group(module: torch.nn.Module) -> dist.ProcessGroup:
    state = state_of(module)
    assert state is not None
    return state.groups[0].process_group


def _train_and_compare(model: torch.nn.Module, ref: torch.nn.Module, pos: int, seed: int,
                       what: str) -> None:
    """Two SGD steps of the stage's two ranks against one process on their global batch."""
    train_against_reference(
        model, ref, lambda params: torch.optim.SGD(params, lr=0.1),
        make_batches("lm", steps=2, micro=1, world=2, per_rank=2, seed=seed), lm_loss,
        rank=pos, what=what, rtol=1e-5, atol=1e-6, mark=None, divide_by_micro=False)


def _stages_worker(rank: int, world: int) -> None:
    sub = _stage_mesh()
    stage, pos = divmod(rank, 2)
    # Different timeouts per stage, in different orders; two distinct values on each stage.
    first, second = (7.0, 9.0) if stage == 0 else (9.0, 11.0)
    if stage == 1:
        first, second = second, first
    torch.manual_seed(stage)
    model = TinyGPT(layers=2)
    ref = copy.deepcopy(model)
    fully_shard(model.blocks[0], mesh=sub, timeout=first)
    fully_shard(model.blocks[1], mesh=sub, timeout=second)
    fully_shard(model, mesh=sub, timeout=first)
    # Groups the units use, none of them the mesh's own (torch's group counter is no measure
    # across releases: before 2.14 members-only groups do not advance it).
    created = {_unit_group(m) for m in (model.blocks[0], model.blocks[1], model)}
    created.discard(sub.get_group())

    def check_groups() -> None:
        assert len(created) == 2, (f"rank {rank}: the units use {len(created)} new groups, "
                                   "expected one per timeout")
        stage_ranks = [int(r) for r in sub.mesh.tolist()]
        for module, seconds in ((model.blocks[0], first), (model.blocks[1], second),
                                (model, first)):
            group = _unit_group(module)
            assert dist.get_process_group_ranks(group) == stage_ranks
            assert group_timeout(group) == timedelta(seconds=seconds), group_timeout(group)
        assert _unit_group(model) is _unit_group(model.blocks[0])
    agree("groups", check_groups)
    _train_and_compare(model, ref, pos, seed=stage, what=f"stage {stage} parameters")
    # Both stages created the same number of groups, so torch's group names still agree and
    # a group over the whole job can be created (see the note on torch's group counter).
    everyone = dist.new_group(list(range(world)))
    flag = torch.ones(1)
    dist.all_reduce(flag, group=everyone)
    assert flag.item() == world


def _reuse_worker(rank: int, world: int) -> None:
    """The timeout the mesh's group has: that group, nothing created (1-D job mesh and a
    sub-mesh)."""
    sub = _stage_mesh()
    job_mesh = init_device_mesh("cpu", (world,))
    for mesh in (job_mesh, sub):
        timeout = group_timeout(mesh.get_group())
        assert timeout is not None
        before = dist.get_pg_count()
        unit = fully_shard(torch.nn.Linear(4, 4), mesh=mesh, timeout=timeout)
        created = dist.get_pg_count() - before
        agree(f"mesh of {mesh.size()} ranks, timeout {timeout}", lambda: _check(
            created == 0 and _unit_group(unit) is mesh.get_group(),
            f"created {created} groups; the unit's group is the mesh's: "
            f"{_unit_group(unit) is mesh.get_group()}"))
        unit(torch.ones(2, 4)).sum().backward()


def _bound_device_worker(rank: int, world: int) -> None:
    sub = _stage_mesh()
    default_group = dist.group.WORLD
    assert default_group is not None
    calls: list[tuple[dist.ProcessGroup, list[list[int]], timedelta | None]] = []
    real_new_group, real_split_group = dist.new_group, dist.split_group
    bound = torch.device("cuda", 0)

    def split_group(parent_pg: dist.ProcessGroup, split_ranks: list[list[int]],
                    timeout: timedelta | None = None, **_: Any) -> Any:
        calls.append((parent_pg, split_ranks, timeout))
        # NCCL's split gives a group over the parent's ranks, created by them alone.
        parent_ranks = dist.get_process_group_ranks(parent_pg)
        default_group.bound_device_id = None
        try:
            return real_new_group([parent_ranks[i] for i in split_ranks[0]], timeout=timeout,
                                  use_local_synchronization=True)
        finally:
            default_group.bound_device_id = bound

    def new_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
        # Before torch 2.14 the library first levels torch's group names with one-rank gloo
        # groups ([Note: group names before torch 2.14]): no communicator, nothing split.
        if ranks == [rank] and kwargs.get("backend") == "gloo":
            return real_new_group(ranks, **kwargs)
        raise AssertionError("new_group with a device-bound default group is an ncclCommSplit "
                             "of the whole job")

    stage = rank // 2
    seconds = 7.0 if stage == 0 else 9.0  # the stages differ
    torch.manual_seed(stage)
    model = TinyGPT(layers=1)
    ref = copy.deepcopy(model)
    dist.new_group, dist.split_group = new_group, split_group  # type: ignore[assignment]
    default_group.bound_device_id = bound
    try:
        fully_shard(model.blocks[0], mesh=sub, timeout=seconds)
        fully_shard(model, mesh=sub, timeout=seconds)
    finally:
        default_group.bound_device_id = None
        dist.new_group, dist.split_group = real_new_group, real_split_group  # type: ignore[assignment]

    def check_calls() -> None:
        assert len(calls) == 1, f"{len(calls)} split_group calls, expected one per timeout"
        parent, split_ranks, timeout = calls[0]
        assert parent is sub.get_group(), "not split from the mesh's group"
        assert split_ranks == [[0, 1]] and timeout == timedelta(seconds=seconds), calls[0]
        assert _unit_group(model) is _unit_group(model.blocks[0])
    agree("split from the mesh's group", check_calls)
    _train_and_compare(model, ref, rank % 2, seed=stage, what="parameters after the split")


def _check(ok: bool, message: str) -> None:
    assert ok, message


@pytest.mark.parametrize("worker", [_stages_worker, _reuse_worker, _bound_device_worker],
                         ids=["stages_different_timeouts", "reuse_mesh_group",
                              "bound_device_splits_mesh_group"])
def test_comm_groups(ranks: RankPools, worker: Any) -> None:
    ranks.run(worker, 4, timeout_s=TIMEOUT_S)
