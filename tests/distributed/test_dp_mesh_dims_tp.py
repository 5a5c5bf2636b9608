"""FSDP2's ``dp_mesh_dims`` with tensor parallelism over the SPMD mesh's other dims
(torchtitan's SPMD mode; [Note: SPMD parameters] in ``megatron_fsdp_v2/_dtensor/_tp_params.py``):
parameters are DTensors on the whole mesh, ``Replicate()`` on the data-parallel dims and
colwise/rowwise on ``tp``, inputs are DTensors there too. Same losses, clipped gradient norms,
parameters and torch full state dict as single-process training and as FSDP2 running the same
script (the control), and the optimizer-facing parameters on FSDP2's mesh with FSDP2's
placements (also with two shard dims flattened, and in FSDP2's DDP mode, replicate dims only,
which is ``no_shard``); a parameter not ``Replicate()`` on a dp dim is refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

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

# (mesh shape, dim names, DataParallelMeshDims kwargs). SmallMLP is 5 -> 7 -> 3: the colwise
# weight's TP-local 4 (or 3) rows split unevenly over dp.
MESHES = {
    "fsdp_tp": ((2, 2), ("dp", "tp"), dict(shard="dp")),
    "hsdp_tp": ((1, 2, 2), ("rep", "dp", "tp"), dict(shard="dp", replicate="rep")),
    "flat_tp": ((2, 1, 2), ("dp", "cp", "tp"), dict(shard=("dp", "cp"))),  # flattened shard
    "ddp_tp": ((2, 2), ("ddp", "tp"), dict(replicate="ddp")),  # FSDP2's DDP mode: no_shard
    "dp_only": ((2,), ("dp",), dict(shard="dp")),  # DTensors on a mesh of dp dims only
    # A TP dim before the dp dim: the optimizer-facing mesh lists the dp dims first (FSDP2
    # keeps the SPMD mesh's order), the values are the same.
    "tp_first": ((2, 2), ("tp", "dp"), dict(shard="dp")),
}


def _distribute(model: SmallMLP, mesh: DeviceMesh, dp_placement: object = Replicate()) -> SmallMLP:
    """Every parameter a DTensor on ``mesh``: ``a`` colwise, ``b`` rowwise over ``tp``,
    ``dp_placement`` on the other dims (``distribute_module``'s way, as FSDP2's tests)."""
    names = mesh.mesh_dim_names or ()
    for layer, tp_weight, tp_bias in ((model.a, Shard(0), Shard(0)),
                                      (model.b, Shard(1), Replicate())):
        for pname, tp in (("weight", tp_weight), ("bias", tp_bias)):
            placements = [tp if n == "tp" else dp_placement for n in names]
            value = distribute_tensor(getattr(layer, pname).detach(), mesh, placements)
            layer.register_parameter(pname, nn.Parameter(value))
    return model


def _rank_run(model: nn.Module, mesh: DeviceMesh | None, dp_rank: int, dp: int) -> list[float]:
    """Two AdamW steps on a global batch of ``2 * dp`` rows: this dp rank's rows as a DTensor
    replicated over ``mesh`` (each dp rank's own data, as FSDP2's tests), or all of them
    (``mesh`` None: the single-process reference), gradients clipped by torch's
    ``clip_grad_norm_`` (fully_shard routes it to its own). Returns the global mean loss per
    step, then the gradient norms."""
    g = torch.Generator().manual_seed(1)
    batches = [[(torch.randn(2 * dp, 5, generator=g), torch.randn(2 * dp, 3, generator=g))]
               for _ in range(2)]

    def rows(parts: tuple[torch.Tensor, torch.Tensor], r: int | None) -> tuple[torch.Tensor, ...]:
        return parts if r is None else tuple(t[2 * r: 2 * r + 2] for t in parts)

    def loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if mesh is None:
            return F.mse_loss(m(x), y)
        return F.mse_loss(m(DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim)).full_tensor(),
                          y)

    norms: list[float] = []

    def clip(step: int) -> None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # below every norm
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))

    per_step = train_steps(model, torch.optim.AdamW(model.parameters(), lr=0.05), batches, loss,
                           rank=None if mesh is None else dp_rank, select=rows, mark=None,
                           divide_by_micro=False, before_optimizer=clip)
    losses = []
    for (mean,) in per_step:
        if mesh is not None:  # every rank of a dp rank's TP group holds the same loss
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        losses.append(float(mean))
    return losses + norms


def _parity_worker(rank: int, world: int, case: str, strategy: str) -> list[str]:
    shape, names, dims = MESHES[case]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_rank, dp = 0, 1  # row-major over the data-parallel dims
    for name in (n for n in names if n != "tp"):
        dp_rank, dp = dp_rank * mesh.size(names.index(name)) + mesh.get_local_rank(name), \
            dp * mesh.size(names.index(name))
    torch.manual_seed(0)
    base = SmallMLP()
    ref, ours, control = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    want_losses = _rank_run(ref, None, 0, dp)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    fully_shard(_distribute(ours, mesh), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(**dims),
                sharding_strategy=strategy)
    # FSDP2 wants the parameters' mesh object itself; DTensor's caches may hand back an equal
    # mesh of an earlier case.
    fsdp2_fully_shard(_distribute(control, mesh), mesh=control.a.weight.device_mesh,
                      dp_mesh_dims=DataParallelMeshDims(**dims))
    errors = []
    for who, model in (("ours", ours), ("FSDP2 (control)", control)):
        losses = _rank_run(model, mesh, dp_rank, dp)
        if not torch.allclose(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5):
            errors.append(f"{who}: losses {losses} vs single process {want_losses}")
        for name, p in model.named_parameters():
            if not torch.allclose(p.full_tensor(), want[name], rtol=1e-5, atol=1e-6):
                errors.append(f"{who}: parameter {name} differs from single-process training")
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        if sorted(full) != sorted(want) or not all(
            torch.allclose(full[k], want[k], rtol=1e-5, atol=1e-6) for k in want
        ):
            errors.append(f"{who}: torch's full state dict differs from single-process training")
    # The optimizer-facing parameters as FSDP2 makes them (strategies that shard over dp).
    if case == "tp_first":
        names_first = ours.a.weight.device_mesh.mesh_dim_names
        if names_first != ("dp", "tp"):
            errors.append(f"tp_first: optimizer-facing mesh dims {names_first}")
    elif strategy != "no_shard" or case == "ddp_tp":
        for (name, p), q in zip(ours.named_parameters(), control.parameters()):
            if (p.device_mesh, p.placements) != (q.device_mesh, q.placements):
                errors.append(f"{name}: {p.device_mesh} {p.placements}, FSDP2 "
                              f"{q.device_mesh} {q.placements}")
    if not all_ranks_ok(not errors):
        errors = errors or ["failed on another rank"]
    return [f"{case} {strategy} rank {rank}: {e}" for e in errors]


@pytest.mark.parametrize("case,strategy", [
    ("fsdp_tp", "optim_grads_params"),
    ("fsdp_tp", "no_shard"),
    ("hsdp_tp", "optim_grads_params"),
    ("flat_tp", "optim"),
    ("ddp_tp", "no_shard"),
    ("dp_only", "optim_grads_params"),
    ("tp_first", "optim_grads"),
])
def test_spmd_tp_parity_with_fsdp2(ranks: RankPools, case: str, strategy: str) -> None:
    world = 1
    for size in MESHES[case][0]:
        world *= size
    failures = [e for r in ranks.run(_parity_worker, world, case, strategy,
                                     timeout_s=TIMEOUT_S) for e in r]
    assert not failures, "\n".join(failures[:20])


def _refusal_worker(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = _distribute(SmallMLP(), mesh, dp_placement=Shard(0))  # sharded on the dp dim already
    try:
        fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    except ValueError as e:
        return f"ValueError: {e}" + ("" if type(model) is SmallMLP else " [module changed]")
    return "accepted"


def test_dp_dim_must_be_replicate(ranks: RankPools) -> None:
    for message in ranks.run(_refusal_worker, 2, timeout_s=TIMEOUT_S):
        for needle in ("ValueError", "'a.weight'", "Replicate()", "'dp'"):
            assert needle in message, message
        assert "[module changed]" not in message, message


def _spmd_types_worker(rank: int, world: int, local_type: str) -> list[str]:
    """``spmd_types``-annotated plain parameters (torchtitan's default SPMD backend) without
    ``dp_mesh_dims``: refused before any collective, whatever the type (nothing says which mesh
    the types are on), as FSDP2 refuses them (the control, same model and mesh). With
    ``dp_mesh_dims`` they are read: ``test_spmd_types_tp.py``."""
    import spmd_types as spmd

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    messages = []
    for wrap in (fully_shard, fsdp2_fully_shard):
        model = SmallMLP()
        spmd.assert_type(model.a.weight, {mesh.get_group(): getattr(spmd, local_type)})
        try:
            wrap(model, mesh=mesh)
        except ValueError as e:
            messages.append(f"ValueError: {e}"
                            + ("" if type(model) is SmallMLP else " [module changed]"))
        else:
            messages.append("accepted")
    return messages


@pytest.mark.parametrize("local_type", ["V", "P", "R"])
def test_spmd_types_annotations(ranks: RankPools, local_type: str) -> None:
    pytest.importorskip("spmd_types", reason="a test dependency (scripts/install.sh)")
    for ours, control in ranks.run(_spmd_types_worker, 2, local_type, timeout_s=TIMEOUT_S):
        for needle in ("ValueError", "'a.weight'", "spmd_types", "dp_mesh_dims"):
            assert needle in ours, ours
        assert "[module changed]" not in ours, ours
        assert control.startswith("ValueError"), control
