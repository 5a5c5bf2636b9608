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
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

# private: the Muon plan's count of exchanged matrices (_registry.muon_plans)
from megatron_fsdp_v2 import MixedPrecisionPolicy, _registry, checkpoint, fully_shard

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
        self.all_to_all_sent = 0  # bytes of the all-to-alls' inputs

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        if name.startswith("c10d::"):
            self.count[name.removeprefix("c10d::")] += 1
            if name == "c10d::alltoall_base_":
                self.all_to_all_sent += args[1].numel() * args[1].element_size()
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


class _Run:
    """A wrapped model and its optimizers, a single-process copy fed the same full gradients,
    and optionally FSDP2 fed them too."""

    def __init__(self, rank: int, world: int, strategy: str, *, model_cls: type = MuonNet,
                 micro: int = 1, mp: bool = False, mesh_shape: tuple[int, ...] | None = None,
                 outer: str | None = None, nesterov: bool = True, fsdp2: bool = True,
                 closure: bool = False) -> None:
        self.rank, self.world, self.strategy = rank, world, strategy
        self.micro, self.closure, self.mp = micro, closure, mp
        self.dims = (12, 5) if model_cls is MuonNet else (8, 8)
        torch.manual_seed(0)
        base = model_cls()
        self.ref = copy.deepcopy(base)
        kw: dict[str, Any] = {"timeout": 60.0}
        if mp:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
        if mesh_shape is not None:
            kw["mesh"] = init_device_mesh("cpu", mesh_shape,
                                          mesh_dim_names=("replicate", "shard"))
        if outer is not None:
            kw["outer_dp_sharding_strategy"] = outer
        self.ours = _wrap(copy.deepcopy(base), strategy, **kw)
        self.ours_opts = _optimizers(self.ours, nesterov=nesterov)
        self.ref_opts = _optimizers(self.ref, nesterov=nesterov)
        self.twin: nn.Module | None = None
        self.twin_opts: list[torch.optim.Optimizer] = []
        if fsdp2:
            from torch.distributed.fsdp import fully_shard as fsdp2_shard

            self.twin = copy.deepcopy(base)
            for block in getattr(self.twin, "blocks", []):
                fsdp2_shard(block)
            fsdp2_shard(self.twin)
            self.twin_opts = _optimizers(self.twin, nesterov=nesterov)

    def forward_backward(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(7 + 100 * step)
        (i, o), total = self.dims, torch.zeros(())
        batches = [[(torch.randn(2, i, generator=g), torch.randn(2, o, generator=g))
                    for _ in range(self.world)] for _ in range(self.micro)]
        for m in range(self.micro):
            self.ours.set_is_last_backward(m == self.micro - 1)
            x, y = batches[m][self.rank]
            loss = F.mse_loss(self.ours(x).float(), y) / self.micro
            loss.backward()
            total += loss.detach()
        # The forward ran on the weights the last step left (refreshed or gathered from the
        # updated main weights): its loss is one process's on the global batch.
        mean = total.clone()
        dist.all_reduce(mean)
        mean /= self.world
        with torch.no_grad():
            ref_loss = sum(F.mse_loss(self.ref(torch.cat([b[0] for b in batches[m]])),
                                      torch.cat([b[1] for b in batches[m]]))
                           for m in range(self.micro)) / self.micro
        tolerance = 2e-2 if self.mp else 1e-5
        agree("loss vs one process", lambda: torch.testing.assert_close(
            mean, ref_loss, rtol=tolerance, atol=tolerance))
        return total

    def step(self, step: int) -> dict[str, int]:
        """One step of all of them, checked bitwise; the c10d ops of ours' Muon step."""
        self.forward_backward(step)
        grads = _full_grads(self.ours)
        for q, grad in zip(self.ref.parameters(), grads):
            q.grad = grad
        if self.twin is not None:
            for q, grad in zip(self.twin.parameters(), grads):
                q.grad = None if grad is None else distribute_tensor(
                    grad, q.device_mesh, q.placements)
        spy = _Collectives()
        if self.closure:
            # The closure inside step() computes the same gradients again, from zero.
            for opt in self.ours_opts:
                opt.zero_grad()
            with spy:
                self.ours_opts[0].step(lambda: self.forward_backward(step))
        else:
            with spy:
                self.ours_opts[0].step()
        self.all_to_all_sent = spy.all_to_all_sent
        others = self.ours_opts[1:] + self.ref_opts + self.twin_opts
        for opt in others:
            opt.step()
        for opt in self.ours_opts + others:
            opt.zero_grad()
        where = f"{self.strategy} world {self.world} step {step}"
        agree("bitwise vs one process", lambda: _check_equal(
            self.ours, self.ours_opts, self.ref, self.ref_opts, where))
        return dict(spy.count)


def _train(rank: int, world: int, strategy: str, **options: Any) -> dict[str, Any]:
    run = _Run(rank, world, strategy, **options)
    counts = [run.step(step) for step in range(STEPS)]
    return {"counts": counts, "exchanged": _registry.muon_plans[run.ours_opts[0]].whole.exchanged,
            "fsdp2": _fsdp2_distance(run.twin, run.ref) if run.twin is not None else None}


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


# ---------------------------------------------------------------------- state


def _save_phase(rank: int, world: int, root: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    run = _Run(rank, world, "optim_grads_params", fsdp2=False)
    for step in range(2):
        run.step(step)
    checkpoint.save(run.ours, run.ours_opts, checkpoint_id=f"{root}/ours")
    model_sd, optim_sd = get_state_dict(run.ours, run.ours_opts)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/torch")
    if rank == 0:
        torch.save({"model": run.ref.state_dict(),
                    "optims": [opt.state_dict() for opt in run.ref_opts]}, f"{root}/ref.pt")
    dist.barrier()


def _resume_phase(rank: int, world: int, root: str, strategy: str, api: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    run = _Run(rank, world, strategy, fsdp2=False)
    if api == "ours":
        checkpoint.load(run.ours, run.ours_opts, checkpoint_id=f"{root}/ours")
    else:
        model_sd, optim_sd = get_state_dict(run.ours, run.ours_opts)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=f"{root}/torch")
        set_state_dict(run.ours, run.ours_opts, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    saved = torch.load(f"{root}/ref.pt", weights_only=False)
    run.ref.load_state_dict(saved["model"])
    for opt, opt_sd in zip(run.ref_opts, saved["optims"]):
        opt.load_state_dict(opt_sd)
    agree("loaded", lambda: _check_equal(run.ours, run.ours_opts, run.ref, run.ref_opts,
                                         f"{api} loaded at world {world} {strategy}"))
    for step in (2, 3):  # a momentum buffer loaded wrong shows here
        run.step(step)


@pytest.mark.timeout(300)
def test_momentum_resumes_at_another_world_and_strategy(ranks: RankPools, tmp_path: Any) -> None:
    root = str(tmp_path)
    ranks.run(_save_phase, 2, root, timeout_s=TIMEOUT_S)
    for world, strategy, api in [(3, "optim", "ours"), (3, "optim_grads", "torch"),
                                 (2, "no_shard", "ours"), (2, "optim_grads_params", "torch")]:
        ranks.run(_resume_phase, world, root, strategy, api, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- errors


def _errors(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = _wrap(MuonNet(), "optim_grads_params", timeout=60.0)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vector = next(p for p in model.parameters() if p.ndim == 1)
    F.mse_loss(model(torch.randn(2, 12)), torch.randn(2, 5)).backward()
    before = [local_detached(p).clone() for p in model.parameters()]
    grads = [p.grad for p in model.parameters()]

    def unchanged(opt: torch.optim.Optimizer) -> None:
        assert not opt.state, "the refused step created state"
        for p, value, grad in zip(model.parameters(), before, grads):
            assert torch.equal(local_detached(p), value), "the refused step changed a parameter"
            assert p.grad is grad, "the refused step changed a gradient"

    plain = nn.Parameter(torch.randn(4, 4))
    plain.grad = torch.ones(4, 4)
    mixed = torch.optim.Muon([*matrices, plain], lr=0.02)
    with pytest.raises(ValueError, match=r"parameter 6 \(shape \(4, 4\)\), which is not"):
        mixed.step()
    unchanged(mixed)
    late_vector = torch.optim.Muon(matrices, lr=0.02)
    late_vector.add_param_group({"params": [vector]})
    with pytest.raises(ValueError, match=r"has shape \(24,\); Muon takes 2-D parameters only"):
        late_vector.step()
    unchanged(late_vector)
    unknown_mode = torch.optim.Muon([{"params": matrices, "tp_mode": "rows"}], lr=0.02)
    with pytest.raises(ValueError, match=r"'tp_mode' 'rows': use 'whole' .* or 'per_shard'"):
        unknown_mode.step()
    unchanged(unknown_mode)
    differing = torch.optim.Muon(matrices, lr=0.02, ns_steps=5 if rank == 0 else 4)
    with pytest.raises(ValueError, match=r"torch.optim.Muon differs between ranks"):
        differing.step()
    unchanged(differing)
    fine = torch.optim.Muon(matrices, lr=0.02)
    fine.step()  # nothing was left half-done by the refusals
    assert all(local_detached(p).numel() == 0 or not torch.equal(local_detached(p), value)
               for p, value in zip(matrices, before)), "the step after the refusals did nothing"


@pytest.mark.timeout(120)
def test_bad_input_is_refused_before_anything_changes(ranks: RankPools) -> None:
    ranks.run(_errors, 2, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- the public API


def _polar_example(rank: int, world: int) -> list[dict[str, int]]:
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "whole_matrix_optimizer.py"
    spec = importlib.util.spec_from_file_location("whole_matrix_optimizer", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    model = MuonNet()
    matrices = lambda m: [p for p in m.parameters() if p.ndim == 2]  # noqa: E731
    for p in model.parameters():
        p.requires_grad_(p.ndim == 2)
    ref = copy.deepcopy(model)
    model = _wrap(model, "optim_grads", timeout=60.0)
    opt = example.PolarSGD(matrices(model), lr=0.05)
    counts = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * world, 12, generator=g), torch.randn(2 * world, 5, generator=g)
        F.mse_loss(model(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2]).backward()
        for q, grad in zip(ref.parameters(), _full_grads(model)):
            q.grad = grad
        spy = _Collectives()
        with spy:
            opt.step()
        counts.append(dict(spy.count))
        opt.zero_grad()
        example.reference_step(ref, 0.05)
        ref.zero_grad()
        agree("PolarSGD vs one process", lambda: _check_equal(model, [opt], ref, [], "polar"))
    return counts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_whole_matrix_api_example(ranks: RankPools, world: int) -> None:
    for counts in ranks.run(_polar_example, world, timeout_s=TIMEOUT_S):
        assert counts == [{"alltoall_base_": 2}] * STEPS, counts


# ---------------------------------------------------------------------- the estimator


def _measured(rank: int, world: int, strategy: str) -> tuple[int, int, int]:
    """All-to-alls and bytes sent by the last Muon step (counted at the dispatcher), and the
    bytes of both optimizers' state, on this rank."""
    run = _Run(rank, world, strategy, fsdp2=False)
    counts = [run.step(step) for step in range(2)]
    state = sum(local_detached(v).numel() * v.element_size()
                for opt in run.ours_opts for st in opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor))
    return counts[-1].get("alltoall_base_", 0), run.all_to_all_sent, state


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,strategy", [(2, "optim_grads_params"), (3, "optim"),
                                            (2, "no_shard")])
def test_estimator_counts_the_exchange_exactly(ranks: RankPools, world: int,
                                               strategy: str) -> None:
    from megatron_fsdp_v2 import estimate

    measured = ranks.run(_measured, world, strategy, timeout_s=TIMEOUT_S)
    for rank, (count, sent, state) in enumerate(measured):
        est = estimate(MuonNet, world_size=world, rank=rank, wrap=(_Block,),
                       sharding_strategy=strategy, optimizer="muon")
        assert est.collectives.get("all_to_all", (0, 0)) == (count, sent), (
            rank, est.collectives.get("all_to_all"), (count, sent))
        assert est.optimizer_state["muon"] == state, (rank, est.optimizer_state["muon"], state)
        assert (count > 0) == (strategy != "no_shard")


# ---------------------------------------------------------------------- tensor parallel


class _PerShardMuon(torch.optim.Optimizer):
    """One process's reference for ``tp_mode="per_shard"``: torch's Muon step with
    Newton-Schulz run on each TP chunk of the update (``torch.chunk`` along the TP dim, as
    DTensor's ``Shard`` cuts) instead of the whole matrix."""

    def __init__(self, params: Any, tp_dims: list[int | None], tp: int) -> None:
        super().__init__(params, {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95})
        self.tp_dims, self.tp = tp_dims, tp

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        from torch.optim import _muon

        group = self.param_groups[0]
        for p, dim in zip(group["params"], self.tp_dims):
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - group["momentum"])
            update = p.grad.lerp(buf, group["momentum"])
            pieces = [update] if dim is None else update.chunk(self.tp, dim=dim)
            ortho = torch.cat([_muon._zeropower_via_newtonschulz(
                piece, (3.4445, -4.775, 2.0315), 5, 1e-7) for piece in pieces],
                dim=dim or 0)
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(ortho, alpha=-_muon._adjust_lr(group["lr"], None, p.shape))


def _tp_muon(rank: int, world: int, strategy: str, mode: str) -> list[dict[str, int]]:
    from _tp_common import apply_tp, batches, build_model, dp_tp_mesh, loss_of, wrap_ours

    mesh = dp_tp_mesh(2, 2)
    model = build_model()
    ref = copy.deepcopy(model)
    wrap_ours(apply_tp(model, mesh["tp"]), mesh["dp"], strategy, timeout=60.0)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    ours_opts = [torch.optim.Muon([{"params": matrices, "tp_mode": mode}], lr=0.02,
                                  weight_decay=0.1),
                 torch.optim.AdamW([p for p in model.parameters() if p.ndim != 2], lr=1e-2)]
    ref_matrices = [p for p in ref.parameters() if p.ndim == 2]
    if mode == "whole":
        ref_muon: torch.optim.Optimizer = torch.optim.Muon(ref_matrices, lr=0.02,
                                                           weight_decay=0.1)
    else:
        tp_dims = [next((pl.dim for pl in p.placements[1:] if pl.is_shard()), None)
                   for p in matrices]
        ref_muon = _PerShardMuon(ref_matrices, tp_dims, mesh["tp"].size())
    ref_opts = [ref_muon,
                torch.optim.AdamW([p for p in ref.parameters() if p.ndim != 2], lr=1e-2)]
    data = batches(STEPS, 1, 2)
    counts = []
    for step in range(STEPS):
        loss_of(model, data[step, 0, mesh["dp"].get_local_rank()]).backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            q.grad = None if p.grad is None else p.grad.full_tensor()
        spy = _Collectives()
        with spy:
            ours_opts[0].step()
        counts.append(dict(spy.count))
        for opt in ours_opts[1:] + ref_opts:
            opt.step()
        for opt in ours_opts + ref_opts:
            opt.zero_grad()

        def same() -> None:
            ref_state = ref_opts[0].state
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p.full_tensor(), q.detach()), (
                    f"{mode} step {step}: {name} {p.placements} differs from one process by "
                    f"{(p.full_tensor() - q.detach()).abs().max().item():.3e}")
                if p.ndim == 2:
                    buf = ours_opts[0].state[p]["momentum_buffer"]
                    assert buf.placements == p.placements, (name, buf.placements)
                    assert torch.equal(buf.full_tensor(), ref_state[q]["momentum_buffer"]), name
        agree(f"FSDP x TP {strategy} {mode} vs one process", same)
    return counts


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,mode", [("optim", "whole"), ("optim_grads_params", "whole"),
                                          ("optim_grads_params", "per_shard")])
def test_tensor_parallel_matrices(ranks: RankPools, strategy: str, mode: str) -> None:
    # dp 2 x tp 2: colwise (Shard(0)) and rowwise (Shard(1)) TP weights, odd TP-local rows
    # (uneven over dp). "whole": one exchange over the whole dp x TP mesh; "per_shard": each
    # TP shard on its own, one exchange over the dp ranks (each TP rank its own group).
    for counts in ranks.run(_tp_muon, 4, strategy, mode, timeout_s=TIMEOUT_S):
        assert _steady(counts) == [{"alltoall_base_": 2}] * (STEPS - 1), counts
