"""``torch.optim.Muon`` on ``fully_shard`` parameters (see [Note: distributed Muon] in
``megatron_fsdp_v2/_runtime/_muon.py``).

Each case trains a wrapped model with ``torch.optim.Muon`` on its matrices and AdamW on the
rest, and feeds a single-process copy (plain ``torch.optim.Muon`` + AdamW) the same full
gradients every step: parameters and momentum buffers must be bitwise equal after every step.
FSDP2 (``torch.distributed.fsdp.fully_shard``) fed the same gradients runs beside it as the
control (its Muon step goes through DTensor; its distance from one process is reported). The
step's collectives are counted by a dispatch mode: one all-to-all each way per process group
(none where every matrix is whole on one rank), nothing else.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

from _models import agree, local_detached, shard_rows
from _pool import RankPools

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TIMEOUT_S = 240.0
STEPS = 3


class _Collectives(TorchDispatchMode):
    """Counts the c10d collectives dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        if name.startswith("c10d::"):
            self.count[name.removeprefix("c10d::")] += 1
        return func(*args, **(kwargs or {}))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(24)
        self.up = nn.Linear(24, 40)
        self.down = nn.Linear(40, 24, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class MuonNet(nn.Module):
    """Matrices tall and wide (Newton-Schulz transposes the tall ones), of several row sizes
    (uneven rows, matrices across shard boundaries), plus vectors for AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 24)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.out = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class WholeNet(nn.Module):
    """Two equal square matrices: at world 2 each sits whole in one rank's shard."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _optimizers(model: nn.Module, *, nesterov: bool = True) -> list[torch.optim.Optimizer]:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    opts: list[torch.optim.Optimizer] = [torch.optim.Muon(
        [{"params": matrices[:2], "lr": 0.03}, {"params": matrices[2:]}], lr=0.02,
        weight_decay=0.1, nesterov=nesterov, adjust_lr_fn="match_rms_adamw")]
    if others:
        opts.append(torch.optim.AdamW(others, lr=1e-2, weight_decay=0.1))
    return opts


def _wrap(model: nn.Module, strategy: str, **kw: Any) -> nn.Module:
    for block in getattr(model, "blocks", []):
        fully_shard(block, sharding_strategy=strategy, **kw)
    return fully_shard(model, sharding_strategy=strategy, **kw)


def _full_grads(model: nn.Module) -> list[torch.Tensor | None]:
    """Every parameter's full gradient, assembled exactly from every rank's rows (HSDP's outer
    optim sub-shards included, which DTensor's full_tensor cannot order)."""
    mine = []
    for p in model.parameters():
        g = p.grad
        mine.append(None if g is None else (shard_rows(p), local_detached(g).clone()))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    grads: list[torch.Tensor | None] = []
    for i, p in enumerate(model.parameters()):
        pieces = [held[i] for held in everyone if held[i] is not None]
        if not pieces:
            grads.append(None)
            continue
        full = torch.empty(p.shape, dtype=pieces[0][1].dtype)
        for (lo, hi), rows in pieces:
            full[lo:hi] = rows
        grads.append(full)
    return grads


def _check_equal(ours: nn.Module, ours_opts: list, ref: nn.Module, ref_opts: list,
                 where: str) -> None:
    ref_params = list(ref.parameters())
    ref_state = {id(p): s for opt in ref_opts for p, s in opt.state.items()}
    for i, (p, q) in enumerate(zip(ours.parameters(), ref_params, strict=True)):
        rows = slice(*shard_rows(p)) if p.placements[-1].is_shard() else slice(None)
        assert torch.equal(local_detached(p), q.detach()[rows]), (
            f"{where}: parameter {i} {tuple(p.shape)} differs from one process by "
            f"{(local_detached(p) - q.detach()[rows]).abs().max().item():.3e}")
        mine = next((opt.state[p] for opt in ours_opts if p in opt.state), {})
        for key, value in mine.items():
            if not isinstance(value, DTensor):
                continue
            assert value.placements == p.placements and value.shape == p.shape, (
                f"{where}: state {i}.{key} placed {value.placements}")
            assert torch.equal(local_detached(value), ref_state[id(q)][key][rows]), (
                f"{where}: state {i}.{key} differs bitwise")


def _fsdp2_distance(fsdp2: nn.Module, ref: nn.Module) -> float:
    worst = 0.0
    for p, q in zip(fsdp2.parameters(), ref.parameters(), strict=True):
        worst = max(worst, (p.full_tensor().detach() - q.detach()).abs().max().item())
    return worst


def _train(rank: int, world: int, strategy: str, *, model_cls: type = MuonNet, micro: int = 1,
           mp: bool = False, mesh_shape: tuple[int, ...] | None = None,
           outer: str | None = None, nesterov: bool = True, fsdp2: bool = True,
           closure: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    base = model_cls()
    ref = copy.deepcopy(base)
    kw: dict[str, Any] = {"timeout": 60.0}
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if mesh_shape is not None:
        kw["mesh"] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    if outer is not None:
        kw["outer_dp_sharding_strategy"] = outer
    ours = _wrap(copy.deepcopy(base), strategy, **kw)
    ours_opts = _optimizers(ours, nesterov=nesterov)
    ref_opts = _optimizers(ref, nesterov=nesterov)
    twin = None
    if fsdp2:
        from torch.distributed.fsdp import fully_shard as fsdp2_shard

        twin = copy.deepcopy(base)
        for block in getattr(twin, "blocks", []):
            fsdp2_shard(block)
        fsdp2_shard(twin)
        twin_opts = _optimizers(twin, nesterov=nesterov)
    g = torch.Generator().manual_seed(7)
    in_dim = 12 if model_cls is MuonNet else 8
    out_dim = 5 if model_cls is MuonNet else 8
    counts: list[dict[str, int]] = []
    for step in range(STEPS):
        batches = [[(torch.randn(2, in_dim, generator=g), torch.randn(2, out_dim, generator=g))
                    for _ in range(world)] for _ in range(micro)]

        def forward_backward() -> torch.Tensor:
            total = torch.zeros(())
            for m in range(micro):
                ours.set_is_last_backward(m == micro - 1)
                x, y = batches[m][rank]
                loss = F.mse_loss(ours(x).float(), y) / micro
                loss.backward()
                total += loss.detach()
            return total

        if not closure:
            forward_backward()
        else:
            # The gradients come from the closure inside step(): run it once outside to feed
            # the reference the same ones, then let step() run it again from zeroed gradients.
            forward_backward()
        grads = _full_grads(ours)
        for q, grad in zip(ref.parameters(), grads):
            q.grad = grad
        if twin is not None:
            for q, grad in zip(twin.parameters(), grads):
                q.grad = None if grad is None else distribute_tensor(
                    grad, q.device_mesh, q.placements)
        spy = _Collectives()
        if closure:
            for opt in ours_opts:
                opt.zero_grad()
            with spy:
                ours_opts[0].step(forward_backward)
        else:
            with spy:
                ours_opts[0].step()
        counts.append(dict(spy.count))
        for opt in ours_opts[1:] + ref_opts + (twin_opts if twin is not None else []):
            opt.step()
        for opt in ours_opts + ref_opts + (twin_opts if twin is not None else []):
            opt.zero_grad()
        where = f"{strategy} world {world} step {step}"
        agree("bitwise vs one process", lambda: _check_equal(ours, ours_opts, ref, ref_opts,
                                                             where))
    plan_whole = __import__("megatron_fsdp_v2._registry", fromlist=["x"]).muon_plans[
        ours_opts[0]].whole
    return {"counts": counts, "exchanged": plan_whole.exchanged,
            "fsdp2": _fsdp2_distance(twin, ref) if twin is not None else None}


def _steady(counts: list[dict[str, int]]) -> list[dict[str, int]]:
    return counts[1:]  # the first step also checks that every rank holds the same Muon


CASES = [
    (2, "no_shard", {}), (2, "optim", {}), (2, "optim_grads", {"micro": 2}),
    (2, "optim_grads_params", {"micro": 2}), (3, "optim_grads_params", {}),
    (3, "optim", {"nesterov": False}), (2, "optim_grads_params", {"mp": True}),
    (2, "optim_grads", {"closure": True}),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,strategy,options", CASES,
                         ids=[f"w{w}-{s}-" + "-".join(f"{k}={v}" for k, v in o.items())
                              for w, s, o in CASES])
def test_bitwise_torch_muon(ranks: RankPools, world: int, strategy: str,
                            options: dict[str, Any]) -> None:
    results = ranks.run(_train, world, strategy, timeout_s=TIMEOUT_S, **options)
    for result in results:
        expected = {} if strategy == "no_shard" else {"alltoall_base_": 2}
        counts = _steady(result["counts"])
        if options.get("closure"):  # the closure's forward and backward run inside the step
            counts = [{k: v for k, v in c.items() if k == "alltoall_base_"} for c in counts]
        assert counts == [expected] * (STEPS - 1), result["counts"]
        assert (len(result["exchanged"]) > 0) == (strategy != "no_shard"), result["exchanged"]
        # The control ran (FSDP2 fed the same gradients trains the same model, roughly).
        assert result["fsdp2"] is not None and result["fsdp2"] < 0.05, result["fsdp2"]
    print(f"FSDP2 control, max distance from one process: {results[0]['fsdp2']:.3e}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_whole_matrices_need_no_collective(ranks: RankPools, strategy: str) -> None:
    for result in ranks.run(_train, 2, strategy, model_cls=WholeNet, timeout_s=TIMEOUT_S):
        assert result["exchanged"] == (), result["exchanged"]
        assert _steady(result["counts"]) == [{}] * (STEPS - 1), result["counts"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_hsdp(ranks: RankPools, outer: str) -> None:
    # Outer no_shard: each replica exchanges inside its shard axis; outer optim: the
    # optimizer's sub-shards span the mesh, the exchange too. One all-to-all each way.
    for result in ranks.run(_train, 4, "optim_grads_params", mesh_shape=(2, 2), outer=outer,
                            fsdp2=False, timeout_s=TIMEOUT_S):
        assert _steady(result["counts"]) == [{"alltoall_base_": 2}] * (STEPS - 1), \
            result["counts"]
