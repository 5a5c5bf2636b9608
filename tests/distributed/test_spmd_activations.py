"""Activations on the SPMD mesh ``fully_shard`` registered (FSDP2's ``dp_mesh_dims`` with
tensor parallelism, torchtitan's ``full_dtensor`` backend) take DTensor's own path: a TP-only
redistribution of a batch-sharded activation issues no all-gather over dp and gives torch's
values, a ``copy_`` between two of them issues no collective, while parameters (and an
activation that shares a parameter's row count) still take the uneven path and give the
single-process values, and a tensor whose dp rows are not ``torch.chunk``'s though no parameter
has its size raises on every rank before any collective ([Note: deciding by tensor on a dp x TP
mesh] in ``megatron_fsdp_v2/_dtensor/_redistribute.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from megatron_fsdp_v2 import fully_shard

from _comm_counts import CollectiveCounts
from _models import SmallMLP, all_ranks_ok
from _pool import RankPools

DataParallelMeshDims = getattr(torch_fsdp, "DataParallelMeshDims", None)
pytestmark = pytest.mark.skipif(DataParallelMeshDims is None,
                                reason="torch.distributed.fsdp has no DataParallelMeshDims")

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


def test_activations_take_torch_path(ranks: RankPools) -> None:
    failures = [e for r in ranks.run(_worker, 4, timeout_s=TIMEOUT_S) for e in r]
    assert not failures, "\n".join(failures[:20])
