"""torch's own state-dict API on ``fully_shard`` models:
``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict`` with
``dcp.save`` / ``dcp.load``, model and optimizer, across world sizes (2 <-> 3, 1-D <-> 2x2 HSDP
with outer ``no_shard`` and ``optim``) and strategies, default (nested) and flattened
optimizer state dicts; checkpoints written by torch's API and by ``megatron_fsdp_v2.checkpoint``
are the same files and load through either.

Every case trains 2 AdamW steps, saves, loads into a fresh model and optimizer of another
layout, trains 2 more steps and must match an uninterrupted single-process run of 4 steps on
the same global batches (losses and parameters; ``rtol=1e-5``, ``atol=1e-6`` as in
``test_parity.py``: the layouts reduce in different orders). Around every save and load the
live optimizer state must stay free of the chunk metadata, so ``torch.save(optim.state_dict())``
still loads with ``torch.load(weights_only=True)``.

The checkpoints of all cases are written by one spawn per world size (a module fixture); each
case is then one spawn that loads and resumes, so every failure is named by its case.
"""

from __future__ import annotations

import io
import os
import tempfile
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict as dsd
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import checkpoint as mckpt
from megatron_fsdp_v2 import fully_shard
from megatron_fsdp_v2.testing import DistributedTestError, release_process_groups

from _models import OddMLP, TinyGPT, agree, lm_loss, mlp_loss, step_mean_loss
from _pool import RankPools

GLOBAL_BATCH = 12  # divisible by 2, 3 and 4
SAVE_AT, END = 2, 4
RTOL, ATOL = 1e-5, 1e-6
TIMEOUT_S = 240.0

# case -> model kind; save and load layouts (world, strategy, outer: None for a 1-D mesh, else
# the outer strategy on a 2x2 mesh) and APIs ("torch" by default); flattened optimizer state.
CASES: dict[str, dict[str, Any]] = {
    "w2-ogp->w3-optim": dict(kind="lm", save=(2, "optim_grads_params", None),
                             load=(3, "optim", None)),
    "w3-optim->w2-ogp": dict(kind="mlp", save=(3, "optim", None),
                             load=(2, "optim_grads_params", None)),
    "w2-no_shard->w3-og": dict(kind="lm", save=(2, "no_shard", None),
                               load=(3, "optim_grads", None)),
    "w3-og->w2-no_shard": dict(kind="mlp", save=(3, "optim_grads", None),
                               load=(2, "no_shard", None)),
    "w2-ogp->w2-ogp": dict(kind="mlp", save=(2, "optim_grads_params", None),
                           load=(2, "optim_grads_params", None)),
    "flat:w3-og->w2-optim": dict(kind="lm", save=(3, "optim_grads", None),
                                 load=(2, "optim", None), flatten=True),
    "hsdp-no_shard->w3-optim": dict(kind="lm", save=(4, "optim_grads_params", "no_shard"),
                                    load=(3, "optim", None)),
    "w2-og->hsdp-optim": dict(kind="mlp", save=(2, "optim_grads", None),
                              load=(4, "optim_grads_params", "optim")),
    "hsdp-optim->hsdp-no_shard": dict(kind="lm", save=(4, "optim_grads_params", "optim"),
                                      load=(4, "optim_grads", "no_shard")),
    # The same files through either API.
    "torch-save->library-load": dict(kind="mlp", save=(2, "optim", None),
                                     load=(3, "optim_grads_params", None), load_api="library"),
    "library-save->torch-load": dict(kind="lm", save=(3, "optim_grads_params", None),
                                     load=(2, "optim_grads", None), save_api="library"),
}


# ---------------------------------------------------------------------- training

def wrap(model: torch.nn.Module, strategy: str, outer: str | None) -> torch.nn.Module:
    kw: dict[str, Any] = {}
    if outer is not None:
        kw["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        kw["outer_dp_sharding_strategy"] = outer
    for block in getattr(model, "blocks", []):
        fully_shard(block, sharding_strategy=strategy, **kw)
    return fully_shard(model, sharding_strategy=strategy, **kw)


def make_model(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return TinyGPT() if kind == "lm" else OddMLP()


def new_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def global_batch(kind: str, step: int) -> Any:
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "lm":
        return torch.randint(0, 37, (GLOBAL_BATCH, 9), generator=g)
    return torch.randn(GLOBAL_BATCH, 15, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def local_batch(kind: str, step: int, rank: int, world: int) -> Any:
    n = GLOBAL_BATCH // world
    rows = slice(rank * n, (rank + 1) * n)
    batch = global_batch(kind, step)
    return batch[rows] if kind == "lm" else (batch[0][rows], batch[1][rows])


def train(model, opt, kind: str, steps: range, rank: int, world: int) -> list[float]:
    loss_fn = lm_loss if kind == "lm" else mlp_loss
    losses = []
    for step in steps:
        losses.append(step_mean_loss(loss_fn(model, local_batch(kind, step, rank, world)), opt))
    return losses


def reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The uninterrupted single-process run: losses of steps SAVE_AT..END, final weights."""
    model = make_model(kind, 0)
    opt = new_optimizer(model)
    loss_fn = lm_loss if kind == "lm" else mlp_loss
    losses = []
    for step in range(END):
        loss = loss_fn(model, global_batch(kind, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses[SAVE_AT:], {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------- checks

_OUR_ATTRS = ("__create_chunk_list__", "__create_write_items__", "_mfsdp_rows", "__getstate__")


def check_live_clean(what: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """No live optimizer state or parameter carries our attributes, and a plain pickle of the
    optimizer's state dict loads with ``weights_only=True``."""
    def check() -> None:
        live = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        live += list(model.parameters())
        assert any(isinstance(v, DTensor) for v in live), "no DTensor optimizer state"
        for value in live:
            targets = [value] + ([value._local_tensor] if isinstance(value, DTensor) else [])
            for target in targets:
                found = [a for a in _OUR_ATTRS if a in target.__dict__]
                assert not found, f"a live tensor carries {found}"
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        try:
            torch.load(buf, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - reported as the failure
            raise AssertionError(
                "torch.save(optimizer.state_dict()) does not load with weights_only=True: "
                f"{str(exc)[:300]}") from None
    agree(f"{what}: live state clean", check)


def check_checkpoint(path: str) -> None:
    """Every saved tensor's chunks tile it exactly once, and every Adam step is SAVE_AT."""
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key, meta in md.items():
        if hasattr(meta, "chunks"):
            covered = sum(torch.Size(c.sizes).numel() for c in meta.chunks)
            assert covered == meta.size.numel(), (
                f"{key}: chunks cover {covered} elements of {meta.size.numel()}")
    steps = {k: torch.zeros((), dtype=m.properties.dtype) for k, m in md.items()
             if k.startswith("optim.state.") and k.endswith(".step")}
    assert steps, "no optimizer steps in the checkpoint"
    dcp.load(steps, checkpoint_id=path, process_group=None)
    for key, value in steps.items():
        assert value.item() == SAVE_AT, f"{key} = {value.item()}, expected {SAVE_AT}"


def same_files(path_a: str, path_b: str, tmp: str) -> None:
    """Two checkpoints hold the same entries with bitwise equal values."""
    out_a, out_b = os.path.join(tmp, "a.pt"), os.path.join(tmp, "b.pt")
    dcp_to_torch_save(path_a, out_a)
    dcp_to_torch_save(path_b, out_b)
    a, b = torch.load(out_a), torch.load(out_b)
    flat_a, flat_b = _flatten(a), _flatten(b)
    assert list(flat_a) == list(flat_b), f"keys {sorted(flat_a)} != {sorted(flat_b)}"
    for key, value in flat_a.items():
        other = flat_b[key]
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), f"{key} differs"
        else:
            assert value == other, f"{key}: {value} != {other}"


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k in sorted(tree, key=str):
            out.update(_flatten(tree[k], f"{prefix}{k}."))
        return out
    if isinstance(tree, list):
        out = {}
        for i, v in enumerate(tree):
            out.update(_flatten(v, f"{prefix}{i}."))
        return out
    return {prefix: tree}


# ---------------------------------------------------------------------- save and load

def options_of(case: dict[str, Any]) -> dsd.StateDictOptions:
    return dsd.StateDictOptions(flatten_optimizer_state_dict=case.get("flatten", False))


def torch_save(model, opt, path: str, options: dsd.StateDictOptions) -> None:
    model_sd, optim_sd = dsd.get_state_dict(model, opt, options=options)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def torch_load(model, opt, path: str, options: dsd.StateDictOptions) -> None:
    model_sd, optim_sd = dsd.get_state_dict(model, opt, options=options)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    dsd.set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=options)


def _save_all(rank: int, world: int, root: str) -> dict[str, str]:
    """Write the checkpoint of every case saved at this world size; returns case -> error."""
    errors: dict[str, str] = {}
    for name, case in CASES.items():
        if case["save"][0] != world:
            continue
        release_process_groups()  # the HSDP cases' meshes, one set per case
        _, strategy, outer = case["save"]
        path = os.path.join(root, name)
        try:
            model = wrap(make_model(case["kind"], 0), strategy, outer)
            opt = new_optimizer(model)
            train(model, opt, case["kind"], range(SAVE_AT), rank, world)
            check_live_clean(f"{name} before save", model, opt)
            if case.get("save_api") == "library":
                mckpt.save(model, opt, checkpoint_id=path)
            else:
                torch_save(model, opt, path, options_of(case))
            check_live_clean(f"{name} after save", model, opt)
            agree(f"{name}: saved chunks and steps", lambda: check_checkpoint(path))
            if not case.get("flatten"):
                # The other API writes the same checkpoint.
                other = path + ".other"
                if case.get("save_api") == "library":
                    torch_save(model, opt, other, options_of(case))
                else:
                    mckpt.save(model, opt, checkpoint_id=other, checksums=False)
                dist.barrier()
                with tempfile.TemporaryDirectory() as tmp:
                    agree(f"{name}: torch's and the library's checkpoints",
                          lambda: same_files(path, other, tmp) if rank == 0 else None)
        # DCP's CheckpointException is a BaseException.
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported by the case
            errors[name] = "".join(traceback.format_exception(exc))
    return errors


def _load_case(rank: int, world: int, root: str, name: str) -> None:
    case = CASES[name]
    _, strategy, outer = case["load"]
    path = os.path.join(root, name)
    model = wrap(make_model(case["kind"], 1), strategy, outer)
    opt = new_optimizer(model)
    if case.get("load_api") == "library":
        mckpt.load(model, opt, checkpoint_id=path)
    else:
        torch_load(model, opt, path, options_of(case))
    check_live_clean(f"{name} after load", model, opt)
    resume_and_compare(f"{name}: resumed run", model, opt, case["kind"], rank, world)


def resume_and_compare(what: str, model, opt, kind: str, rank: int, world: int) -> None:
    """Train steps SAVE_AT..END; losses and final weights must match the uninterrupted
    single-process run."""
    losses = train(model, opt, kind, range(SAVE_AT, END), rank, world)
    full = mckpt.get_full_state_dict(model, rank0_only=False)
    ref_losses, ref_full = reference(kind)

    def compare() -> None:
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                   torch.tensor(ref_losses, dtype=torch.float64),
                                   rtol=RTOL, atol=0.0, msg=lambda m: f"losses: {m}")
        assert list(full) == list(ref_full), f"keys {list(full)} != {list(ref_full)}"
        for key, value in ref_full.items():
            torch.testing.assert_close(full[key], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, key=key: f"{key}: {m}")
    agree(f"{what} vs the single-process reference", compare)


# ---------------------------------------------------------------------- tests

class _Checkpoints:
    """The checkpoints of every case, written on first need by one spawn per world size."""

    def __init__(self, root: str, ranks: RankPools) -> None:
        self.root = root
        self.ranks = ranks
        self.errors: dict[str, str] = {}
        self.saved: set[int] = set()

    def path_of(self, name: str) -> str:
        world = CASES[name]["save"][0]
        if world not in self.saved:
            self.saved.add(world)
            try:
                results = self.ranks.run(_save_all, world, self.root, timeout_s=TIMEOUT_S)
            except DistributedTestError as exc:  # every case saved at this world size fails
                results = [{case: str(exc) for case in CASES if CASES[case]["save"][0] == world}]
            for result in results:
                for case, error in result.items():
                    self.errors.setdefault(case, error)
        assert name not in self.errors, f"saving {name} failed: {self.errors[name]}"
        return self.root


@pytest.fixture(scope="module")
def checkpoints(ranks: RankPools):
    with tempfile.TemporaryDirectory() as root:
        yield _Checkpoints(root, ranks)


@pytest.mark.timeout(3 * TIMEOUT_S)
@pytest.mark.parametrize("name", list(CASES))
def test_torch_state_dict_round_trip(ranks: RankPools, checkpoints: _Checkpoints, name: str
                                     ) -> None:
    root = checkpoints.path_of(name)
    ranks.run(_load_case, CASES[name]["load"][0], root, name, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- unsupported states

def _foreign_state(rank: int, world: int, root: str) -> None:
    """An optimizer state DTensor not shaped like its parameter: a plain state dict still
    pickles, and DCP's save raises a ValueError naming the entry on every rank."""
    model = wrap(make_model("mlp", 0), "optim_grads_params", None)
    opt = new_optimizer(model)
    train(model, opt, "mlp", range(1), rank, world)
    param = next(p for p in model.parameters() if p.requires_grad and p.dim() == 2)
    mesh = param.device_mesh
    opt.state[param]["foreign"] = DTensor.from_local(torch.zeros(1, 2), mesh, param.placements)
    check_live_clean("foreign state", model, opt)
    try:
        torch_save(model, opt, os.path.join(root, "foreign"), dsd.StateDictOptions())
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - checked below
        message = str(exc)
    else:
        message = "no error"
    agree("foreign state: DCP's error", lambda: _check_in(
        "does not follow the row sharding of its parameter", message))


def _check_in(needle: str, text: str) -> None:
    assert needle in text, f"expected {needle!r} in: {text[:500]}"


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_foreign_optimizer_state_fails_at_dcp_only(ranks: RankPools) -> None:
    with tempfile.TemporaryDirectory() as root:
        ranks.run(_foreign_state, 2, root, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- torch.save per rank

def _per_rank_pickle(rank: int, world: int, root: str, strategy: str) -> None:
    """``torch.save(model.state_dict())`` and ``torch.save(optim.state_dict())`` on each rank,
    ``torch.load(weights_only=True)`` into a fresh model of the same layout: the resumed run
    matches the single-process reference. The entries view flat buffers at non-zero offsets,
    which torch's own DTensor pickling cannot write."""
    model = wrap(make_model("lm", 0), strategy, None)
    opt = new_optimizer(model)
    train(model, opt, "lm", range(SAVE_AT), rank, world)
    path = os.path.join(root, f"rank{rank}.pt")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    check_live_clean(f"{strategy} after torch.save", model, opt)
    del model, opt
    model = wrap(make_model("lm", 1), strategy, None)
    opt = new_optimizer(model)
    loaded = torch.load(path, weights_only=True)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optim"])
    check_live_clean(f"{strategy} after torch.load", model, opt)
    resume_and_compare(f"{strategy}: torch.save/torch.load per rank", model, opt, "lm", rank,
                       world)


@pytest.mark.timeout(2 * TIMEOUT_S)
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_torch_save_per_rank_round_trip(ranks: RankPools, strategy: str) -> None:
    with tempfile.TemporaryDirectory() as root:
        ranks.run(_per_rank_pickle, 3, root, strategy, timeout_s=TIMEOUT_S)
