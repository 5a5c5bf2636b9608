"""Hostile checkpoints: saves that race each other, files damaged behind the library's back,
and torch's own state-dict API used in ways that used to hang. Each case compares what a load
gives with one process's (one job's) exact state; none may load a mix.

* Two jobs saving to one path at once: every save writes its own temporary directory and
  commits it whole, so the path ends up holding exactly one job's checkpoint (or none, if both
  failed clearly); a load never mixes the two, even when a commit replaces the checkpoint
  while the load reads it.
* A checkpoint without ``checksums.json`` (plain ``dcp.save``) whose shard is corrupted or
  truncated: ``checkpoint.load`` raises naming the file, and the model and optimizer are
  unchanged bitwise (DCP reads into a staging copy first).
* torch's combined ``set_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)`` with
  ``{}`` on the other ranks loads like the separate model and optimizer calls (it used to hang;
  FSDP2 still does, so its control uses the separate calls).
"""

from __future__ import annotations

import contextlib
import copy
import glob
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
from _checkpoint_safety import assert_same, expect, make, snapshot, train
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

from megatron_fsdp_v2 import checkpoint as mckpt
from megatron_fsdp_v2 import fully_shard

from _models import OddMLP, assert_close_to_reference, mlp_loss
from _models import agree as check
from _pool import RankPools

TIMEOUT_S = 90

# ---------------------------------------------------------------------- item 4: concurrent saves

JOBS, JOB_WORLD = 2, 2


def _mark(root: str, name: str, rank: int) -> None:
    open(os.path.join(root, f"{name}.{rank}"), "w").close()


def _wait_for(root: str, name: str, count: int, patience_s: float = 10.0) -> None:
    """Wait (up to ``patience_s``: a job that failed before marking must not hang the other)
    until ``count`` ranks marked ``name``. Files, not collectives: the jobs share no group."""
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        if len(glob.glob(os.path.join(root, f"{name}.*"))) >= count:
            return
        time.sleep(0.01)


def _concurrent_worker(rank: int, world: int, root: str) -> None:
    # Two jobs of two ranks each, each with its own model (different seeds, different steps)
    # on its own mesh and its own process group, saving to the same path.
    mesh = init_device_mesh("cpu", (JOBS, JOB_WORLD), mesh_dim_names=("job", "dp"))
    job = rank // JOB_WORLD
    group = mesh["dp"].get_group()
    path = os.path.join(root, "shared_ckpt")

    def make_job_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(job)
        model = fully_shard(OddMLP(), mesh=mesh["dp"])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = make_job_model()
    train(model, opt, range(job + 1), rank)
    mine = snapshot(model, opt)
    # Rank r of either job holds the same rows of the same shapes: states[job * 2 + r].
    states: list[Any] = [None] * world
    dist.all_gather_object(states, mine)

    # A deterministic overlap: job 0 prepares and reaches its first write, then job 1 starts
    # its save; job 0 writes only once job 1 is writing too; job 1 commits only after job 0's
    # save returned. (Each wait gives up after a while, so a job that failed early cannot
    # hang the other.)
    write_item, rename = dcp_fs._write_item, os.rename
    first = [True]

    def slow_write_item(*args: Any, **kwargs: Any) -> Any:
        if first[0]:
            first[0] = False
            _mark(root, "writing", rank)
            if job == 0:
                _wait_for(root, "writing", world)
        return write_item(*args, **kwargs)

    def late_rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
        if job == 1 and ".incomplete" in os.fspath(src):
            _wait_for(root, "done0", JOB_WORLD)
        return rename(src, dst, *args, **kwargs)

    if job == 1:
        _wait_for(root, "writing", JOB_WORLD)
    dcp_fs._write_item, os.rename = slow_write_item, late_rename
    error: str | None = None
    try:
        mckpt.save(model, opt, checkpoint_id=path, process_group=group, extra={"job": job})
    except (RuntimeError, ValueError, OSError) as exc:  # a clear failure is allowed
        error = f"{type(exc).__name__}: {exc}"
    finally:
        dcp_fs._write_item, os.rename = write_item, rename
        _mark(root, f"done{job}", rank)
    outcomes: list[Any] = [None] * world
    dist.all_gather_object(outcomes, (job, error))
    succeeded = {j for j, e in outcomes if e is None}
    failed_jobs = {j for j, e in outcomes if e is not None}
    check("a job's ranks agree on its outcome", lambda: _no_overlap(succeeded, failed_jobs))

    # Whatever happened, the path holds one job's checkpoint whole (or nothing): each job loads
    # it into a fresh model and finds exactly one job's state on every one of its ranks.
    dist.barrier()
    if not succeeded:
        return
    fresh, fresh_opt = make_job_model()
    train(fresh, fresh_opt, range(1), rank)  # optimizer state to load into
    out = mckpt.load(fresh, fresh_opt, checkpoint_id=path, process_group=group,
                     extra={"job": -1})
    loaded = snapshot(fresh, fresh_opt)
    dp_rank = rank % JOB_WORLD
    sources = [j for j in range(JOBS) if _same(loaded, states[j * JOB_WORLD + dp_rank])]
    found: list[Any] = [None] * world
    dist.all_gather_object(found, (sources, out["job"]))

    def one_whole_save() -> None:
        per_rank = [tuple(s) for s, _ in found]
        assert all(len(s) == 1 for s in per_rank), (
            f"a rank loaded no job's state whole (matches per rank: {per_rank}); outcomes "
            f"{outcomes}")
        assert len(set(per_rank)) == 1, f"the load mixed the jobs' states: {per_rank}"
        source = per_rank[0][0]
        assert all(j == source for _, j in found), f"'extra' of another save: {found}"
        assert source in succeeded, f"job {source}'s save failed but its state was committed"

    check("one job's checkpoint, whole", one_whole_save)


def _no_overlap(succeeded: set[int], failed: set[int]) -> None:
    assert not succeeded & failed, f"jobs {succeeded & failed} succeeded on some ranks only"


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_concurrent_saves_to_one_path_never_mix(ranks: RankPools) -> None:
    """Item 4: two jobs (two ranks each, own models, own groups) save to one path with their
    writes overlapping. Each save that returns committed its own checkpoint whole, the path ends
    with exactly one job's checkpoint, and a load gives that job's state bitwise on every rank
    (model, optimizer and ``extra``), never a mix."""
    with tempfile.TemporaryDirectory() as root:
        ranks.run(_concurrent_worker, JOBS * JOB_WORLD, root, timeout_s=TIMEOUT_S)


def _load_during_commit_worker(rank: int, world: int, root: str) -> None:
    # Checkpoint A at the path, checkpoint B elsewhere (what a concurrent save has written).
    model, opt = make()
    path, other = os.path.join(root, "ckpt"), os.path.join(root, "other")
    train(model, opt, range(1), rank)
    mckpt.save(model, opt, checkpoint_id=path)
    a = snapshot(model, opt)
    train(model, opt, range(1, 2), rank)
    mckpt.save(model, opt, checkpoint_id=other)
    b = snapshot(model, opt)
    train(model, opt, range(2, 3), rank)

    # During the load, after rank 1 opened its first shard file and before rank 0 opens its
    # own, a commit replaces A at the path by B (the two renames a commit makes).
    original = dcp_fs.FileSystem.create_stream
    first = [True]

    @contextlib.contextmanager
    def create_stream(self: Any, file: Any, mode: str) -> Iterator[Any]:
        trigger = first[0] and mode == "rb" and os.fspath(file).endswith(".distcp")
        if trigger:
            first[0] = False
            if rank == 0:
                _wait_for(root, "opened", 1)
                os.rename(path, path + ".moved")
                os.rename(other, path)
        with original(self, file, mode) as stream:
            if trigger and rank == 1:
                _mark(root, "opened", rank)
            yield stream

    dcp_fs.FileSystem.create_stream = create_stream  # type: ignore[method-assign]
    try:
        mckpt.load(model, opt, checkpoint_id=path)
    finally:
        dcp_fs.FileSystem.create_stream = original  # type: ignore[method-assign]
    now = snapshot(model, opt)
    matches = [name for name, state in (("A", a), ("B", b)) if _same(now, state)]
    found: list[Any] = [None] * world
    dist.all_gather_object(found, matches)
    check("the load read the checkpoint it opened, whole", lambda: _equal_lists(
        found, [["A"]] * world))


def _equal_lists(found: list[Any], expected: list[Any]) -> None:
    assert found == expected, f"per rank, the load matched {found} (expected {expected})"


def test_load_during_a_commit_reads_one_checkpoint(ranks: RankPools) -> None:
    """Item 4, the load side: a commit that replaces the checkpoint while a load reads it
    (after one rank opened its shard file, before the other did) cannot make the load read some
    ranks' rows from each: the load reads the directory it opened, so every rank gets
    checkpoint A bitwise."""
    with tempfile.TemporaryDirectory() as root:
        ranks.run(_load_during_commit_worker, 2, root, timeout_s=TIMEOUT_S)


# ----------------------------------------------------- item 11: a load is all or nothing

def _damage(path: str, victim: str, how: str) -> None:
    """Damage ``victim`` (a shard file of the checkpoint at ``path``): ``"truncate"`` cuts it
    to half its length; ``"header"`` overwrites the first bytes of every item in it (the
    serialized tensor's header), so deserializing it fails."""
    file = os.path.join(path, victim)
    if how == "truncate":
        os.truncate(file, os.path.getsize(file) // 2)
        return
    md = dcp.FileSystemReader(path).read_metadata()
    with open(file, "r+b") as f:
        for info in md.storage_data.values():
            if info.relative_path == victim:
                f.seek(info.offset)
                f.write(b"\x00" * min(16, info.length))


def _no_partial_load_worker(rank: int, world: int, root: str, how: str) -> None:
    model, opt = make()
    train(model, opt, range(1), rank)
    saved = snapshot(model, opt)
    # Plain dcp.save: no checksums.json, so only reading the items can find the damage.
    path = os.path.join(root, "plain")
    msd, osd = mckpt.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    victim = "__1_0.distcp"
    dist.barrier()
    if rank == 0:
        _damage(path, victim, how)
    dist.barrier()

    train(model, opt, range(1, 2), rank)
    before = snapshot(model, opt)
    check("training moved the state", lambda: _differs(before, saved))
    expect(f"{how}d shard", RuntimeError, lambda: mckpt.load(model, opt, checkpoint_id=path),
           f"'{victim}'", "truncated" if how == "truncate" else "corrupted",
           "nothing was loaded")
    check("model and optimizer unchanged", lambda: assert_same(snapshot(model, opt), before))
    # The model still trains and still loads a good checkpoint.
    good = os.path.join(root, "good")
    mckpt.save(model, opt, checkpoint_id=good)
    train(model, opt, range(2, 3), rank)
    mckpt.load(model, opt, checkpoint_id=good)
    check("a good checkpoint loads after the failed one",
          lambda: assert_same(snapshot(model, opt), before))


def _differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert not _same(a, b), "snapshots are equal"


@pytest.mark.parametrize("how", ["truncate", "header"])
def test_damaged_plain_checkpoint_changes_nothing(ranks: RankPools, how: str) -> None:
    """Item 11: a checkpoint written by plain ``dcp.save`` (no checksum file) whose rank-1 shard
    file is truncated, or whose items' headers are overwritten: ``checkpoint.load`` raises on
    every rank naming the file, and every rank's model and optimizer are bitwise what they
    were before the call."""
    with tempfile.TemporaryDirectory() as root:
        ranks.run(_no_partial_load_worker, 2, root, how, timeout_s=TIMEOUT_S)


# ------------------------------------------- item 9: torch's combined set_state_dict, broadcast

def _mlp_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> torch.Tensor:
    """One step on the same global batch on every rank (so every rank's step is the
    single-process step)."""
    g = torch.Generator().manual_seed(seed)
    loss = mlp_loss(model, (torch.randn(4, 15, generator=g), torch.randn(4, 3, generator=g)))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _combined_worker(rank: int, world: int) -> None:
    # The single-process reference: two steps, then its full model and optimizer state dicts
    # (what a seed or consolidated checkpoint holds), given on rank 0 only.
    torch.manual_seed(0)
    ref = OddMLP()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for seed in (1, 2):
        _mlp_step(ref, ref_opt, seed)
    full_msd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    full_osd = get_optimizer_state_dict(ref, ref_opt,
                                        options=StateDictOptions(full_state_dict=True))
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)

    def on_rank0(sd: dict[str, Any]) -> dict[str, Any]:
        # torch rewrites the dicts it is given: a copy each time.
        return copy.deepcopy(sd) if rank == 0 else {}

    def fresh(shard: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(7)  # other weights: a load that did nothing shows
        model = OddMLP()
        shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _mlp_step(model, opt, 99)  # optimizer state to replace
        return model, opt

    # Ours: the combined call (it hung: torch decides per rank whether to load the model,
    # from whether that rank's model dict is empty, so rank 0 broadcast alone).
    model, opt = fresh(lambda m: fully_shard(m, sharding_strategy="optim_grads_params",
                                             timeout=30))
    set_state_dict(model, opt, model_state_dict=on_rank0(full_msd),
                   optim_state_dict=on_rank0(full_osd), options=opts)
    # FSDP2 (control): it hangs in the combined call too, so the separate calls.
    ctrl, ctrl_opt = fresh(fsdp2_fully_shard)
    set_model_state_dict(ctrl, on_rank0(full_msd), options=opts)
    set_optimizer_state_dict(ctrl, ctrl_opt, on_rank0(full_osd), options=opts)

    for seed in (3, 4):
        ref_loss = _mlp_step(ref, ref_opt, seed)
        loss, ctrl_loss = _mlp_step(model, opt, seed), _mlp_step(ctrl, ctrl_opt, seed)
        check(f"step {seed}: loss as one process", lambda: torch.testing.assert_close(
            loss, ref_loss, rtol=1e-6, atol=1e-7))
        check(f"step {seed}: FSDP2's loss as one process", lambda: torch.testing.assert_close(
            ctrl_loss, ref_loss, rtol=1e-6, atol=1e-7))
    check("parameters as one process",
          lambda: assert_close_to_reference(model, ref, rtol=1e-5, atol=1e-6))

    # An empty model dict on rank 0 too: the combined call loads the optimizer only (every
    # rank agrees with rank 0 on that), and the model keeps its weights.
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    new_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _mlp_step(model, new_opt, 98)
    for k, v in model.state_dict().items():  # undo that step's weight change
        v.detach().copy_(before[k])
    full_osd = get_optimizer_state_dict(ref, ref_opt,
                                        options=StateDictOptions(full_state_dict=True))
    set_state_dict(model, new_opt, model_state_dict={}, optim_state_dict=on_rank0(full_osd),
                   options=opts)
    check("an optimizer-only combined call leaves the model", lambda: [
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
        for k, v in model.state_dict().items()])
    ref_loss, loss = _mlp_step(ref, ref_opt, 5), _mlp_step(model, new_opt, 5)
    check("after the optimizer-only load: loss as one process",
          lambda: torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7))
    check("after the optimizer-only load: parameters as one process",
          lambda: assert_close_to_reference(model, ref, rtol=1e-5, atol=1e-6))


def test_torch_combined_set_state_dict_broadcast(ranks: RankPools) -> None:
    """Item 9: torch's ``set_state_dict(model, optim, full_state_dict=True,
    broadcast_from_rank0=True)`` with the state dicts on rank 0 and ``{}`` elsewhere loads the
    model and optimizer like one process (the next two steps match it); FSDP2 through the
    separate calls is the control. With ``{}`` as the model dict on every rank it loads the
    optimizer only."""
    ranks.run(_combined_worker, 2, timeout_s=60)
