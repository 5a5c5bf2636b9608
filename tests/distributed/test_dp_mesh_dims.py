"""FSDP2's ``dp_mesh_dims`` and ``shard_placement_fn`` arguments (see [Note: SPMD meshes and
dp_mesh_dims] in ``megatron_fsdp_v2/_frontend/_mesh.py`` and [Note: FSDP2 arguments]).

An SPMD mesh with ``dp_mesh_dims`` trains like the data-parallel mesh it names, passed as
``mesh=`` (same losses and parameters as single-process training, the same DTensor mesh shape
and placements): shard dims only (1-D), several shard dims (flattened, as FSDP2), replicate and
shard dims (2-D HSDP). ``shard_placement_fn`` returning ``Shard(0)`` or ``None`` is accepted;
the rest is refused, each case with its error named.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron_fsdp_v2 import fully_shard

from _models import SmallMLP, all_ranks_ok
from _pool import RankPools
from _training import train_steps

# torch.distributed.fsdp.DataParallelMeshDims is not in torch 2.11 (2.12 has it; the
# supported range starts at 2.11): fully_shard's dp_mesh_dims cannot be given there.
DataParallelMeshDims = getattr(torch_fsdp, "DataParallelMeshDims", None)
pytestmark = pytest.mark.skipif(DataParallelMeshDims is None,
                                reason="torch.distributed.fsdp has no DataParallelMeshDims")

TIMEOUT_S = 240


def _global_mean_losses(model: nn.Module, rank: int, world: int,
                        single: bool = False) -> list[float]:
    """Two SGD steps on a global batch of ``2 * world`` rows: this rank's rows, or all of them
    (``single``: the single-process reference). Returns the global mean loss per step."""
    g = torch.Generator().manual_seed(1)
    steps = [[(torch.randn(2 * world, 5, generator=g), torch.randn(2 * world, 3, generator=g))]
             for _ in range(2)]

    def rows(batch: tuple[torch.Tensor, torch.Tensor], rank: int | None) -> Any:
        mine = slice(None) if rank is None else slice(2 * rank, 2 * rank + 2)
        return batch[0][mine], batch[1][mine]

    per_step = train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), steps,
                           lambda m, b: F.mse_loss(m(b[0]), b[1]),
                           rank=None if single else rank, select=rows, mark=None,
                           divide_by_micro=False)
    losses = []
    for (mean,) in per_step:
        if not single:
            dist.all_reduce(mean)
            mean /= world
        losses.append(float(mean))
    return losses


# (mesh shape, dim names, DataParallelMeshDims kwargs, the equivalent data-parallel mesh names)
MESHES = {
    "shard": ((2, 1), ("dp_shard", "tp"), dict(shard="dp_shard"), ("dp_shard",)),
    "flattened": ((2, 2), ("dp_shard", "cp"), dict(shard=("dp_shard", "cp")), None),
    "hsdp": ((2, 2), ("dp_replicate", "dp_shard"),
             dict(shard="dp_shard", replicate="dp_replicate"), ("dp_replicate", "dp_shard")),
}


def _parity_worker(rank: int, world: int, case: str, strategy: str) -> list[str]:
    shape, names, dims, equivalent = MESHES[case]
    spmd = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    base = SmallMLP()
    model, ref, twin = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    errors = []
    fully_shard(model, mesh=spmd, dp_mesh_dims=DataParallelMeshDims(**dims),
                sharding_strategy=strategy, shard_placement_fn=lambda p: Shard(0))
    want_losses = _global_mean_losses(ref, rank, world, single=True)
    losses = _global_mean_losses(model, rank, world)
    if not torch.allclose(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5):
        errors.append(f"losses {losses} vs single process {want_losses}")
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if not torch.allclose(p.full_tensor(), ref_params[name].detach(), rtol=1e-5, atol=1e-6):
            errors.append(f"parameter {name} differs from single-process training")
    # The same mesh and placements as passing the data-parallel mesh itself.
    p = model.a.weight
    assert isinstance(p, DTensor)
    if equivalent is not None:
        fully_shard(twin, mesh=spmd[equivalent], sharding_strategy=strategy)
        q = twin.a.weight
        assert isinstance(q, DTensor)
        if (q.device_mesh.shape, q.placements) != (p.device_mesh.shape, p.placements):
            errors.append(f"mesh {p.device_mesh} {p.placements}, with mesh= "
                          f"{q.device_mesh} {q.placements}")
    elif p.device_mesh.shape != (world,):
        errors.append(f"flattened shard dims: mesh {p.device_mesh}, want one dim of {world}")
    if not all_ranks_ok(not errors):
        errors = errors or ["failed on another rank"]
    return [f"{case} {strategy} rank {rank}: {e}" for e in errors]


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
@pytest.mark.parametrize("case", list(MESHES))
def test_spmd_mesh_trains_like_its_dp_mesh(ranks: RankPools, case: str, strategy: str) -> None:
    world = MESHES[case][0][0] * MESHES[case][0][1]
    failures = [e for r in ranks.run(_parity_worker, world, case, strategy,
                                     timeout_s=TIMEOUT_S) for e in r]
    assert not failures, "\n".join(failures[:20])


def _refusal_worker(rank: int, world: int, case: str) -> str:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    kwargs: dict[str, Any] = {
        "replicate_only": dict(mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="tp")),
        "unknown_dim": dict(mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard")),
        "twice": dict(mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="tp", replicate="tp")),
        "unnamed": dict(mesh=init_device_mesh("cpu", (2,)),
                        dp_mesh_dims=DataParallelMeshDims(shard="dp")),
        "not_dims": dict(mesh=mesh, dp_mesh_dims="dp"),
        "shard_dim1": dict(shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None),
        "replicate_placement": dict(shard_placement_fn=lambda p: Replicate()),
        "not_callable": dict(shard_placement_fn=Shard(0)),
    }[case]
    model = SmallMLP()
    try:
        fully_shard(model, **kwargs)
    except (TypeError, ValueError, NotImplementedError) as e:
        untouched = type(model) is SmallMLP and not isinstance(model.a.weight, DTensor)
        return f"{type(e).__name__}: {e}" + ("" if untouched else " [module changed]")
    return "accepted"


@pytest.mark.parametrize("case,needles", [
    ("replicate_only", ["ValueError", "sharding_strategy='no_shard'", "DDP",
                        "'optim_grads_params'"]),
    ("unknown_dim", ["ValueError", "'dp_shard'", "('dp', 'tp')"]),
    ("twice", ["ValueError", "twice"]),
    ("unnamed", ["ValueError", "dimension names"]),
    ("not_dims", ["TypeError", "DataParallelMeshDims"]),
    ("shard_dim1", ["NotImplementedError", "Shard(1)", "'a.weight'", "Shard(0)"]),
    ("replicate_placement", ["NotImplementedError", "Replicate", "'a.weight'"]),
    ("not_callable", ["TypeError", "shard_placement_fn must be callable"]),
])
def test_refusals_name_the_problem(ranks: RankPools, case: str, needles: list[str]) -> None:
    for message in ranks.run(_refusal_worker, 2, case, timeout_s=TIMEOUT_S):
        for needle in needles:
            assert needle in message, message
        assert "[module changed]" not in message, message
