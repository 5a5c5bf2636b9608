"""DTensors that are not the library's, on a mesh ``fully_shard`` registered, take DTensor's
own path ([Note: deciding by tensor] in ``megatron_fsdp_v2/_dtensor/_redistribute.py``).

On a 1-D mesh: the user's ``distribute_tensor`` results (``full_tensor``, ``redistribute``,
``copy_``, an op against a replicated operand, ``nn.init.normal_``) issue DTensor's collectives
and no size exchange, and draw DTensor's own values, while parameters keep the uneven path.

On the SPMD mesh ``fully_shard`` registered (FSDP2's ``dp_mesh_dims`` with tensor parallelism,
torchtitan's ``full_dtensor`` backend), activations: a TP-only redistribution of a
batch-sharded activation issues no all-gather over dp and gives torch's values, a ``copy_``
between two of them issues no collective, while parameters (and an activation that shares a
parameter's row count) still take the uneven path and give the single-process values, and a
tensor whose dp rows are not ``torch.chunk``'s though no parameter has its size raises on every
rank before any collective."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

# private: _torch_patches.suspended(), torch alone on the same tensor, is the control for
# the DTensors the patches must leave to torch
from megatron_fsdp_v2 import _torch_patches, fully_shard

from _comm_counts import CollectiveCounts
from _models import SmallMLP, all_ranks_ok
from _pool import RankPools

DataParallelMeshDims = getattr(torch_fsdp, "DataParallelMeshDims", None)
needs_dp_mesh_dims = pytest.mark.skipif(
    DataParallelMeshDims is None, reason="torch.distributed.fsdp has no DataParallelMeshDims")

TIMEOUT_S = 240


def _distribute(model: SmallMLP, mesh: DeviceMesh) -> SmallMLP:
    """Every parameter a DTensor on ``mesh``, ``Replicate()`` over ``dp``, ``a`` colwise and
    ``b`` rowwise over ``tp`` (as ``test_dp_mesh_dims_tp.py``)."""
    for layer, tp_weight, tp_bias in ((model.a, Shard(0), Shard(0)),
                                      (model.b, Shard(1), Replicate())):
        for pname, tp in (("weight", tp_weight), ("bias", tp_bias)):
            value = distribute_tensor(getattr(layer, pname).detach(), mesh, [Replicate(), tp])
            layer.register_parameter(pname, nn.Parameter(value))
    return model


def _counts(comm: CollectiveCounts) -> dict[str, int]:
    return {str(op): n for op, n in comm.get_comm_counts().items()}


def _all_gathers(counts: dict[str, int]) -> int:
    return sum(n for op, n in counts.items() if "gather" in op)


def _worker(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_local_rank(0), mesh.get_local_rank(1)
    torch.manual_seed(0)
    base = SmallMLP()  # a: 7 x 5, b: 3 x 7: registered row counts {7, 3}
    model = copy.deepcopy(base)
    fully_shard(_distribute(model, mesh), mesh=mesh,
                dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    assert model.b.weight.device_mesh == mesh  # the activations' mesh is the registered one
    errors: list[str] = []
    g = torch.Generator().manual_seed(1)
    for rows in (5, 4):  # 5: torch.chunk's own uneven rows (3, 2)
        full = torch.randn(rows, 6, generator=g)
        x = distribute_tensor(full, mesh, [Shard(0), Shard(1)])  # batch over dp, sequence over tp
        with CollectiveCounts() as comm:
            y = x.redistribute(mesh, [Shard(0), Replicate()])  # sequence-parallel all-gather
        counts = _counts(comm)
        if _all_gathers(counts) != 1:  # the TP one only
            errors.append(f"{rows} rows: TP-only all-gather issued {counts}")
        if not torch.equal(y.to_local(), full.chunk(2)[dp_rank]):
            errors.append(f"{rows} rows: TP-only redistribution values differ from torch's")
        partial = DTensor.from_local(y.to_local() * (tp_rank + 1), mesh, [Shard(0), Partial()],
                                     shape=y.shape, stride=y.stride())
        with CollectiveCounts() as comm:
            z = partial.redistribute(mesh, [Shard(0), Shard(1)])  # reduce-scatter over tp
        counts = _counts(comm)
        if _all_gathers(counts) != 0:
            errors.append(f"{rows} rows: Partial -> Shard over tp issued {counts}")
        if not torch.equal(z.to_local(), x.to_local() * 3):
            errors.append(f"{rows} rows: Partial -> Shard values differ from torch's")
        other = distribute_tensor(full * 2, mesh, [Shard(0), Replicate()])
        with CollectiveCounts() as comm:
            y.copy_(other)
        if comm.get_total_counts():
            errors.append(f"{rows} rows: copy_ between activations issued {_counts(comm)}")
        if not torch.equal(y.full_tensor(), full * 2):
            errors.append(f"{rows} rows: copy_ between activations gave wrong values")
    # An activation with a parameter's row count (3, b.weight's) takes the uneven path: right.
    full = torch.randn(3, 6, generator=g)
    y = distribute_tensor(full, mesh, [Shard(0), Shard(1)]).redistribute(
        mesh, [Shard(0), Replicate()])
    if not torch.equal(y.full_tensor(), full):
        errors.append("an activation of a parameter's row count: wrong values")
    # Parameters still take the uneven path: single-process values.
    for name, p in model.named_parameters():
        want = base.get_parameter(name).detach()
        if not torch.equal(p.redistribute(mesh, [Replicate(), Replicate()]).to_local(), want):
            errors.append(f"{name}: redistribute to Replicate differs from the module's value")
        tp_only = [p.placements[0], Replicate()]
        if type(p.placements[0]) is not Shard:
            # a's: _StridedShard over dp (TP shards dim 0 too). Keeping it while TP replicates
            # would mean torch's strided rows, which torch gathers wrongly for uneven sizes:
            # refused on every rank, before any collective (it gave reordered rows, silently).
            with CollectiveCounts() as comm:
                try:
                    p.redistribute(mesh, tp_only)
                    errors.append(f"{name}: TP-only redistribution of a strided shard: no error")
                except NotImplementedError as err:
                    if "_StridedShard" not in str(err):
                        errors.append(f"{name}: unclear refusal: {err}")
            if comm.get_total_counts():
                errors.append(f"{name}: collectives before the refusal: {comm.get_comm_counts()}")
            continue
        if not torch.equal(p.redistribute(mesh, tp_only).full_tensor(), want):
            errors.append(f"{name}: TP-only redistribution differs from the module's value")
    # dp rows 4 and 1 of 5 (torch.chunk: 3 and 2), a size no parameter has: every rank raises.
    local = torch.randn(4 if dp_rank == 0 else 1, 3)
    bad = DTensor.from_local(local, mesh, [Shard(0), Shard(1)], run_check=False,
                             shape=torch.Size((5, 6)), stride=(6, 1))
    with CollectiveCounts() as comm:
        try:
            bad.redistribute(mesh, [Shard(0), Replicate()])
            errors.append("rows that are not torch.chunk's were redistributed by torch")
        except NotImplementedError as e:
            if "torch.chunk" not in str(e):
                errors.append(f"unexpected message: {e}")
    if comm.get_total_counts():
        errors.append(f"the refusal issued collectives {_counts(comm)}")
    if not all_ranks_ok(not errors):
        errors = errors or ["failed on another rank"]
    return [f"rank {rank}: {e}" for e in errors]


@needs_dp_mesh_dims
def test_activations_take_torch_path(ranks: RankPools) -> None:
    failures = [e for r in ranks.run(_worker, 4, timeout_s=TIMEOUT_S) for e in r]
    assert not failures, "\n".join(failures[:20])


def _normal(x: DTensor) -> torch.Tensor:
    torch.manual_seed(3)
    nn.init.normal_(x)
    return x.to_local()


def _one_d_worker(rank: int, world: int) -> list[str]:
    """A 1-D mesh of 3 ranks (7 rows: ours (3, 3, 1) or similar, torch.chunk's (3, 3, 1) too,
    so a 5-row tensor (2, 2, 1) and an 8-row one (3, 3, 2) are the user's)."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    base = SmallMLP()  # a: 7 x 5, b: 3 x 7: registered row counts {7, 3}
    model = copy.deepcopy(base)
    fully_shard(model, mesh=mesh)
    errors: list[str] = []
    g = torch.Generator().manual_seed(1)
    for rows in (5, 8):
        full = torch.randn(rows, 6, generator=g)
        x = distribute_tensor(full, mesh, [Shard(0)])
        with CollectiveCounts() as comm:
            gathered = x.full_tensor()
        if _all_gathers(_counts(comm)) != 1 or comm.get_total_counts() != 1:
            errors.append(f"{rows} rows: full_tensor issued {_counts(comm)}, want DTensor's one")
        if not torch.equal(gathered, full):
            errors.append(f"{rows} rows: full_tensor values differ")
        with CollectiveCounts() as comm:
            moved = x.redistribute(mesh, [Shard(1)])
        if comm.get_total_counts() != 1:  # DTensor's all-to-all
            errors.append(f"{rows} rows: Shard(0) -> Shard(1) issued {_counts(comm)}")
        if not torch.equal(moved.full_tensor(), full):
            errors.append(f"{rows} rows: Shard(0) -> Shard(1) values differ")
        other = distribute_tensor(full * 2, mesh, [Shard(0)])
        with CollectiveCounts() as comm:
            x.copy_(other)
        if comm.get_total_counts():
            errors.append(f"{rows} rows: copy_ between the user's DTensors issued {_counts(comm)}")
        for placements in ([Shard(0)], [Replicate()]):  # nn.init: DTensor's own draw
            y = distribute_tensor(torch.zeros(rows, 6), mesh, placements)
            with CollectiveCounts() as comm:
                drawn = _normal(y).clone()
            with _torch_patches.suspended():
                want = _normal(y)
            if comm.get_total_counts() or not torch.equal(drawn, want):
                errors.append(f"{rows} rows {placements}: nn.init.normal_ issued "
                              f"{_counts(comm)}, or drew other values than DTensor's own")
        ones = distribute_tensor(torch.ones(rows, 6), mesh, [Replicate()])
        with CollectiveCounts() as comm:
            summed = x + ones  # the replicated operand cut at torch.chunk rows, locally
        if comm.get_total_counts():
            errors.append(f"{rows} rows: x + replicated issued {_counts(comm)}")
        if not torch.equal(summed.full_tensor(), full * 2 + 1):
            errors.append(f"{rows} rows: x + replicated values differ")
    # An empty torch.chunk shard's infinity norm is torch's (its error, on that rank only);
    # a parameter's, ours (0 stands in: the true max over the ranks).
    x = distribute_tensor(torch.ones(2, 6), mesh, [Shard(0)])
    try:
        (norm,) = torch._foreach_norm([x], float("inf"))
        if x.to_local().numel() == 0:
            errors.append("the user's empty shard: the infinity norm did not raise (torch's)")
    except RuntimeError as e:
        if x.to_local().numel() or "infinity norm" not in str(e):
            errors.append(f"the user's shard: {e}")
    for name, p in model.named_parameters():
        (norm,) = torch._foreach_norm([p], float("inf"))
        if norm.full_tensor() != base.get_parameter(name).detach().abs().max():
            errors.append(f"{name}: infinity norm differs from the module's")
    # Parameters (and what keeps their row count) still take the uneven path: right values.
    for name, p in model.named_parameters():
        want = base.get_parameter(name).detach()
        if not torch.equal(p.full_tensor(), want):
            errors.append(f"{name}: full_tensor differs from the module's value")
        if not torch.equal((p * 2).redistribute(mesh, [Replicate()]).to_local(), want * 2):
            errors.append(f"{name}: (p * 2) redistributed differs")
    if not all_ranks_ok(not errors):
        errors = errors or ["failed on another rank"]
    return [f"rank {rank}: {e}" for e in errors]


def test_one_d_mesh_decides_by_tensor(ranks: RankPools) -> None:
    """On a 1-D mesh too, only DTensors whose sharded size a parameter has take the uneven
    path; the user's issue DTensor's own collectives (before: one size all-gather more each)."""
    failures = [e for r in ranks.run(_one_d_worker, 3, timeout_s=TIMEOUT_S) for e in r]
    assert not failures, "\n".join(failures[:20])
