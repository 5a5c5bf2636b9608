"""Hostile checkpoints of expert-parallel models (``examples/train_moe.py``: each EP rank's
experts a unit on the ``edp`` sub-mesh, dense units on the world), issue 36 item 7.

* ``checkpoint.save`` / ``load`` store every expert under its global index (declared with
  ``checkpoint.register_experts``; the example numbers experts in contiguous blocks per EP rank,
  ``moe_model.local_expert_indices``) and reshard across EP sizes: a checkpoint saved at
  ep=2 x edp=2 (4 ranks) loads at ep=2 x edp=2, ep=1 x edp=4 and ep=4 x edp=1, and at world 2
  (ep=1 x edp=2, ep=2 x edp=1, and a model without expert parallelism nor registration), each
  with the same numbers: every parameter and optimizer state, gathered to full form under
  global names, equals the saved model's bitwise, and a training step after the load equals
  one process holding every expert, loaded with the same numbers, on the global batch. One
  world-2 load goes through ``dcp.load`` with the library's ``get_state_dict`` /
  ``set_state_dict``. Experts in a param group of their own keep its hyperparameters at every
  EP size. ``get_full_state_dict`` is one process's state dict (every expert, global names,
  its key order) and ``load_full_state_dict`` loads it at other EP sizes. FSDP2 has no such
  feature (its full state dict holds EP rank 0's experts only; its DCP control is below).
  Before: ``checkpoint.save`` and ``get_full_state_dict`` refused the model ("communicate over
  different ranks"), with no way to declare experts.
* torch's API (``get_state_dict`` + ``dcp.save``) with per-rank local expert names raises at
  the save, naming the problem and the fix, for the model and for the optimizer state alone;
  the FSDP2 control shows what it prevents: FSDP2 saves and reloads another EP rank's experts
  without a word. Experts registered with global names (an ``nn.ModuleDict`` keyed by global
  index) save and load through torch's API exactly. Before: the save succeeded and the load
  gave EP rank 1 the experts of EP rank 0.
* Bad declarations fail early and clearly on every rank, with nothing written: an unregistered
  EP model names ``register_experts``; two EP ranks registering the same global indices are
  named; ``register_experts`` rejects bad indices before storing anything.

SGD would hide nothing here, but AdamW makes the optimizer state worth checking (``exp_avg``,
``exp_avg_sq``, ``step``).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _fsdp2_api import _param_errors
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import checkpoint as mckpt
from megatron_fsdp_v2 import iter_full_weights

# private: a parameter's shard rows (record_of(p).local_rows)
from megatron_fsdp_v2._registry import record_of

from _models import agree
from _pool import RankPools

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from moe_model import MoEGPT, keep_local_experts, local_expert_indices  # noqa: E402
from train_moe import (  # noqa: E402
    build_meshes,
    build_model,
    config_from,
    make_parser,
    step_batches,
    train_step,
    wrap,
)

TIMEOUT_S = 120
TINY = ["--micro-batches", "2", "--batch-size", "2", "--seq-len", "8", "--dim", "16",
        "--hidden", "24", "--layers", "2", "--heads", "2", "--vocab", "32", "--experts", "4",
        "--top-k", "2"]
SAVED_STEPS = 2  # steps trained before the save
# A step after the load against one process: Adam divides by sqrt(exp_avg_sq), so a parameter
# with tiny gradients (an attention bias) moves by lr-sized steps that amplify summation-order
# differences to ~1e-6; a wrong expert or state is off by ~lr = 1e-2.
STEP_RTOL, STEP_ATOL = 1e-4, 1e-5
EXPERT = re.compile(r"^(.*\.experts\.experts)\.(\d+)\.(.*)$")


# ---------------------------------------------------------------------- helpers

def _args(ep: int) -> Any:
    return make_parser().parse_args([*TINY, "--ep", str(ep)])


def _register(model: nn.Module, ep_rank: int, ep: int) -> None:
    for block in model.blocks:  # type: ignore[union-attr]
        experts = block.moe.experts.experts
        mckpt.register_experts(
            experts, local_expert_indices(block.moe.num_experts, ep_rank, ep))


def _ep_model(ep: int, strategy: str, seed: int, *, register: bool = True,
              fsdp2: bool = False) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    """train_moe.py's model at ``ep`` x (world / ep) and an AdamW over it."""
    args = _args(ep)
    flat, ep_mesh = build_meshes(ep, torch.device("cpu"))
    model = build_model(config_from(args), seed, ep_mesh, torch.device("cpu"))
    if register:
        _register(model, ep_mesh.get_local_rank("ep"), ep)
    wrap(model, flat, ep_mesh, fsdp2=fsdp2, **({} if fsdp2 else {"sharding_strategy": strategy}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, args, ep_mesh


def _global_name(name: str, ep_rank: int, local: int) -> str:
    """The name one process holding every expert gives this rank's parameter ``name`` (the
    example's numbering, computed here independently of the library)."""
    m = EXPERT.match(name)
    if m is None:
        return name
    return f"{m.group(1)}.{ep_rank * local + int(m.group(2))}.{m.group(3)}"


def _local_part(p: torch.Tensor, value: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(first global row, rows) of ``value`` (``p`` or a state shaped like it) on this rank."""
    if isinstance(p, DTensor) and record_of(p) is not None:
        lo, _ = record_of(p).local_rows  # type: ignore[union-attr]
        return lo, value.to_local().detach().clone()
    if isinstance(value, DTensor):  # FSDP2's (torch.chunk rows): the whole tensor
        return 0, value.full_tensor().detach().clone()
    return 0, value.detach().clone()


def full_form(model: nn.Module, opt: torch.optim.Optimizer, ep_rank: int, ep: int,
              experts: int) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW state of the whole (every rank's) model under global names, as
    full tensors, on every rank: each rank's rows, gathered."""
    local = experts // ep
    parts = []
    for name, p in model.named_parameters():
        key = _global_name(name, ep_rank, local)
        lo, param_rows = _local_part(p, p)
        parts.append((key, tuple(p.shape), lo, param_rows))
        state = opt.state.get(p, {})
        for s in ("exp_avg", "exp_avg_sq"):
            if s in state:
                lo, rows = _local_part(p, state[s])
                parts.append((f"{key}:{s}", tuple(p.shape), lo, rows))
        if "step" in state and param_rows.shape[0] > 0:  # a rank without rows never steps it
            parts.append((f"{key}:step", (), 0, state["step"].detach().clone()))
    everything: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, parts)
    full: dict[str, torch.Tensor] = {}
    for rank_parts in everything:
        for key, shape, lo, rows in rank_parts:
            if not shape:
                full[key] = rows
                continue
            target = full.setdefault(key, torch.full(shape, float("nan")))
            target[lo:lo + rows.shape[0]] = rows
    return full


def _differences(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    problems = [f"missing {k}" for k in expected if k not in actual]
    problems += [f"unexpected {k}" for k in actual if k not in expected]
    problems += [f"{k} differs (max {float((actual[k] - v).abs().nan_to_num(1e9).max()):.3g})"
                 for k, v in expected.items() if k in actual and not torch.equal(actual[k], v)]
    return problems


def _train(model: nn.Module, opt: torch.optim.Optimizer, args: Any, steps: range,
           ep_mesh: Any) -> None:
    for step in steps:
        train_step(model, step_batches(args, step, dist.get_rank()), opt,
                   ep_group=ep_mesh["ep"].get_group())


def _reference_step(full: dict[str, torch.Tensor], args: Any, step: int) -> MoEGPT:
    """One process holding every expert, with the parameters and AdamW state ``full``, after
    one step on the global batch of this world's ranks."""
    ref = MoEGPT(config_from(args))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(full[name])
            opt.state[p] = {"step": full[f"{name}:step"].clone(),
                            "exp_avg": full[f"{name}:exp_avg"].clone(),
                            "exp_avg_sq": full[f"{name}:exp_avg_sq"].clone()}
    world = dist.get_world_size()
    per_rank = [step_batches(args, step, r) for r in range(world)]
    global_batches = [torch.cat([b[i] for b in per_rank]) for i in range(args.micro_batches)]
    train_step(ref, global_batches, opt)
    return ref


def _check_loaded(model: nn.Module, opt: torch.optim.Optimizer, args: Any, ep_mesh: Any,
                  saved: dict[str, torch.Tensor], what: str) -> None:
    """``model`` (just loaded) holds ``saved`` exactly, and trains one step like one process."""
    ep, ep_rank = ep_mesh.size(0), ep_mesh.get_local_rank("ep")
    loaded = full_form(model, opt, ep_rank, ep, args.experts)
    agree(f"{what}: loaded = saved (bitwise)", lambda: _assert_no(_differences(loaded, saved)))
    ref = _reference_step(loaded, args, SAVED_STEPS)
    _train(model, opt, args, range(SAVED_STEPS, SAVED_STEPS + 1), ep_mesh)
    keep_local_experts(ref, ep_rank, ep, None)  # this rank's view, local names
    agree(f"{what}: a step after the load = one process",
          lambda: _assert_no(_param_errors(model, ref, rtol=STEP_RTOL, atol=STEP_ATOL)))


def _assert_no(problems: list[str]) -> None:
    assert not problems, f"{len(problems)} problems: " + "; ".join(problems[:4])


# ---------------------------------------------------------------------- point 1: our API

def _save_worker(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    model, opt, args, ep_mesh = _ep_model(2, "optim_grads_params", seed=0)
    _train(model, opt, args, range(SAVED_STEPS), ep_mesh)
    mckpt.save(model, opt, checkpoint_id=path, extra={"step": SAVED_STEPS})
    return full_form(model, opt, ep_mesh.get_local_rank("ep"), 2, args.experts)


@pytest.fixture(scope="module")
def saved_ep2(ranks: RankPools) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """A checkpoint of the ep=2 x edp=2 model (ZeRO-3, 2 AdamW steps), and the model gathered
    to full form under global names."""
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "ep2_ckpt")
        full = ranks.run(_save_worker, 4, path, timeout_s=TIMEOUT_S)[0]
        yield path, full


LAYOUTS_4 = [(2, "optim_grads_params", "load"), (1, "no_shard", "load"), (4, "optim", "load")]
LAYOUTS_2 = [(1, "optim_grads", "load"), (2, "optim_grads_params", "dcp")]


def _load_worker(rank: int, world: int, path: str, saved: dict[str, torch.Tensor],
                 layouts: list[tuple[int, str, str]], plain: bool) -> None:
    for ep, strategy, how in layouts:
        model, opt, args, ep_mesh = _ep_model(ep, strategy, seed=1)  # other values first
        if how == "load":
            out = mckpt.load(model, opt, checkpoint_id=path, extra={"step": -1})
            assert out["step"] == SAVED_STEPS, out
        else:  # DCP directly, with the library's state-dict functions
            msd, osd = mckpt.get_state_dict(model, opt)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
            mckpt.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        _check_loaded(model, opt, args, ep_mesh, saved, f"ep={ep} x edp={world // ep} "
                      f"{strategy} ({how})")
    if plain:
        # Without expert parallelism nor any registration: the checkpoint's names are the
        # names of one process holding every expert.
        model, opt, args, ep_mesh = _ep_model(1, "optim_grads_params", seed=1, register=False)
        mckpt.load(model, opt, checkpoint_id=path)
        _check_loaded(model, opt, args, ep_mesh, saved, "no EP, nothing registered")


def test_ep_checkpoint_reshards_across_ep_sizes(
        ranks: RankPools, saved_ep2: tuple[str, dict[str, torch.Tensor]]) -> None:
    """Saved at ep=2 x edp=2, loaded at ep=2 x edp=2 (ZeRO-3), ep=1 x edp=4 (no_shard: every
    rank holds every expert) and ep=4 x edp=1 (optim: one expert per rank, units of one
    rank)."""
    path, saved = saved_ep2
    ranks.run(_load_worker, 4, path, saved, LAYOUTS_4, False, timeout_s=TIMEOUT_S)


def test_ep_checkpoint_loads_at_world_2(
        ranks: RankPools, saved_ep2: tuple[str, dict[str, torch.Tensor]]) -> None:
    """The 4-rank checkpoint at world 2: ep=1 x edp=2, ep=2 x edp=1 (through ``dcp.load`` and
    the library's ``get_state_dict`` / ``set_state_dict``), and a model without expert
    parallelism and without registration."""
    path, saved = saved_ep2
    ranks.run(_load_worker, 2, path, saved, LAYOUTS_2, True, timeout_s=TIMEOUT_S)


def _param_groups_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """An optimizer with the experts in a param group of their own (their own lr), saved at
    ep=2 x edp=2 and loaded at ep=4 and ep=1 into optimizers built with other lrs: each group
    gets its own lr back. The group's member names come from whichever rank DCP kept them
    of, which holds none of an ep=4 rank's experts."""
    def make(ep: int, lrs: tuple[float, float]) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        model, _, args, ep_mesh = _ep_model(ep, "optim_grads_params", seed=0)
        experts = [p for n, p in model.named_parameters() if ".experts.experts." in n]
        dense = [p for n, p in model.named_parameters() if ".experts.experts." not in n]
        opt = torch.optim.AdamW([{"params": dense, "lr": lrs[0]},
                                 {"params": experts, "lr": lrs[1]}])
        return model, opt, (args, ep_mesh)

    path = os.path.join(root, "groups")
    model, opt, (args, ep_mesh) = make(2, (1e-2, 3e-3))
    _train(model, opt, args, range(1), ep_mesh)
    mckpt.save(model, opt, checkpoint_id=path)
    out = {}
    for ep in (4, 1):
        fresh, fresh_opt, _ = make(ep, (0.5, 0.5))
        mckpt.load(fresh, fresh_opt, checkpoint_id=path)
        out[f"ep={ep}"] = [g["lr"] for g in fresh_opt.param_groups]
    return out


def test_ep_checkpoint_keeps_each_param_groups_hyperparameters(ranks: RankPools) -> None:
    with tempfile.TemporaryDirectory() as root:
        results = ranks.run(_param_groups_worker, 4, root, timeout_s=TIMEOUT_S)
    for rank, out in enumerate(results):
        for case, lrs in out.items():
            assert lrs == [1e-2, 3e-3], (rank, case, lrs)


# ---------------------------------------------------------------------- full state dicts

def _full_state_dict_worker(rank: int, world: int) -> dict[str, Any]:
    model, opt, args, ep_mesh = _ep_model(2, "optim_grads_params", seed=0)
    _train(model, opt, args, range(1), ep_mesh)
    saved = {k: v for k, v in full_form(model, opt, ep_mesh.get_local_rank("ep"), 2,
                                        args.experts).items() if ":" not in k}
    problems: dict[str, list[str]] = {}
    names = list(MoEGPT(config_from(args)).state_dict())  # one process holding every expert
    for rank0_only in (True, False):
        full = mckpt.get_full_state_dict(model, rank0_only=rank0_only)
        if rank0_only and rank != 0:
            problems[f"rank0_only={rank0_only}"] = [] if full == {} else ["not empty"]
            continue
        found = [f"keys {list(full)[:3]}... != one process's"] if list(full) != names else []
        found += [k for k in saved if k in full and not torch.equal(full[k], saved[k])]
        problems[f"rank0_only={rank0_only}"] = found
    sd = mckpt.get_full_state_dict(model, rank0_only=False)
    for ep, strategy, broadcast in ((4, "optim", False), (1, "optim_grads", True)):
        fresh, fresh_opt, _, fresh_mesh = _ep_model(ep, strategy, seed=1)
        mckpt.load_full_state_dict(fresh, sd if rank == 0 or not broadcast else None,
                                   broadcast_from_rank0=broadcast)
        loaded = full_form(fresh, fresh_opt, fresh_mesh.get_local_rank("ep"), ep, args.experts)
        problems[f"load ep={ep} broadcast={broadcast}"] = _differences(loaded, saved)
    # The FSDP2 control: torch's full state dict of the same EP model holds EP rank 0's
    # experts only, under names that look like a whole model's.
    fsdp2, _, _, _ = _ep_model(2, "", seed=0, register=False, fsdp2=True)
    torch_full = get_model_state_dict(
        fsdp2, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    experts = sorted({EXPERT.match(k).group(2) for k in torch_full  # type: ignore[union-attr]
                      if EXPERT.match(k)})
    return {"problems": problems, "fsdp2 experts": experts}


def test_ep_full_state_dict_holds_every_expert(ranks: RankPools) -> None:
    """``get_full_state_dict`` of the ep=2 x edp=2 model is one process's state dict (its keys
    in its order, every expert under its global index, the saved values bitwise), on rank 0
    or on every rank; ``load_full_state_dict`` of it at ep=4 (every rank passes it) and at
    ep=1 (broadcast from rank 0) gives the same numbers. Control: torch's full state dict of
    FSDP2's EP model holds experts 0 and 1 only. Before: a ``ValueError`` (units on different
    ranks)."""
    results = ranks.run(_full_state_dict_worker, 4, timeout_s=TIMEOUT_S)
    for rank, out in enumerate(results):
        for case, problems in out["problems"].items():
            assert not problems, (rank, case, problems[:4])
    assert results[0]["fsdp2 experts"] == ["0", "1"], results[0]["fsdp2 experts"]


# ---------------------------------------------------------------------- point 2: torch's API

def _torch_api_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for register in (False, True):
        model, opt, args, ep_mesh = _ep_model(2, "optim_grads_params", seed=0,
                                              register=register)
        _train(model, opt, args, range(1), ep_mesh)
        msd, osd = get_state_dict(model, opt)
        path = os.path.join(root, f"torch_api_{register}")
        for what, state in (("model", {"model": msd, "optim": osd}), ("optim", {"optim": osd})):
            error = None
            try:
                dcp.save(state, checkpoint_id=f"{path}_{what}")
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                error = str(exc)
            out[f"{what}, registered={register}"] = error
            out[f"{what}, registered={register}: written"] = os.path.exists(
                os.path.join(f"{path}_{what}", ".metadata"))
    return out


def _fsdp2_control_worker(rank: int, world: int, root: str) -> list[str]:
    """FSDP2, same model and API: it saves and reloads without a word. Returns, for every
    expert parameter (global names), how the two EP ranks' experts compare after the load."""
    model, opt, args, ep_mesh = _ep_model(2, "", seed=0, register=False, fsdp2=True)
    _train(model, opt, args, range(1), ep_mesh)
    ep_rank = ep_mesh.get_local_rank("ep")
    saved = full_form(model, opt, ep_rank, 2, args.experts)
    msd, osd = get_state_dict(model, opt)
    path = os.path.join(root, "fsdp2")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    fresh, fresh_opt, _, _ = _ep_model(2, "", seed=1, register=False, fsdp2=True)
    _train(fresh, fresh_opt, args, range(1), ep_mesh)  # optimizer state to load into
    msd, osd = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    loaded = full_form(fresh, fresh_opt, ep_rank, 2, args.experts)
    verdicts = []
    local = args.experts // 2
    for key in saved:
        m = EXPERT.match(key)
        if m is None or ":" in key or int(m.group(2)) >= local:
            continue
        mine, other = key, f"{m.group(1)}.{int(m.group(2)) + local}.{m.group(3)}"
        if torch.equal(loaded[mine], saved[mine]) and torch.equal(loaded[other], saved[other]):
            verdicts.append(f"{key}: right")
        elif torch.equal(loaded[mine], loaded[other]) and not torch.equal(saved[mine],
                                                                           saved[other]):
            verdicts.append(f"{key}: both EP ranks hold one EP rank's expert")
        else:
            verdicts.append(f"{key}: other")
    return verdicts


def test_torch_api_with_local_expert_names_raises_at_save(ranks: RankPools) -> None:
    """torch's ``get_state_dict`` + ``dcp.save`` of the EP model (experts ``experts.0`` on
    every EP rank), registered or not: DCP raises naming the lost experts and the fix, for
    the model and for the optimizer state alone; nothing is written. The FSDP2 control, the
    same run: it saves, and its reload silently gives EP rank 1 EP rank 0's experts."""
    with tempfile.TemporaryDirectory() as root:
        results = ranks.run(_torch_api_worker, 4, root, timeout_s=TIMEOUT_S)
        for rank, out in enumerate(results):
            for what in ("model", "optim"):
                for register in (False, True):
                    case = f"{what}, registered={register}"
                    error = out[case]
                    assert error is not None, f"rank {rank}: {case}: dcp.save lost experts"
                    for fragment in ("would lose experts", "experts.0.fc1.weight",
                                     "megatron_fsdp_v2.checkpoint.save/load",
                                     "register_experts"):
                        assert fragment in error, (rank, case, fragment, error[:600])
                    assert not out[f"{case}: written"], (rank, case)
        verdicts = ranks.run(_fsdp2_control_worker, 4, root, timeout_s=TIMEOUT_S)[0]
    # Every expert of the FSDP2 model: after the reload both EP ranks hold the same expert
    # (which EP rank's DCP wrote depends on its planner's balancing), where they held
    # different ones when saved.
    assert verdicts and all(v.endswith("both EP ranks hold one EP rank's expert")
                            for v in verdicts), verdicts


def _global_names_worker(rank: int, world: int, root: str) -> list[str]:
    """Experts keyed by global index (an nn.ModuleDict), declared with global names: torch's
    API saves and loads them exactly (no training: LocalExperts.forward wants a list)."""
    def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        args = _args(2)
        flat, ep_mesh = build_meshes(2, torch.device("cpu"))
        model = build_model(config_from(args), seed, ep_mesh, torch.device("cpu"))
        indices = local_expert_indices(args.experts, ep_mesh.get_local_rank("ep"), 2)
        for block in model.blocks:
            local = block.moe.experts
            local.experts = nn.ModuleDict(
                {str(g): e for g, e in zip(indices, local.experts)})
            mckpt.register_experts(local.experts)
        wrap(model, flat, ep_mesh, sharding_strategy="optim_grads_params")
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2), ep_mesh

    model, _, ep_mesh = make(0)
    saved = {k: v.to_local().clone() for k, v in model.state_dict().items()
             if isinstance(v, DTensor)}
    dcp.save({"model": get_state_dict(model, [])[0]}, checkpoint_id=os.path.join(root, "g"))
    fresh, _, _ = make(1)
    msd = get_state_dict(fresh, [])[0]
    dcp.load({"model": msd}, checkpoint_id=os.path.join(root, "g"))
    set_state_dict(fresh, [], model_state_dict=msd, optim_state_dict={})
    loaded = {k: v.to_local() for k, v in fresh.state_dict().items() if isinstance(v, DTensor)}
    return [k for k in saved if not torch.equal(saved[k], loaded[k])]


def test_torch_api_with_global_expert_names_loads_exactly(ranks: RankPools) -> None:
    with tempfile.TemporaryDirectory() as root:
        wrong = ranks.run(_global_names_worker, 4, root, timeout_s=TIMEOUT_S)
    assert all(not w for w in wrong), wrong


# ---------------------------------------------------------------------- bad declarations

def _bad_layout_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in ("unregistered", "same indices"):
        model, opt, args, ep_mesh = _ep_model(2, "optim_grads_params", seed=0,
                                              register=case != "unregistered")
        if case == "same indices":  # every EP rank claims experts 0 and 1
            for block in model.blocks:
                mckpt.register_experts(block.moe.experts.experts, [0, 1])
        path = os.path.join(root, case.replace(" ", "_"))
        try:
            mckpt.save(model, opt, checkpoint_id=path)
            out[case] = None
        except ValueError as exc:
            out[case] = str(exc)
        out[f"{case}: written"] = os.path.exists(path)
    # Streaming full weights does not rename experts: it still refuses the EP model.
    try:
        for _ in iter_full_weights(model, bucket_size_mb=1):
            pass
        out["iter_full_weights"] = None
    except ValueError as exc:
        out["iter_full_weights"] = str(exc)
    local = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    for name, bad, kind in (("count", [0], ValueError), ("repeat", [1, 1], ValueError),
                            ("negative", [0, -1], ValueError), ("type", ["a", "b"], TypeError),
                            ("no children", None, ValueError)):
        target = nn.Linear(2, 2) if name == "no children" else local
        try:
            mckpt.register_experts(target, bad)
            out[f"register {name}"] = None
        except (TypeError, ValueError) as exc:
            out[f"register {name}"] = (type(exc) is kind, str(exc))
    return out


def test_bad_expert_declarations_fail_clearly(ranks: RankPools) -> None:
    """An EP model without ``register_experts``: ``checkpoint.save`` raises a ``ValueError``
    naming an expert parameter and ``register_experts``; EP ranks registering the same global
    indices: a ``ValueError`` naming the index and both rank sets; nothing written either time
    (on every rank). ``register_experts`` rejects a wrong count, repeats, negatives,
    non-integers and a module without children."""
    with tempfile.TemporaryDirectory() as root:
        results = ranks.run(_bad_layout_worker, 4, root, timeout_s=TIMEOUT_S)
    for rank, out in enumerate(results):
        error = out["unregistered"]
        assert error is not None and "register_experts" in error, (rank, error)
        assert ".experts.experts.0." in error and "[0, 1, 2, 3]" in error, (rank, error)
        error = out["same indices"]
        assert error is not None, (rank, "colliding global indices were saved")
        assert "global expert index 0" in error and "[0, 1]" in error and "[2, 3]" in error, (
            rank, error)
        assert not out["unregistered: written"] and not out["same indices: written"], out
        error = out["iter_full_weights"]
        assert error is not None and "communicate over different ranks" in error, (rank, error)
        for name in ("count", "repeat", "negative", "type", "no children"):
            verdict = out[f"register {name}"]
            assert verdict is not None and verdict[0], (rank, name, verdict)
