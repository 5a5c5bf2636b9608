"""HSDP with ``outer_dp_sharding_strategy="optim"`` (inner ``optim_grads_params`` only): main
weights, gradients and optimizer state sharded over all R x S ranks.

Parity with the single-process reference on 2x2 and 2x3 meshes (uneven sub-shards), N in {1, 3}
marked micro-batches; the replicas' compute weights (the inner shards) bitwise equal after the
outer all-gather; the exact collective counts (inner 2N all-gathers + N reduce-scatters, one
outer reduce-scatter and one outer all-gather per group and iteration, one clipping all-reduce
over the whole mesh) and the group each ran on; ``memory_report`` against the 2-D ZeRO formula;
the window-carry cases; the errors. Cases of one world size share a pool of ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _hsdp_common import train_against_reference
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

# private: records each library collective and its group's ranks
import megatron_fsdp_v2._comm._collectives as collectives
from megatron_fsdp_v2 import (
    FSDPModule,
    MixedPrecisionPolicy,
    clip_grad_norm_,
    fully_shard,
    memory_report,
)
from megatron_fsdp_v2 import checkpoint as mckpt

# private: the units' parameter groups (outer optimizer-state layout)
from megatron_fsdp_v2._registry import state_of

from _comm_counts import CollectiveCounts
from _models import (
    TinyGPT,
    check_all_ranks,
    lm_loss,
    make_batches,
    reference_copy,
    shard_rows,
)
from _pool import RankPools

TIMEOUT_S = 280
OUTER = {"outer_dp_sharding_strategy": "optim"}


def hsdp_mesh(world: int, replicas: int) -> DeviceMesh:
    return init_device_mesh("cpu", (replicas, world // replicas),
                            mesh_dim_names=("replicate", "shard"))


def _groups(model: nn.Module) -> list:
    return [g for m in model.modules() if (s := state_of(m)) is not None for g in s.groups]


def _wrap(model: nn.Module, mesh: DeviceMesh, **kw) -> nn.Module:
    for block in model.blocks:
        fully_shard(block, mesh=mesh, sharding_strategy="optim_grads_params", **OUTER, **kw)
    return fully_shard(model, mesh=mesh, sharding_strategy="optim_grads_params", **OUTER, **kw)


def _assert_sub_shards_partition(model: nn.Module, what: str) -> None:
    """The R x S ranks' local rows of each parameter are disjoint and cover it."""
    mine = [shard_rows(p) for p in model.parameters()]
    everyone: list[list[tuple[int, int]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    ok = True
    for index, p in enumerate(model.parameters()):
        spans = sorted(r[index] for r in everyone if r is not None)
        covered = 0
        for lo, hi in spans:
            if hi > lo:
                ok &= lo == covered
                covered = hi
        ok &= covered == p.shape[0]
    check_all_ranks(ok, f"{what}: local rows do not partition the parameters")


def _assert_inner_shards_equal(model: nn.Module, mesh: DeviceMesh, what: str) -> None:
    """After the outer all-gather, every replica holds bitwise the same inner shard of the
    compute weights (``model_weight``)."""
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))  # gathers, so refreshes stale groups first
    outer = mesh.get_group(0)
    ok = True
    for group in _groups(model):
        local = group.model_weight.detach().clone()
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(outer))]
        dist.all_gather(gathered, local, group=outer)
        ok &= all(torch.equal(g, local) for g in gathered)
    check_all_ranks(ok, f"{what}: inner shards differ along the outer axis")


def train_outer_optim(rank: int, world: int, *, replicas: int, micro: int, steps: int = 4,
                      mark: bool | str = True, zero_grad: bool = True,
                      retain_graph: bool = False, rtol: float = 1e-5, atol: float = 1e-6,
                      mp: MixedPrecisionPolicy | None = None, overlap: bool = True) -> None:
    """Train on a (replicas, world // replicas) mesh with outer optim and compare with the
    single-process reference on the concatenated global batch (loss, clipping norm,
    parameters). ``mark``: True (the last micro-batch marked), False (unmarked: every backward
    is last), or "never" (every backward marked not-last: reduced late, by clip_grad_norm_)."""
    case = (f"outer optim mesh=({replicas},{world // replicas}) micro={micro} mark={mark} "
            f"zero_grad={zero_grad} retain_graph={retain_graph} mp={mp} overlap={overlap}")
    mesh = hsdp_mesh(world, replicas)
    torch.manual_seed(0)
    ref = TinyGPT()
    model = reference_copy(ref)
    kw: dict = {"overlap": overlap}
    if mp is not None:
        kw["mp_policy"] = mp
    model = _wrap(model, mesh, **kw)
    for p in model.parameters():
        assert p.placements == (Shard(0), Shard(0)) and p.device_mesh == mesh, p.placements
    _assert_sub_shards_partition(model, case)
    train_against_reference(
        model, ref, rank=rank, world=world, case=case, steps=steps, micro=micro, mark=mark,
        zero_grad=zero_grad, retain_graph=retain_graph, rtol=rtol, atol=atol,
    )
    _assert_inner_shards_equal(model, mesh, case)
    for group in _groups(model):
        assert group.allocator.live_bytes == 0, f"{case}: temporary buckets leaked"


# ---------------------------------------------------------------------- parity


def _parity_worker(rank: int, world: int, replicas: int) -> None:
    for micro in (1, 3):
        train_outer_optim(rank, world, replicas=replicas, micro=micro)


def test_parity_2x2(ranks: RankPools) -> None:
    ranks.run(_parity_worker, 4, 2, timeout_s=TIMEOUT_S)


def _variants_worker(rank: int, world: int) -> None:
    # Separate (float64) main weights: the refresh casts the main sub-shard into its slot of the
    # inner shard before the outer all-gather.
    train_outer_optim(rank, world, replicas=2, micro=2, steps=3,
                      mp=MixedPrecisionPolicy(main_params_dtype=torch.float64))
    # A reduction dtype other than the gradient dtype: the outer reduce-scatter runs through a
    # workspace in that dtype.
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float64)
    train_outer_optim(rank, world, replicas=2, micro=2, steps=3, mp=mp)
    train_outer_optim(rank, world, replicas=2, micro=2, steps=2, mp=mp, mark=False)
    # Every collective synchronous: same numbers.
    train_outer_optim(rank, world, replicas=2, micro=2, steps=2, overlap=False)


def test_mixed_dtypes_and_no_overlap(ranks: RankPools) -> None:
    ranks.run(_variants_worker, 4, timeout_s=TIMEOUT_S)


def _carry_worker(rank: int, world: int) -> None:
    # Every backward "last" (unmarked): the second micro-batch starts on reduced gradients.
    train_outer_optim(rank, world, replicas=2, micro=2, mark=False, steps=3)
    # No zero_grad between steps: every window starts on the previous step's gradients.
    train_outer_optim(rank, world, replicas=2, micro=2, zero_grad=False, steps=3)
    # A second backward over a retained graph adds to the reduced gradients.
    train_outer_optim(rank, world, replicas=2, micro=1, retain_graph=True, steps=2)
    # No backward marked last: the window is reduced late (by clipping), outer reduce-scatter
    # included; with zero_grad skipped, it starts on reduced values too.
    train_outer_optim(rank, world, replicas=2, micro=2, mark="never", steps=2, zero_grad=False)


def test_window_carry(ranks: RankPools) -> None:
    """Windows that start with globally reduced gradients in main_grad keep them, once."""
    ranks.run(_carry_worker, 4, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- collectives


def _count(comm: CollectiveCounts, *names: str) -> int:
    counts = comm.get_comm_counts()
    return sum(v for k, v in counts.items() if str(k).split(".")[-1].rstrip("_") in names)


def _counts_worker(rank: int, world: int) -> None:
    mesh = hsdp_mesh(world, 2)
    inner = tuple(dist.get_process_group_ranks(mesh.get_group(1)))
    outer = tuple(dist.get_process_group_ranks(mesh.get_group(0)))
    everyone = tuple(range(world))
    # (collective, ranks of its group) of each of the library's collectives.
    issued: list[tuple[str, tuple[int, ...]]] = []
    originals = {
        "all_gather_into": collectives.all_gather_into,
        "reduce_scatter_into": collectives.reduce_scatter_into,
        "all_reduce_inplace": collectives.all_reduce_inplace,
    }
    original_all_reduce = dist.all_reduce

    def recorder(name: str, fn, group_arg: int):  # type: ignore[no-untyped-def]
        def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
            issued.append((name, tuple(dist.get_process_group_ranks(args[group_arg]))))
            return fn(*args, **kwargs)
        return recording

    def clip_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None,  # type: ignore[no-untyped-def]
                        async_op=False):
        issued.append(("clip AR", tuple(dist.get_process_group_ranks(group))))
        return original_all_reduce(tensor, op=op, group=group, async_op=async_op)

    collectives.all_gather_into = recorder("AG", originals["all_gather_into"], 2)
    collectives.reduce_scatter_into = recorder("RS", originals["reduce_scatter_into"], 2)
    collectives.all_reduce_inplace = recorder("AR", originals["all_reduce_inplace"], 1)
    try:
        for micro in (1, 3):
            torch.manual_seed(0)
            model = _wrap(TinyGPT(layers=3), mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            batches = make_batches("lm", 3, micro, world, per_rank=2)
            observed = []
            for step in range(3):
                issued.clear()
                dist.all_reduce = clip_all_reduce  # the clipping all-reduce (utils.py)
                try:
                    with CollectiveCounts() as comm:
                        for i in range(micro):
                            model.set_is_last_backward(i == micro - 1)
                            (lm_loss(model, batches[step][i][rank]) / micro).backward()
                        clip_grad_norm_(model.parameters(), 1.0)
                        opt.step()
                        opt.zero_grad()
                finally:
                    dist.all_reduce = original_all_reduce
                observed.append((
                    _count(comm, "_allgather_base", "all_gather_into_tensor",
                           "allgather_into_tensor_coalesced"),
                    _count(comm, "_reduce_scatter_base", "reduce_scatter_tensor",
                           "reduce_scatter_tensor_coalesced"),
                    _count(comm, "allreduce", "all_reduce"),
                    sum(comm.get_comm_counts().values()),
                    sorted(issued),
                ))
            n = len(_groups(model))
            # Per group: inner 2N AG + N RS (ZeRO-3), 1 outer RS, 1 outer AG (the refresh of the
            # previous step's update); 1 clipping all-reduce over the whole mesh.
            library = sorted(
                [("AG", inner)] * (2 * micro * n) + [("RS", inner)] * (micro * n)
                + [("RS", outer)] * n + [("AG", outer)] * n + [("clip AR", everyone)]
            )
            steady = ((2 * micro + 1) * n, (micro + 1) * n, 1, (3 * micro + 2) * n + 1, library)
            for step, got in enumerate(observed[1:], start=1):
                assert got == steady, (
                    f"outer optim N={micro} iteration {step}: (AG, RS, AR, total, library "
                    f"collectives and groups) = {got}, expected {steady} for {n} groups"
                )
            # The first iteration has no refresh yet (nothing was updated).
            first = observed[0]
            assert first[0] == 2 * micro * n and first[1] == (micro + 1) * n, first
    finally:
        dist.all_reduce = original_all_reduce
        for name, fn in originals.items():
            setattr(collectives, name, fn)


def test_collective_counts(ranks: RankPools) -> None:
    ranks.run(_counts_worker, 4, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- memory


def _memory_worker(rank: int, world: int) -> None:
    """memory_report follows the 2-D ZeRO formula: model weights / S, main weights and grads
    / (R x S)."""
    replicas, shard = 2, world // 2
    mesh = hsdp_mesh(world, replicas)
    for mp in (None, MixedPrecisionPolicy(param_dtype=torch.bfloat16)):
        torch.manual_seed(0)
        model = TinyGPT(vocab=64, dim=32)
        content = sum(p.numel() for p in model.parameters())
        model = _wrap(model, mesh, **({"mp_policy": mp} if mp is not None else {}))
        lm_loss(model, make_batches("lm", 1, 1, world, 2)[0][0][rank]).backward()
        report = memory_report(model)
        groups = _groups(model)
        padding = sum(g.layout.padding_numel for g in groups)
        dtypes = groups[0].dtypes
        separate = dtypes.main != dtypes.model
        expect = (
            content * dtypes.model.itemsize / shard,
            content * dtypes.main.itemsize / (replicas * shard) if separate else 0,
            content * dtypes.grad.itemsize / (replicas * shard),
        )
        got = (report.model_weights, report.main_weights, report.main_grads)
        for role, g, e in zip(("model", "main", "grad"), got, expect):
            assert abs(g - e) <= padding * 8, f"{mp} {role}: {g} bytes, expected {e}"
        for group in groups:
            sub = group.layout.shard_numel
            assert group.model_weight.numel() == replicas * sub
            assert group.grads.main_grad_local().numel() == sub
            assert group.main_weight.numel() == sub


def test_memory_report_2d_formula(ranks: RankPools) -> None:
    ranks.run(_memory_worker, 4, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- errors


def _errors_worker(rank: int, world: int) -> None:
    named = hsdp_mesh(world, 2)

    def rejected(kind: type[Exception], pattern: str, **kw) -> None:
        module = nn.Linear(4, 4)
        groups_before = dist.distributed_c10d._world.group_count
        with CollectiveCounts() as comm:
            with pytest.raises(kind, match=pattern):
                fully_shard(module, **kw)
        assert not isinstance(module, FSDPModule)
        assert sum(comm.get_comm_counts().values()) == 0, comm.get_comm_counts()
        assert dist.distributed_c10d._world.group_count == groups_before, "a group was created"

    for strategy in ("no_shard", "optim", "optim_grads"):
        rejected(ValueError, r"outer_dp_sharding_strategy='optim' .* needs "
                 rf"sharding_strategy='optim_grads_params' .* got sharding_strategy='{strategy}'",
                 mesh=named, sharding_strategy=strategy, outer_dp_sharding_strategy="optim")
    # Checkpoints of outer-optim models work (tests/distributed/test_hsdp_checkpoint.py):
    # sharded state dicts need no collective and hold each rank's own sub-shard rows.
    model = fully_shard(nn.Linear(4, 6), mesh=named, **OUTER)
    assert model.weight.placements == (Shard(0), Shard(0))
    with CollectiveCounts() as comm:
        msd, _ = mckpt.get_state_dict(model)
        sd = model.state_dict()
    assert sum(comm.get_comm_counts().values()) == 0, comm.get_comm_counts()
    for value in (msd["weight"], sd["weight"]):
        lo, hi = shard_rows(model.weight)
        chunks = value.__create_chunk_list__()
        assert [tuple(c.offsets) for c in chunks] == ([(lo, 0)] if hi > lo else []), chunks
    full = mckpt.get_full_state_dict(model, rank0_only=False)
    assert full["weight"].shape == (6, 4)


def test_errors(ranks: RankPools) -> None:
    ranks.run(_errors_worker, 4, timeout_s=TIMEOUT_S)


# Last: the only world-6 case, so that the module starts one pool per world size.
def test_parity_2x3_uneven_sub_shards(ranks: RankPools) -> None:
    ranks.run(_parity_worker, 6, 2, timeout_s=TIMEOUT_S)
