"""Tensor parallelism annotated by ``spmd_types`` (torchtitan's default SPMD backend): plain
TP-local parameters whose annotations say what they are, read by ``fully_shard`` with the SPMD
mesh and ``dp_mesh_dims`` as FSDP2 reads them ([Note: spmd_types parameters] in
``megatron_fsdp_v2/_frontend/_spmd_types.py``).

A tiny sequence-parallel MLP in torchtitan's style: a norm-like scale ``n1`` (``R`` on tp, applied
to sequence-sharded activations: its gradient is the TP ranks' partial sums), a colwise layer
``a`` (``S(0)``), a rowwise layer ``b`` (weight ``S(1)``, bias ``R``), an output scale ``g``
(``I``: every TP rank computes the same), with ``spmd_types``' own collectives between them.
Ours and FSDP2 (the control) run the same script on the same input in the same test, on dp 2 x
tp 2 and on HSDP (replicate 2 x shard 1) x tp 2: losses, gradient norms and full parameters
equal single-process training, the optimizer-facing parameters have FSDP2's mesh and
placements, the module computes with its annotated plain parameters, and the collectives per
iteration are counted (tp: the same as FSDP2's; dp: design.md §4's table), also under
``spmd_types``' strict type checker. A checkpoint saved at
tp 2 loads at tp 1 (dp 4) with the same values under ours and FSDP2; a model built on the meta
device trains like one built on the device after ``to_empty`` and a full-state-dict load (also
with TP DTensor parameters, the ``full_dtensor`` backend); what cannot be read is refused before
anything changes, as FSDP2 refuses it."""

from __future__ import annotations

import contextlib
import copy
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
import torch.nn.functional as F
from test_fsdp_tp_counts import GroupCommMode, _label, _per_axis
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron_fsdp_v2 import fully_shard

# private: counts the units' parameter groups (state_of(unit).groups)
from megatron_fsdp_v2._registry import state_of
from megatron_fsdp_v2.testing._pool import _clear_dtensor_caches

from _models import SmallMLP, all_ranks_ok
from _pool import RankPools
from _training import train_steps

spmd = pytest.importorskip("spmd_types", reason="a test dependency (scripts/install.sh)")
DataParallelMeshDims = getattr(torch_fsdp, "DataParallelMeshDims", None)
pytestmark = pytest.mark.skipif(DataParallelMeshDims is None,
                                reason="torch.distributed.fsdp has no DataParallelMeshDims")

TIMEOUT_S = 240
WORLD = 4
# (mesh shape, dim names, DataParallelMeshDims kwargs): torchtitan's dp_shard x tp, and HSDP x
# tp at 4 ranks (replicate 2 x shard 1 x tp 2; the size-1 shard dim is dropped from annotations).
MESHES = {
    "fsdp_tp": ((2, 2), ("dp", "tp"), dict(shard="dp")),
    "hsdp_tp": ((2, 1, 2), ("rep", "dp", "tp"), dict(shard="dp", replicate="rep")),
}
SEQ, D_IN, D_HID = 4, 6, 8
ROWS = 2  # per dp rank and step


class SpMlp(nn.Module):
    """``x * n1 -> a (colwise) -> relu -> b (rowwise) -> * g`` on (batch, SEQ, D_IN) inputs;
    single-process when ``tp`` is None, else sequence-parallel TP over the group ``tp`` with
    the annotations of :data:`TYPES` (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.n1 = nn.Parameter(torch.empty(D_IN))
        self.a = nn.Linear(D_IN, D_HID)
        self.b = nn.Linear(D_HID, D_IN)
        self.g = nn.Parameter(torch.empty(D_IN))
        self.tp: dist.ProcessGroup | None = None
        self.seen: list[tuple[type, dict[Any, Any]]] = []  # what forward computed with
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.n1.uniform_(0.5, 1.5)
            self.g.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.b(F.relu(self.a(x * self.n1))) * self.g
        tp = self.tp
        self.seen.append((type(self.a.weight), dict(spmd.get_local_type(self.a.weight))))
        xs = spmd.convert(x, tp, src=spmd.R, dst=spmd.S(1))  # this rank's tokens
        y = spmd.all_gather(xs * self.n1, tp, src=spmd.S(1), dst=spmd.R)
        h = F.relu(F.linear(y, self.a.weight, self.a.bias))
        partial = spmd.reinterpret(F.linear(h, self.b.weight), tp, src=spmd.V, dst=spmd.P)
        z = spmd.reduce_scatter(partial, tp, src=spmd.P, dst=spmd.S(1))
        out = spmd.all_gather(z + self.b.bias, tp, src=spmd.S(1), dst=spmd.I)
        return out * self.g


# (module path, parameter, type on tp): torchtitan's colwise/rowwise/norm annotations.
TYPES = (("", "n1", spmd.R), ("a", "weight", spmd.S(0)), ("a", "bias", spmd.S(0)),
         ("b", "weight", spmd.S(1)), ("b", "bias", spmd.R), ("", "g", spmd.I))


def _annotate(model: SpMlp, mesh: DeviceMesh, types: Any = TYPES) -> SpMlp:
    """Each parameter replaced by this rank's TP-local piece, a plain tensor annotated ``R`` on
    the data-parallel dims and its type on ``tp`` (torchtitan's ``_spmd_distribute_state``)."""
    names = mesh.mesh_dim_names or ()
    tp = mesh.get_group("tp")
    model.tp = tp
    for path, name, tp_type in types:
        module = model.get_submodule(path)
        value = getattr(module, name).detach()
        if isinstance(tp_type, spmd.Shard):
            value = value.chunk(dist.get_world_size(tp), dim=tp_type.dim)[dist.get_rank(tp)]
        param = nn.Parameter(value.clone())
        module.register_parameter(name, param)
        axes = {mesh.get_group(n): spmd.R for n in names if n != "tp"}
        spmd.assert_type(param, {**axes, tp: tp_type})
    return model


def _dp_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """(this rank's data-parallel index, dp size), row-major over the non-tp dims."""
    names = mesh.mesh_dim_names or ()
    rank, size = 0, 1
    for i, name in enumerate(names):
        if name != "tp":
            rank, size = rank * mesh.size(i) + mesh.get_local_rank(name), size * mesh.size(i)
    return rank, size


def _batches(steps: int, dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS * dp, SEQ, D_IN, generator=g),
             torch.randn(ROWS * dp, SEQ, D_IN, generator=g)) for _ in range(steps)]


def _rank_run(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]],
              dp_rank: int | None, counts: list[tuple[Counter, Counter]] | None = None
              ) -> list[float]:
    """AdamW steps, gradients clipped by torch's ``clip_grad_norm_`` below every norm (so the
    norm matters). ``dp_rank`` None: the single-process reference on the whole batch; else this
    dp rank's rows. Returns the global mean losses, then the gradient norms. ``counts``: gets
    each iteration's collectives by (op, ranks): forward and backward, then clip and step."""
    fwd_bwd: list[GroupCommMode] = []
    # Clip, step and zero_grad counted together: entered before the clip, left after the step.
    after, after_comm = contextlib.ExitStack(), []
    norm_of_step: list[torch.Tensor] = []

    @contextlib.contextmanager
    def counted(step: int) -> Iterator[None]:
        with GroupCommMode() as comm:
            yield
        fwd_bwd.append(comm)

    def clip(step: int) -> None:
        after_comm.append(after.enter_context(GroupCommMode()))
        norm_of_step.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))

    def after_step(step: int) -> None:
        after.close()
        if counts is not None:
            counts.append((fwd_bwd[-1].by_group, after_comm[-1].by_group))

    def rows(parts: tuple[torch.Tensor, torch.Tensor], r: int | None) -> tuple[torch.Tensor, ...]:
        return parts if r is None else tuple(t[ROWS * r: ROWS * (r + 1)] for t in parts)

    per_step = train_steps(model, torch.optim.AdamW(model.parameters(), lr=0.05),
                           [[batch] for batch in data], lambda m, b: F.mse_loss(m(b[0]), b[1]),
                           rank=dp_rank, select=rows, mark=None, divide_by_micro=False,
                           around_backwards=counted, before_optimizer=clip,
                           after_step=after_step)
    norms = [float(n.full_tensor() if isinstance(n, DTensor) else n) for n in norm_of_step]
    losses = []
    for (mean,) in per_step:
        if dp_rank is not None:  # every rank of a dp rank's TP group holds the same loss
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        losses.append(float(mean))
    return losses + norms


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def _close(what: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    if sorted(got) != sorted(want):
        return [f"{what}: names {sorted(got)} vs {sorted(want)}"]
    return [f"{what}: {k} differs by {(got[k] - want[k]).abs().max():.3g}"
            for k in want if not torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-6)]


def _mesh(case: str) -> tuple[DeviceMesh, Any]:
    shape, names, dims = MESHES[case]
    return init_device_mesh("cpu", shape, mesh_dim_names=names), DataParallelMeshDims(**dims)


def _fsdp2_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` for FSDP2, which wants its DTensors on that very object: DTensor's sharding
    caches, keyed by mesh equality, may hand back an equal mesh of an earlier case in the same
    rank pool, so they are emptied first."""
    _clear_dtensor_caches()
    return mesh


def _names(mesh: DeviceMesh) -> dict[tuple[int, ...], str]:
    """The process groups of ``mesh``'s dims (and the whole world) by their ranks."""
    out = {tuple(range(WORLD)): "world"}
    for name in mesh.mesh_dim_names or ():
        out.setdefault(tuple(dist.get_process_group_ranks(mesh.get_group(name))), name)
    return out


def _parity_worker(rank: int, world: int, case: str, strategy: str) -> list[str]:
    mesh, dims = _mesh(case)
    dp_rank, dp = _dp_rank(mesh)
    torch.manual_seed(0)
    base = SpMlp()
    data = _batches(3, dp)
    want = _rank_run(copy.deepcopy(base), data, None)
    ref = copy.deepcopy(base)
    _rank_run(ref, data, None)
    want_params = _full(ref)
    ours = _annotate(copy.deepcopy(base), mesh)
    fully_shard(ours, mesh=mesh, dp_mesh_dims=dims, sharding_strategy=strategy)
    control = _annotate(copy.deepcopy(base), mesh)
    fsdp2_fully_shard(control, mesh=_fsdp2_mesh(mesh), dp_mesh_dims=dims)
    errors: list[str] = []
    counts: dict[str, list[tuple[Counter, Counter]]] = {"ours": [], "FSDP2": []}
    for who, model in (("ours", ours), ("FSDP2", control)):
        got = _rank_run(model, data, dp_rank, counts[who])
        if not torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5):
            errors.append(f"{who}: losses and norms {got} vs single process {want}")
        errors += _close(f"{who}: parameter", _full(model), want_params)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        errors += _close(f"{who}: torch full state dict", dict(full), want_params)
        # What forward computed with: the plain TP-local parameter (FSDP2's carries its
        # annotations only under type checking; ours keeps them: the user's object).
        seen = model.seen[-1]  # type: ignore[index]
        if seen[0] is not nn.Parameter or (who == "ours" and not seen[1]):
            errors.append(f"{who}: forward computed with a {seen[0].__name__} annotated {seen[1]}")
    for (name, p), q in zip(ours.named_parameters(), control.parameters()):
        if not isinstance(p, DTensor) or (tuple(p.placements), p.device_mesh.shape) != (
                tuple(q.placements), q.device_mesh.shape):
            errors.append(f"{name}: {type(p).__name__} {getattr(p, 'placements', None)}, "
                          f"FSDP2 {q.placements} on {q.device_mesh}")
        if spmd.get_local_type(p):
            errors.append(f"{name}: the optimizer-facing parameter carries annotations")
    groups = sum(len(s.groups) for m in ours.modules() if (s := state_of(m)) is not None)
    errors += _count_errors(mesh, counts, strategy, groups)
    if not all_ranks_ok(not errors):
        errors = errors or ["failed on another rank"]
    return [f"{case} {strategy} rank {rank}: {e}" for e in errors]


# design.md §4 per flat group and iteration of one micro-batch, over the shard dim.
_DP_TABLE = {"optim_grads_params": {"AG": 2, "RS": 1}, "optim": {"AG": 1, "RS": 1}}
# clip_grad_norm_: one all-reduce per distinct group: dp x tp for the parameters TP shards, the
# data-parallel dims for the others (the shard dim; under HSDP outer no_shard the norm of the
# replicated gradients is the shard dim's, here of size 1; FSDP2 skips that one).
_CLIP = {"fsdp_tp": Counter({("AR", "world"): 1, ("AR", "dp"): 1}),
         "hsdp_tp": Counter({("AR", "dp"): 1, ("AR", "tp"): 1})}


def _count_errors(mesh: DeviceMesh, counts: dict[str, list[tuple[Counter, Counter]]],
                  strategy: str, groups: int) -> list[str]:
    """Collectives per iteration (from the second: the first has the lazy init). Forward and
    backward: over tp exactly FSDP2's (the model's own, and the TP all-reduce of each ``R``
    parameter's gradient); over the shard dim design.md §4's table per flat group; over the
    replicate dim (HSDP) one all-reduce per group. Clip and step: ``_CLIP``."""
    names = _names(mesh)
    case = "hsdp_tp" if "rep" in names.values() else "fsdp_tp"
    # (Over a shard dim of size 1 too: the library issues them there, trivially.)
    want_dp = Counter({op: n * groups for op, n in _DP_TABLE[strategy].items()})
    want_rep = Counter({"AR": groups} if case == "hsdp_tp" else {})
    errors = []
    for step in (1, 2):
        ours, after = (_label(c, names) for c in counts["ours"][step])
        control = _label(counts["FSDP2"][step][0], names)
        checks = (("tp", _per_axis(ours, "tp"), _per_axis(control, "tp")),
                  ("dp", _per_axis(ours, "dp"), want_dp),
                  ("rep", _per_axis(ours, "rep"), want_rep),
                  ("clip and step", after, _CLIP[case]))
        for where, got, want in checks:
            if got != want:
                errors.append(f"step {step}: {where}: {dict(got)}, want {dict(want)}")
        others = {k: n for k, n in ours.items() if k[1] not in ("tp", "dp", "rep")}
        if others:
            errors.append(f"step {step}: forward and backward also issued {others}")
    return errors


@pytest.mark.parametrize("case,strategy", [
    ("fsdp_tp", "optim_grads_params"),
    ("hsdp_tp", "optim_grads_params"),
    ("fsdp_tp", "optim"),
])
def test_parity_with_fsdp2(ranks: RankPools, case: str, strategy: str) -> None:
    failures = [e for r in ranks.run(_parity_worker, WORLD, case, strategy,
                                     timeout_s=TIMEOUT_S) for e in r]
    assert not failures, "\n".join(failures[:20])


# ---------------------------------------------------------------- spmd_types' type checker

def _typecheck_worker(rank: int, world: int) -> list[str]:
    """Training steps under ``spmd_types``' strict type checker (torchtitan's
    ``--debug.spmd_typechecking``): inputs ``V`` on dp and ``R`` on tp (labels ``I``), the loss
    made ``P`` on dp. Ours and FSDP2 run it with single-process losses (no checker there), and
    forward sees the parameter's annotations."""
    from spmd_types.checker import typecheck

    mesh, dims = _mesh("fsdp_tp")
    dp_rank, dp = _dp_rank(mesh)
    torch.manual_seed(0)
    base = SpMlp()
    data = _batches(2, dp)
    want = _rank_run(copy.deepcopy(base), data, None)[:2]
    errors = []
    for who in ("ours", "FSDP2"):
        model = _annotate(copy.deepcopy(base), mesh)
        if who == "ours":
            fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
        else:
            fsdp2_fully_shard(model, mesh=_fsdp2_mesh(mesh), dp_mesh_dims=dims)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        losses = []
        for x, y in data:
            rows = slice(ROWS * dp_rank, ROWS * (dp_rank + 1))
            x, y = x[rows].clone(), y[rows].clone()
            for t, on_tp in ((x, spmd.R), (y, spmd.I)):  # torchtitan's inputs and labels
                spmd.assert_type(t, {mesh.get_group("dp"): spmd.V, mesh.get_group("tp"): on_tp})
            with typecheck(strict_mode="strict"):
                loss = F.mse_loss(model(x), y)
                spmd.reinterpret(loss, mesh.get_group("dp"), src=spmd.V, dst=spmd.P).backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
        if not torch.allclose(torch.tensor(losses), torch.tensor(want), rtol=1e-5):
            errors.append(f"{who}: losses {losses} vs single process {want}")
        if not model.seen[-1][1]:  # type: ignore[index]
            errors.append(f"{who}: forward saw no annotations")
    if not all_ranks_ok(not errors):
        errors = errors or ["failed on another rank"]
    return [f"rank {rank}: {e}" for e in errors]


def test_type_checker(ranks: RankPools) -> None:
    failures = [e for r in ranks.run(_typecheck_worker, WORLD, timeout_s=TIMEOUT_S) for e in r]
    assert not failures, "\n".join(failures[:20])


# ---------------------------------------------------------------- checkpoints across tp sizes

def _checkpoint_worker(rank: int, world: int, path: str) -> list[str]:
    """Saved (DCP, torch's ``get_model_state_dict``) after two steps at dp 2 x tp 2 by ours and
    by FSDP2; each loaded at tp 1, dp 4 by ours and by FSDP2 (plain parameters on a 1-D mesh):
    the full parameters are single-process training's, and a further step from them too."""
    mesh, dims = _mesh("fsdp_tp")
    dp_rank, dp = _dp_rank(mesh)
    torch.manual_seed(0)
    base = SpMlp()
    ref = copy.deepcopy(base)
    data = _batches(2, dp)
    _rank_run(ref, data, None)
    want_params = _full(ref)
    more = _batches(3, 4)[2:]  # a global batch for dp 4
    want_more = _rank_run(copy.deepcopy(ref), more, None)
    ref_after = copy.deepcopy(ref)
    _rank_run(ref_after, more, None)
    errors: list[str] = []
    for who, wrap in (("ours", fully_shard), ("FSDP2", fsdp2_fully_shard)):
        model = _annotate(copy.deepcopy(base), mesh)
        if who == "ours":
            wrap(model, mesh=mesh, dp_mesh_dims=dims)
        else:
            wrap(model, mesh=_fsdp2_mesh(mesh), dp_mesh_dims=dims)
        _rank_run(model, data, dp_rank)
        dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(path, who))
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for saved in ("ours", "FSDP2"):
        for who, wrap in (("ours", fully_shard), ("FSDP2", fsdp2_fully_shard)):
            model = SpMlp()
            wrap(model, mesh=flat)
            state = get_model_state_dict(model)
            dcp.load(state, checkpoint_id=os.path.join(path, saved))
            set_model_state_dict(model, state)
            what = f"saved by {saved} at tp 2, loaded by {who} at tp 1"
            errors += _close(what, _full(model), want_params)
            got = _rank_run(model, more, flat.get_local_rank())
            if not torch.allclose(torch.tensor(got), torch.tensor(want_more), rtol=1e-5):
                errors.append(f"{what}: the next step's loss and norm {got} vs {want_more}")
            errors += _close(f"{what}, one step on", _full(model), _full(ref_after))
    if not all_ranks_ok(not errors):
        errors = errors or ["failed on another rank"]
    return [f"rank {rank}: {e}" for e in errors]


def test_checkpoint_across_tp_sizes(ranks: RankPools, tmp_path: Any) -> None:
    failures = [e for r in ranks.run(_checkpoint_worker, WORLD, str(tmp_path),
                                     timeout_s=TIMEOUT_S) for e in r]
    assert not failures, "\n".join(failures[:20])


# ---------------------------------------------------------------- built on the meta device

def _dtensor_params(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``SmallMLP`` (5 -> 7 -> 3: uneven over tp) as the ``full_dtensor`` backend leaves it:
    DTensors on the SPMD mesh (``a`` colwise, ``b`` rowwise over tp, ``Replicate()`` on dp),
    built from the TP-local pieces (on meta too)."""
    tp = mesh.get_local_rank("tp"), mesh.size((mesh.mesh_dim_names or ()).index("tp"))
    for layer, tp_w, tp_b in ((model.a, Shard(0), Shard(0)), (model.b, Shard(1), Replicate())):
        for name, placement in (("weight", tp_w), ("bias", tp_b)):
            value = getattr(layer, name).detach()
            shape, stride = value.shape, value.stride()
            if isinstance(placement, Shard):
                value = value.chunk(tp[1], dim=placement.dim)[tp[0]]
            placements = [placement if n == "tp" else Replicate()
                          for n in mesh.mesh_dim_names or ()]
            layer.register_parameter(name, nn.Parameter(
                DTensor.from_local(value.clone(), mesh, placements, run_check=False,
                                   shape=shape, stride=stride)))
    return model


def _train_dtensor(model: nn.Module, mesh: DeviceMesh | None, dp_rank: int, dp: int
                   ) -> list[float]:
    """Two AdamW steps of ``SmallMLP`` on ``ROWS * dp`` rows: this dp rank's rows as a DTensor
    replicated over ``mesh`` (``None``: the single-process reference on all rows). Returns the
    global mean losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):
        x, y = torch.randn(ROWS * dp, 5, generator=g), torch.randn(ROWS * dp, 3, generator=g)
        if mesh is not None:
            rows = slice(ROWS * dp_rank, ROWS * (dp_rank + 1))
            x, y = x[rows], y[rows]
            out = model(DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim)).full_tensor()
        else:
            out = model(x)
        loss = F.mse_loss(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if mesh is not None:
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        losses.append(float(mean))
    return losses


def _meta_worker(rank: int, world: int, kind: str, path: str) -> list[str]:
    """TP parameters built on meta (``spmd_types`` annotated, or DTensors), wrapped, then
    ``to_empty`` and the values loaded from a DCP checkpoint of the model built on the device
    (torchtitan's checkpoint-initialized start: ``get_model_state_dict``, ``dcp.load``,
    ``set_model_state_dict``), by ours and by FSDP2: the same
    training as from the model built on the device. Without ``to_empty`` ours refuses to
    materialize them (its ``reset_parameters`` on a piece would not draw the whole values)."""
    mesh, dims = _mesh("fsdp_tp")
    dp_rank, dp = _dp_rank(mesh)
    cls = SpMlp if kind == "spmd_types" else SmallMLP
    torch.manual_seed(0)
    base = cls()
    dcp.save(base.state_dict(), checkpoint_id=path)  # plain tensors: replicated

    def build() -> nn.Module:
        with torch.device("meta"):
            model = cls()
        return _annotate(model, mesh) if kind == "spmd_types" else _dtensor_params(model, mesh)

    def train(model: nn.Module) -> list[float]:
        if kind == "spmd_types":
            return _rank_run(model, _batches(2, dp), None if model is ref else dp_rank)
        return _train_dtensor(model, None if model is ref else mesh, dp_rank, dp)

    ref = copy.deepcopy(base)
    want = train(ref)
    errors: list[str] = []
    for who, wrap in (("ours", fully_shard), ("FSDP2", fsdp2_fully_shard)):
        model = build()
        wrap(model, mesh=mesh if who == "ours" else _fsdp2_mesh(mesh), dp_mesh_dims=dims)
        model.to_empty(device="cpu")
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state)
        got = train(model)
        if not torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5):
            errors.append(f"{who}: losses and norms {got} vs single process {want}")
        errors += _close(f"{who}: parameter", _full(model), _full(ref))
    model = build()
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    try:
        model.state_dict()  # would materialize
        errors.append("ours: materialized tensor-parallel meta parameters")
    except RuntimeError as e:
        first = "'n1'" if kind == "spmd_types" else "'a.weight'"
        if "to_empty" not in str(e) or first not in str(e):
            errors.append(f"ours: unclear refusal: {e}")
    if not all_ranks_ok(not errors):
        errors = errors or ["failed on another rank"]
    return [f"{kind} rank {rank}: {e}" for e in errors]


@pytest.mark.parametrize("kind", ["spmd_types", "dtensor"])
def test_meta_tp_params(ranks: RankPools, kind: str, tmp_path: Any) -> None:
    failures = [e for r in ranks.run(_meta_worker, WORLD, kind, str(tmp_path),
                                     timeout_s=TIMEOUT_S) for e in r]
    assert not failures, "\n".join(failures[:20])


# ---------------------------------------------------------------- refused as FSDP2 refuses

# (case, a.weight's annotation on (dp, tp), our error type, message needle, FSDP2 refuses too)
BAD = [
    ("bare V", (spmd.R, spmd.V), ValueError, "without a partition spec", True),
    ("V on dp", (spmd.V, spmd.S(0)), ValueError, "requires R there", True),
    ("no tp type", (spmd.R, None), ValueError, "no type on the mesh dim 'tp'", True),
    ("P on tp", (spmd.R, spmd.P), NotImplementedError, "P (partial)", False),
]


def _errors_worker(rank: int, world: int) -> list[str]:
    """Each refusal names the parameter and the fix, before any collective but fully_shard's
    cross-rank agreement on the wrap, the module left as it was; FSDP2 (the control) refuses
    the same annotations, except a partial ``P`` parameter (stored as a ``Partial()`` DTensor)."""
    mesh, dims = _mesh("fsdp_tp")
    errors = []
    for case, (on_dp, on_tp), error, needle, fsdp2_refuses in BAD:
        for who in ("ours", "FSDP2"):
            torch.manual_seed(0)
            model = _annotate(SpMlp(), mesh)
            param = nn.Parameter(model.a.weight.detach().clone())
            model.a.register_parameter("weight", param)
            types = {mesh.get_group("dp"): on_dp}
            if on_tp is not None:
                types[mesh.get_group("tp")] = on_tp
            spmd.assert_type(param, types)
            try:
                with GroupCommMode() as comm:
                    if who == "ours":
                        fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
                    else:
                        fsdp2_fully_shard(model, mesh=_fsdp2_mesh(mesh), dp_mesh_dims=dims)
            except (ValueError, NotImplementedError) as e:
                if who == "FSDP2":
                    if not fsdp2_refuses:
                        errors.append(f"{case}: FSDP2 refused it ({e})")
                    continue
                if type(e) is not error or needle not in str(e) or "'a.weight'" not in str(e):
                    errors.append(f"{case}: {type(e).__name__}: {e}")
                # Only fully_shard's cross-rank agreement on the wrap (one all-gather), which
                # makes every rank raise together.
                if set(op for op, _ in _label(comm.by_group, {})) - {"AG"} or sum(
                        comm.by_group.values()) > 1 or type(model) is not SpMlp:
                    errors.append(f"{case}: collectives {dict(comm.by_group)} or module changed")
            else:
                if who == "ours" or fsdp2_refuses:
                    errors.append(f"{case}: {who} accepted it")
    if not all_ranks_ok(not errors):
        errors = errors or ["failed on another rank"]
    return [f"rank {rank}: {e}" for e in errors]


def test_refusals_match_fsdp2(ranks: RankPools) -> None:
    failures = [e for r in ranks.run(_errors_worker, WORLD, timeout_s=TIMEOUT_S) for e in r]
    assert not failures, "\n".join(failures[:20])
