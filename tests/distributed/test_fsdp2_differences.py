"""FSDP2's remaining differences (issue 38 item 6), each with FSDP2 itself as the control on the
same model and input in the same case:

* after a ``reshard_after_forward=False`` forward FSDP2 leaves the unsharded parameters
  registered on the modules (``module.weight`` is the full, plain tensor) until the backward;
* a gradient that arrives ``Partial()`` over a data-parallel mesh dimension (inputs sharded over
  it as DTensors) is averaged over that dimension as FSDP2 averages it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _fsdp2_api import TIMEOUT_S, _batches, _loss, _net, _train, _wrap
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from _pool import RankPools

pytestmark = pytest.mark.timeout(600)
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


# ---------------------------------------------------------------------- (i) registered params

def _slots(model: torch.nn.Module) -> dict[str, str]:
    """What each parameter slot holds: ``plain`` or ``DTensor``, and its shape."""
    return {name: f"{'DTensor' if isinstance(p, DTensor) else 'plain'}{tuple(p.shape)}"
            for name, p in model.named_parameters()}


def _unsharded_registered(rank: int, world: int, strategy: str) -> dict[str, Any]:
    model, ref = _net()
    fsdp2 = copy.deepcopy(ref)
    _wrap(model, reshard_after_forward=False, sharding_strategy=strategy)
    _wrap(fsdp2, torch_fully_shard, reshard_after_forward=False)
    batch = _batches(1, 1)[0][0]
    seen: dict[str, Any] = {}
    values_ok = []
    for name, m in (("ours", model), ("fsdp2", fsdp2)):
        loss = _loss(m, batch)
        seen[f"{name} after forward"] = _slots(m)
        # The registered tensors hold the full values.
        full = dict(ref.named_parameters())
        values_ok += [f"{name} {k}" for k, p in m.named_parameters()
                      if not isinstance(p, DTensor) and not torch.equal(p.detach(), full[k])]
        loss.backward()
        seen[f"{name} after backward"] = _slots(m)
        m.zero_grad()  # type: ignore[operator]
    _loss(ref, batch).backward()
    ref.zero_grad()
    # Training goes on right, the next forwards too (reference and FSDP2 fed the same).
    result = _train(model, ref, steps=2, micro=2)
    # An optimizer built from model.parameters() between such a forward and its backward holds
    # the unsharded parameters (FSDP2's alike, which then never steps the sharded ones): ours
    # says so at its step.
    loss = _loss(model, batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss.backward()
    try:
        opt.step()
        result["optimizer_error"] = ""
    except RuntimeError as e:
        result["optimizer_error"] = str(e)
    model.zero_grad()  # type: ignore[operator]
    result["seen"] = seen
    result["value_errors"] = values_ok
    return result


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unsharded_parameters_registered_after_forward(ranks: RankPools, strategy: str) -> None:
    """``reshard_after_forward=False``: between forward and backward every parameter slot holds
    the plain unsharded tensor with the full values, as FSDP2's do; after the backward, the
    DTensor parameters, as FSDP2's; training matches one process."""
    results = ranks.run(_unsharded_registered, 2, strategy, timeout_s=TIMEOUT_S)
    for rank, r in enumerate(results):
        seen = r["seen"]
        assert seen["fsdp2 after forward"] and all(
            v.startswith("plain") for v in seen["fsdp2 after forward"].values()), seen
        assert seen["ours after forward"] == seen["fsdp2 after forward"], (
            f"rank {rank}: ours {seen['ours after forward']} vs FSDP2 "
            f"{seen['fsdp2 after forward']}")
        assert seen["ours after backward"] == seen["fsdp2 after backward"], seen
        assert not r["value_errors"], r["value_errors"]
        assert "between a reshard_after_forward=False forward and its backward" in r[
            "optimizer_error"], r["optimizer_error"]
        assert not r["errors"], r["errors"][:3]
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------- (ii) Partial over dp

# (mesh shape, dim names, DataParallelMeshDims kwargs): a dp dim, and HSDP's replicate and
# shard dims. Not with a TP dim: inputs sharded over dp there take an implicit
# redistribution over two mesh dims, which fully_shard refuses (design.md, "2-D parameters",
# Not covered).
PARTIAL_MESHES = {
    "dp_only": ((2,), ("dp",), dict(shard="dp")),
    "hsdp": ((2, 2), ("rep", "dp"), dict(shard="dp", replicate="rep")),
}


def _sgd_steps(model: torch.nn.Module, mesh: Any, dp_rank: int, dp: int, lr: float,
               steps: int = 2) -> list[float]:
    """SGD steps on a global batch of ``2 * dp`` rows: this dp rank's rows as a DTensor
    *sharded* over the dp dims (``Shard(0)``), replicated over the others, so the loss is the
    global mean and each dp rank's weight gradient arrives ``Partial()`` over dp; or all rows
    (``mesh`` None: one process). Returns the global mean loss per step."""
    from torch.distributed.tensor import Replicate, Shard

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(2 * dp, 5, generator=g), torch.randn(2 * dp, 3, generator=g)
        if mesh is not None:
            names = mesh.mesh_dim_names
            placements = [Replicate() if n == "tp" else Shard(0) for n in names]
            # Shard(0) over several dp dims: rows split over them in row-major order.
            rows = slice(2 * dp_rank, 2 * dp_rank + 2)
            x = DTensor.from_local(x[rows], mesh, placements, shape=x.shape, stride=x.stride())
            y = DTensor.from_local(y[rows], mesh, placements, shape=y.shape, stride=y.stride())
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.full_tensor() if isinstance(loss, DTensor) else loss))
    return losses


def _partial_over_dp(rank: int, world: int, case: str, strategy: str) -> list[str]:
    import torch.distributed.fsdp as torch_fsdp
    from test_dp_mesh_dims_tp import _distribute
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_fsdp_v2 import fully_shard

    from _models import SmallMLP

    shape, names, dims = PARTIAL_MESHES[case]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_rank, dp = 0, 1
    for name in (n for n in names if n != "tp"):
        dp_rank = dp_rank * mesh.size(names.index(name)) + mesh.get_local_rank(name)
        dp *= mesh.size(names.index(name))
    torch.manual_seed(0)
    base = SmallMLP()
    ref, ours, control = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    lr = 0.1
    # FSDP2 averages the partial sums over dp. DTensor's backward of the loss (Partial() over
    # dp) seeds every rank with one, which that average compensates: FSDP2 trains as one
    # process on the global batch (measured, torch 2.14); summing the partials first gives dp
    # times that gradient.
    want_losses = _sgd_steps(ref, None, 0, dp, lr)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    spmd = torch_fsdp.DataParallelMeshDims(**dims)
    fully_shard(_distribute(ours, mesh), mesh=mesh, dp_mesh_dims=spmd,
                sharding_strategy=strategy)
    torch_fsdp.fully_shard(_distribute(control, mesh), mesh=control.a.weight.device_mesh,
                           dp_mesh_dims=spmd)
    errors = []
    got: dict[str, dict[str, torch.Tensor]] = {}
    for who, model in (("ours", ours), ("FSDP2", control)):
        losses = _sgd_steps(model, mesh, dp_rank, dp, lr)
        if not torch.allclose(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5):
            errors.append(f"{who}: losses {losses} vs one process {want_losses}")
        got[who] = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
        for name, value in got[who].items():
            if not torch.allclose(value, want[name], rtol=1e-5, atol=1e-6):
                diff = (value - want[name]).abs().max().item()
                errors.append(f"{who}: {name} differs from one process by {diff:.3g}")
    for name, value in got["ours"].items():
        if not torch.allclose(value, got["FSDP2"][name], rtol=1e-5, atol=1e-6):
            errors.append(f"ours vs FSDP2: {name} differs")
    return [f"{case} {strategy} rank {rank}: {e}" for e in errors]


@pytest.mark.parametrize("case,strategy", [
    ("dp_only", "no_shard"), ("dp_only", "optim"), ("dp_only", "optim_grads"),
    ("dp_only", "optim_grads_params"), ("hsdp", "optim_grads_params"), ("hsdp", "no_shard"),
])
def test_partial_over_dp_averaged_as_fsdp2(ranks: RankPools, case: str, strategy: str) -> None:
    """Inputs sharded over the dp dims as DTensors: each dp rank's weight gradient arrives
    ``Partial()`` over dp; FSDP2 averages those partial sums, which trains as one process on
    the global batch. Ours equals FSDP2's and that one process (SGD, where a factor shows;
    before, ours summed the partials first: dp times the gradient)."""
    import torch.distributed.fsdp as torch_fsdp

    if getattr(torch_fsdp, "DataParallelMeshDims", None) is None:
        pytest.skip("torch.distributed.fsdp has no DataParallelMeshDims")
    world = 1
    for size in PARTIAL_MESHES[case][0]:
        world *= size
    failures = [e for r in ranks.run(_partial_over_dp, world, case, strategy,
                                     timeout_s=TIMEOUT_S) for e in r]
    assert not failures, "\n".join(failures[:12])
