"""HSDP: a 2-D mesh (dim 0 the outer replicate axis, dim 1 the inner shard axis) with
``outer_dp_sharding_strategy="no_shard"``.

Parity with the single-process reference for every inner strategy on 2x2 and 2x3 meshes
(uneven inner shards), the exact collective counts (the 1-D table plus one outer all-reduce per
group and iteration, on the outer group), the window-carry cases (unmarked micro-batch loops, no
``zero_grad`` between steps, a second backward over a retained graph), replicas that start
different, and the errors. Cases of one world size share a pool of ranks (``_pool.RankPools``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _hsdp_common import train_against_reference
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

# private: records the outer all-reduces the library issues (collectives.all_reduce_inplace)
import megatron_fsdp_v2._comm._collectives as collectives
from megatron_fsdp_v2 import (
    FSDPModule,
    MixedPrecisionPolicy,
    clip_grad_norm_,
    fully_shard,
    memory_report,
)
from megatron_fsdp_v2 import checkpoint as mckpt

# private: the units' parameter groups (inner and outer layout)
from megatron_fsdp_v2._registry import state_of

from _comm_counts import CollectiveCounts
from _models import (
    TinyGPT,
    assert_close_to_reference,
    check_all_ranks,
    lm_loss,
    make_batches,
    reference_copy,
    wrap_blocks,
)
from _pool import RankPools

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TIMEOUT_S = 280


def hsdp_mesh(world: int, replicas: int) -> DeviceMesh:
    return init_device_mesh("cpu", (replicas, world // replicas),
                            mesh_dim_names=("replicate", "shard"))


def _groups(model: nn.Module) -> list:
    return [g for m in model.modules() if (s := state_of(m)) is not None for g in s.groups]


def _assert_replicas_equal(model: nn.Module, mesh: DeviceMesh, what: str) -> None:
    """Optimizer-facing shards are bitwise equal across the outer (replicate) axis."""
    outer = mesh.get_group(0)
    ok = True
    for p in model.parameters():
        local = p.to_local().detach().contiguous()
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(outer))]
        dist.all_gather(gathered, local, group=outer)
        ok &= all(torch.equal(g, local) for g in gathered)
    check_all_ranks(ok, f"{what}: replicas differ along the outer axis")


def train_hsdp(rank: int, world: int, *, replicas: int, strategy: str, micro: int,
               steps: int = 4, mark: bool | str = True, zero_grad: bool = True,
               retain_graph: bool = False, model_seed: int | None = 0, rtol: float = 1e-5,
               atol: float = 1e-6, mp: MixedPrecisionPolicy | None = None) -> None:
    """Train on a (replicas, world // replicas) mesh and compare with the single-process
    reference on the concatenated global batch (loss, clipping norm, parameters).
    ``mark``: True (the last micro-batch marked), False (unmarked: every backward is last), or
    "never" (every backward marked not-last: reduced late, by clip_grad_norm_)."""
    case = (f"{strategy} mesh=({replicas},{world // replicas}) micro={micro} mark={mark} "
            f"zero_grad={zero_grad} retain_graph={retain_graph} model_seed={model_seed} mp={mp}")
    mesh = hsdp_mesh(world, replicas)
    if model_seed is None:
        # Every rank builds different weights; sync_module_states gives all rank 0's.
        torch.manual_seed(1000)
        ref = TinyGPT()
        torch.manual_seed(1000 + rank)
        model = TinyGPT()
    else:
        torch.manual_seed(model_seed)
        ref = TinyGPT()
        model = reference_copy(ref)
    model = wrap_blocks(model, mesh=mesh, strategy=strategy,
                        **({"mp_policy": mp} if mp is not None else {}))
    for p in model.parameters():
        expected = (Replicate(), Replicate() if strategy == "no_shard" else Shard(0))
        assert p.placements == expected and p.device_mesh == mesh, (p.placements, expected)
    train_against_reference(
        model, ref, rank=rank, world=world, case=case, steps=steps, micro=micro, mark=mark,
        zero_grad=zero_grad, retain_graph=retain_graph, rtol=rtol, atol=atol,
    )
    _assert_replicas_equal(model, mesh, case)
    for group in _groups(model):
        assert group.allocator.live_bytes == 0, f"{case}: temporary buckets leaked"


# ---------------------------------------------------------------------- parity


def _parity_worker(rank: int, world: int, replicas: int, strategy: str) -> None:
    for micro in (1, 3):
        train_hsdp(rank, world, replicas=replicas, strategy=strategy, micro=micro)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity_2x2(ranks: RankPools, strategy: str) -> None:
    """Every inner strategy with outer no_shard, N in {1, 3} marked micro-batches."""
    ranks.run(_parity_worker, 4, 2, strategy, timeout_s=TIMEOUT_S)


def _carry_worker(rank: int, world: int, strategy: str) -> None:
    # Every backward "last" (unmarked): the second micro-batch starts on reduced gradients.
    train_hsdp(rank, world, replicas=2, strategy=strategy, micro=2, mark=False, steps=3)
    # No zero_grad between steps: every window starts on the previous step's gradients.
    train_hsdp(rank, world, replicas=2, strategy=strategy, micro=2, zero_grad=False, steps=3)
    # A second backward over a retained graph adds to the reduced gradients.
    train_hsdp(rank, world, replicas=2, strategy=strategy, micro=1, retain_graph=True, steps=2)
    # No backward marked last: the window is reduced late (GroupGrads.finalize, by clipping),
    # outer all-reduce included; with zero_grad skipped, it starts on reduced values too.
    train_hsdp(rank, world, replicas=2, strategy=strategy, micro=2, mark="never", steps=2,
               zero_grad=False)


def _comm_dtype_worker(rank: int, world: int, strategy: str) -> None:
    # A reduction dtype other than the gradient dtype: the outer all-reduce runs through a
    # workspace in that dtype (float64 here, so the numbers still match fp32 tightly).
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float64)
    train_hsdp(rank, world, replicas=2, strategy=strategy, micro=2, steps=3, mp=mp)
    train_hsdp(rank, world, replicas=2, strategy=strategy, micro=2, steps=2, mp=mp, mark=False)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reduce_dtype_workspace(ranks: RankPools, strategy: str) -> None:
    ranks.run(_comm_dtype_worker, 4, strategy, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_window_carry(ranks: RankPools, strategy: str) -> None:
    """Windows that start with globally reduced gradients in main_grad are not all-reduced
    again over the outer axis (which would count them R times)."""
    ranks.run(_carry_worker, 4, strategy, timeout_s=TIMEOUT_S)


def _different_start_worker(rank: int, world: int, strategy: str) -> None:
    mesh = hsdp_mesh(world, 2)
    # Parameters and buffers start from mesh rank (0, 0)'s values on every rank.
    torch.manual_seed(1000 + rank)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    model.register_buffer("stat", torch.full((4,), float(rank)))
    torch.manual_seed(1000)
    rank0 = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    fully_shard(model, mesh=mesh, sharding_strategy=strategy)
    assert torch.equal(model.stat, torch.zeros(4)), model.stat
    assert_close_to_reference(model, rank0, rtol=0, atol=0)
    # And training from different seeds matches the reference built from rank 0's seed.
    train_hsdp(rank, world, replicas=2, strategy=strategy, micro=2, steps=2, model_seed=None)


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_replicas_start_from_rank0(ranks: RankPools, strategy: str) -> None:
    ranks.run(_different_start_worker, 4, strategy, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- collectives


def _count(comm: CollectiveCounts, *names: str) -> int:
    counts = comm.get_comm_counts()
    return sum(v for k, v in counts.items() if str(k).split(".")[-1].rstrip("_") in names)


def _expected_inner(strategy: str, micro: int) -> tuple[int, int, int]:
    """design.md §4: (all-gathers, reduce-scatters, all-reduces) per group per iteration."""
    return {
        "no_shard": (0, 0, 1),
        "optim": (1, 1, 0),
        "optim_grads": (1, micro, 0),
        "optim_grads_params": (2 * micro, micro, 0),
    }[strategy]


def _counts_worker(rank: int, world: int, strategy: str) -> None:
    mesh = hsdp_mesh(world, 2)
    inner_ranks = tuple(dist.get_process_group_ranks(mesh.get_group(1)))
    outer_ranks = tuple(dist.get_process_group_ranks(mesh.get_group(0)))
    # Which ranks each of the library's all-reduces ran over.
    all_reduce_ranks: list[tuple[int, ...]] = []
    original = collectives.all_reduce_inplace

    def recording(buffer, group, async_op=False, **kwargs):  # type: ignore[no-untyped-def]
        all_reduce_ranks.append(tuple(dist.get_process_group_ranks(group)))
        return original(buffer, group, async_op, **kwargs)

    collectives.all_reduce_inplace = recording
    try:
        for micro in (1, 3):
            torch.manual_seed(0)
            model = wrap_blocks(TinyGPT(layers=3), mesh=mesh, strategy=strategy)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            batches = make_batches("lm", 3, micro, world, per_rank=2)
            observed = []
            for step in range(3):
                all_reduce_ranks.clear()
                with CollectiveCounts() as comm:
                    for i in range(micro):
                        model.set_is_last_backward(i == micro - 1)
                        (lm_loss(model, batches[step][i][rank]) / micro).backward()
                    clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad()
                observed.append((
                    _count(comm, "_allgather_base", "all_gather_into_tensor",
                           "allgather_into_tensor_coalesced"),
                    _count(comm, "_reduce_scatter_base", "reduce_scatter_tensor",
                           "reduce_scatter_tensor_coalesced"),
                    _count(comm, "allreduce", "all_reduce"),
                    sum(comm.get_comm_counts().values()),
                    sorted(all_reduce_ranks),
                ))
            n = len(_groups(model))
            ag, rs, ar = _expected_inner(strategy, micro)
            clip = 0 if strategy == "no_shard" else 1  # sharded norms: one inner all-reduce
            outer = n  # one outer all-reduce per group per iteration
            library_ar = sorted([inner_ranks] * (ar * n) + [outer_ranks] * outer)
            steady = (ag * n, rs * n, ar * n + outer + clip,
                      ag * n + rs * n + ar * n + outer + clip, library_ar)
            for step, got in enumerate(observed[1:], start=1):
                assert got == steady, (
                    f"{strategy} N={micro} iteration {step}: (AG, RS, AR, total, library "
                    f"all-reduce groups) = {got}, expected {steady} for {n} groups"
                )
    finally:
        collectives.all_reduce_inplace = original


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_collective_counts(ranks: RankPools, strategy: str) -> None:
    ranks.run(_counts_worker, 4, strategy, timeout_s=TIMEOUT_S)


def _debug_order_worker(rank: int, world: int) -> None:
    mesh = hsdp_mesh(world, 2)
    outer_ranks = tuple(dist.get_process_group_ranks(mesh.get_group(0)))
    checked: list[tuple[tuple[int, ...], str]] = []
    original = collectives.check_collective_order

    def recording(group, description, device):  # type: ignore[no-untyped-def]
        checked.append((tuple(dist.get_process_group_ranks(group)), description))
        return original(group, description, device)

    os.environ["MFSDP_DEBUG_COLLECTIVES"] = "1"
    collectives.check_collective_order = recording
    try:
        torch.manual_seed(0)
        model = wrap_blocks(TinyGPT(), mesh=mesh, strategy="optim_grads")
        lm_loss(model, make_batches("lm", 1, 1, world, 2)[0][0][rank]).backward()
    finally:
        del os.environ["MFSDP_DEBUG_COLLECTIVES"]
        collectives.check_collective_order = original
    outer_checks = [d for ranks_, d in checked if ranks_ == outer_ranks]
    assert len(outer_checks) == len(_groups(model)), checked
    assert all(d.startswith("outer all-reduce of ") for d in outer_checks), outer_checks


def test_debug_order_check_covers_outer_all_reduce(ranks: RankPools) -> None:
    ranks.run(_debug_order_worker, 4, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- memory


def _memory_worker(rank: int, world: int) -> None:
    """memory_report follows the 1-D ZeRO formula with D = the inner axis size."""
    mesh = hsdp_mesh(world, 2)
    shard = world // 2
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        model = TinyGPT(vocab=64, dim=32)
        content = sum(p.numel() for p in model.parameters())
        model = wrap_blocks(model, mesh=mesh, strategy=strategy)
        lm_loss(model, make_batches("lm", 1, 1, world, 2)[0][0][rank]).backward()
        report = memory_report(model)
        padding = sum(g.layout.padding_numel for g in _groups(model))
        full = content * 4
        expect = {
            "no_shard": (full, 0, full),
            "optim": (full, 0, full),
            "optim_grads": (full, 0, full / shard),
            "optim_grads_params": (full / shard, 0, full / shard),
        }[strategy]
        got = (report.model_weights, report.main_weights, report.main_grads)
        for role, g, e in zip(("model", "main", "grad"), got, expect):
            assert abs(g - e) <= padding * 4, f"{strategy} {role}: {g} bytes, expected {e}"


def test_memory_report_uses_inner_axis(ranks: RankPools) -> None:
    ranks.run(_memory_worker, 4, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- errors


def _errors_worker(rank: int, world: int) -> None:
    named = hsdp_mesh(world, 2)
    unnamed = init_device_mesh("cpu", (2, world // 2))
    three_d = init_device_mesh("cpu", (1, 2, world // 2), mesh_dim_names=("a", "b", "c"))
    flat = init_device_mesh("cpu", (world,))

    def rejected(kind: type[Exception], pattern: str, **kw) -> None:
        module = nn.Linear(4, 4)
        groups_before = dist.distributed_c10d._world.group_count
        with CollectiveCounts() as comm:
            with pytest.raises(kind, match=pattern):
                fully_shard(module, **kw)
        assert not isinstance(module, FSDPModule)
        assert sum(comm.get_comm_counts().values()) == 0, comm.get_comm_counts()
        assert dist.distributed_c10d._world.group_count == groups_before, "a group was created"

    # Outer optim needs inner optim_grads_params (test_hsdp_outer_optim.py covers it).
    rejected(ValueError, r"outer_dp_sharding_strategy='optim' .* needs "
             r"sharding_strategy='optim_grads_params' .* got sharding_strategy='optim'",
             mesh=named, sharding_strategy="optim", outer_dp_sharding_strategy="optim")
    rejected(ValueError, r"outer_dp_sharding_strategy must be 'no_shard' or 'optim', got "
             r"'optim_grads'", mesh=named, outer_dp_sharding_strategy="optim_grads")
    rejected(ValueError, r"unknown sharding_strategy 'bogus'", mesh=named,
             outer_dp_sharding_strategy="bogus")
    rejected(ValueError, r"outer_dp_sharding_strategy='optim' needs a 2-D mesh \(HSDP\), got "
             r"a 1-D mesh", mesh=flat, outer_dp_sharding_strategy="optim")
    rejected(ValueError, r"needs a 2-D mesh \(HSDP\), got the default \(1-D\) mesh",
             outer_dp_sharding_strategy="optim")
    rejected(ValueError, r"a 2-D mesh \(HSDP\) needs dimension names", mesh=unnamed)
    rejected(ValueError, r"mesh must be 1-D .* or 2-D .* got a 3-D mesh", mesh=three_d)
    # The cross-rank check covers the whole mesh: a difference on the last rank only (another
    # inner group and another outer group than rank 0's) makes every rank raise.
    odd = nn.Linear(4, 5 if rank == world - 1 else 4)
    with pytest.raises(ValueError, match=r"ranks disagree on what fully_shard wraps"):
        fully_shard(odd, mesh=named)
    bad = nn.Linear(4, 4)
    if rank == world - 1:
        bad.extra = nn.Parameter(torch.zeros(()))  # 0-dim: rejected on this rank only
    with pytest.raises(ValueError, match=r"parameter 'extra' is 0-dimensional.*raised on rank"):
        fully_shard(bad, mesh=named)
    # Names other than ("replicate", "shard") are taken by position.
    other = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_rep", "dp_shard"))
    model = fully_shard(nn.Linear(4, 6), mesh=other, sharding_strategy="optim")
    assert model.weight.placements == (Replicate(), Shard(0))
    # Checkpoints of outer no_shard HSDP models work (tests/distributed/test_hsdp_checkpoint.py):
    # no collective for a sharded state dict, (Replicate(), Shard(0)) DTensors.
    with CollectiveCounts() as comm:
        msd, _ = mckpt.get_state_dict(model)
    assert sum(comm.get_comm_counts().values()) == 0, comm.get_comm_counts()
    assert msd["weight"].placements == (Replicate(), Shard(0))


def test_errors(ranks: RankPools) -> None:
    ranks.run(_errors_worker, 4, timeout_s=TIMEOUT_S)


# Last: the only world-6 cases, so that the module starts one pool per world size.
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity_2x3_uneven_inner_shards(ranks: RankPools, strategy: str) -> None:
    ranks.run(_parity_worker, 6, 2, strategy, timeout_s=TIMEOUT_S)
