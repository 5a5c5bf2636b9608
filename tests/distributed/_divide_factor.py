"""The worker of ``test_fsdp2_divide_factor.py``: FSDP2's gradient-scaling methods
(``set_gradient_divide_factor``, its deprecated alias ``set_reduce_scatter_divide_factor``,
``set_force_sum_reduction_for_comms``) called on our units and on FSDP2's (the control, same
model, same calls, same data), and a single-process reference whose gradients are scaled as the
methods say: each rank feeds its own micro-batches, the reference sums every rank's gradients
and divides each parameter's by its unit's factor (the mesh size where none was set).

SGD, not Adam: Adam is almost invariant to the gradient's scale, so it would hide a wrong
factor. gloo has no ``PREMUL_SUM``: FSDP2 with a custom factor (other than the shard group's
size) needs ``set_force_sum_reduction_for_comms(True)`` there, which by FSDP2's definition
changes how it reduces, not what; the control sets it where needed.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
from _fsdp2_api import Net, _loss, _net, _param_errors
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from megatron_fsdp_v2 import fully_shard

from _training import train_steps

STEPS, MICRO, LR = 3, 2, 0.05


def _batches(world: int) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """``[step][micro][rank]`` batches: every rank its own data."""
    g = torch.Generator().manual_seed(5)
    return [[[(torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g))
              for _ in range(world)] for _ in range(MICRO)] for _ in range(STEPS)]


def unit_factors(case: str, world: int) -> tuple[list[float | None], float | None]:
    """Per case: the factor set on each block, and on the root (``None``: not set)."""
    if case in ("sum_isinstance", "force_sum_and_factor"):
        return [1.0, 1.0, 1.0], 1.0
    if case in ("per_unit", "per_unit_coalesced"):
        # An expert-like block on the world size's double, one summing, one left default.
        return [2.0 * world, 1.0, None], 2.5
    if case == "deprecated_alias":
        return [3.0, 3.0, 3.0], None
    if case == "force_sum":
        return [None, None, None], None
    raise ValueError(case)


def _configure(model: Net, case: str, world: int, fsdp2: bool) -> None:
    blocks, root = unit_factors(case, world)
    if case == "sum_isinstance":  # torchtitan's loop
        for m in model.modules():
            if isinstance(m, TorchFSDPModule):
                m.set_gradient_divide_factor(1.0)
    else:
        for block, factor in zip(model.blocks, blocks):
            if factor is not None:
                if case == "deprecated_alias":
                    with warnings.catch_warnings(record=True) as seen:
                        warnings.simplefilter("always")
                        block.set_reduce_scatter_divide_factor(factor)  # type: ignore[operator]
                    assert any(issubclass(w.category, DeprecationWarning) for w in seen), seen
                else:
                    block.set_gradient_divide_factor(factor)  # type: ignore[operator]
        if root is not None:
            model.set_gradient_divide_factor(root)  # type: ignore[operator]
    force = case.startswith("force_sum") or (fsdp2 and case != "force_sum")
    if force:
        for m in model.modules():
            if isinstance(m, TorchFSDPModule):
                m.set_force_sum_reduction_for_comms(True)


def _param_factors(model: Net, case: str, world: int, mesh_size: int) -> dict[str, float]:
    blocks, root = unit_factors(case, world)
    out = {}
    for name, _ in model.named_parameters():
        factor = root
        if name.startswith("blocks."):
            factor = blocks[int(name.split(".")[1])]
        out[name] = float(mesh_size) if factor is None else factor
    return out


def _train_reference(ref: nn.Module, factors: dict[str, float], world: int) -> None:
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for parts in _batches(world):
        for per_rank in parts:
            for batch in per_rank:
                _loss(ref, batch).backward()
        for name, p in ref.named_parameters():
            assert p.grad is not None
            p.grad.div_(factors[name])
        opt.step()
        opt.zero_grad()


def divide_factor_worker(rank: int, world: int, strategy: str, case: str,
                         replicas: int = 1, outer: str = "no_shard") -> dict[str, Any]:
    """Train ours, FSDP2 and the reference; return both distributed models' mismatches.
    ``replicas > 1``: an HSDP mesh (``outer`` our outer strategy; FSDP2's HSDP replicates)."""
    mesh = (init_device_mesh("cpu", (world,)) if replicas == 1 else
            init_device_mesh("cpu", (replicas, world // replicas),
                             mesh_dim_names=("replicate", "shard")))
    kw: dict[str, Any] = {"mesh": mesh, "sharding_strategy": strategy}
    if replicas > 1:
        kw["outer_dp_sharding_strategy"] = outer
    if case == "per_unit_coalesced":
        kw["reduce_bucket_size_mb"] = 1.0  # every unit's delayed reduction in one bucket
    results: dict[str, Any] = {}
    ref = None
    for name in ("ours", "fsdp2"):
        model, ref = _net()
        wrap: Any = fully_shard if name == "ours" else torch_fully_shard
        kwargs = kw if name == "ours" else {"mesh": mesh}
        for block in model.blocks:
            wrap(block, **kwargs)
        wrap(model, **kwargs)
        assert isinstance(model, TorchFSDPModule)
        _configure(model, case, world, fsdp2=name == "fsdp2")
        # Each rank's own micro-batches, undivided; the non-last ones without gradient sync.
        losses = train_steps(model, torch.optim.SGD(model.parameters(), lr=LR), _batches(world),
                             _loss, rank=rank, mark="gradient_sync", divide_by_micro=False)
        results[name] = {"losses": [loss.item() for step in losses for loss in step],
                         "model": model}
    assert ref is not None
    _train_reference(ref, _param_factors(ref, case, world, world), world)
    return {
        name: {"losses": r["losses"], "errors": _param_errors(r["model"], ref)}
        for name, r in results.items()
    }


# ---------------------------------------------------------------------- experts on a sub-mesh

class ExpertNet(nn.Module):
    """Dense input and output layers around one expert (this rank's expert-parallel index
    decides which; the reference holds all of them, see :func:`expert_worker`)."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(experts)
        )
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, expert: int = 0) -> torch.Tensor:
        return self.out(self.experts[expert](self.inp(x)))


def expert_worker(rank: int, world: int, strategy: str) -> dict[str, Any]:
    """torchtitan's expert pattern on a (ep=2, edp=world/2) mesh, without the all-to-all: each
    rank routes its batch to its ep index's expert, which is wrapped on the edp sub-mesh with
    ``set_gradient_divide_factor(world)`` (its gradient, like the dense layers', is the mean
    over every rank's loss); the dense layers are a unit on the whole mesh. Ours and FSDP2
    against one process that holds both experts."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ep", "edp"))
    ep = mesh.get_local_rank("ep")
    flat = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(9)
    batches = [[(torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g))
                for _ in range(world)] for _ in range(STEPS)]
    ep_of = [r // (world // 2) for r in range(world)]
    torch.manual_seed(0)
    ref = ExpertNet(2)
    out: dict[str, Any] = {}
    for name in ("ours", "fsdp2"):
        model = ExpertNet(1)
        model.inp.load_state_dict(ref.inp.state_dict())
        model.out.load_state_dict(ref.out.state_dict())
        model.experts[0].load_state_dict(ref.experts[ep].state_dict())
        wrap: Any = fully_shard if name == "ours" else torch_fully_shard
        kw = {"sharding_strategy": strategy} if name == "ours" else {}
        wrap(model.experts[0], mesh=mesh["edp"], **kw)
        wrap(model, mesh=flat, **kw)
        model.experts[0].set_gradient_divide_factor(float(world))  # type: ignore[operator]
        if name == "fsdp2":  # gloo: no PREMUL_SUM (see the module docstring)
            model.experts[0].set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for per_rank in batches:
            x, y = per_rank[rank]
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        out[name] = model
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for per_rank in batches:
        for r, (x, y) in enumerate(per_rank):
            (torch.nn.functional.mse_loss(ref(x, ep_of[r]), y) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    # Compare this rank's expert with the reference's expert of its ep index.
    ref_view = ExpertNet(1)
    ref_view.inp, ref_view.out = ref.inp, ref.out
    ref_view.experts[0] = ref.experts[ep]
    return {name: _param_errors(m, ref_view) for name, m in out.items()}
