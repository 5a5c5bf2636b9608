"""Checkpoint safety: ``checkpoint.save`` is atomic (a failed save keeps the previous checkpoint
whole) and ``checkpoint.load`` verifies per-item checksums before touching the model (see
``_checkpoint_safety.py``).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _checkpoint_safety import (
    WORLD,
    _equal,
    _exists,
    _is_checkpoint_exception,
    assert_differ,
    assert_same,
    expect,
    failing_rename,
    failing_write,
    make,
    no_leftovers,
    snapshot,
    train,
)

from megatron_fsdp_v2 import checkpoint as mckpt

from _models import agree as check
from _models import all_ranks_ok
from _pool import RankPools

# ---------------------------------------------------------------------- atomic save

def _atomic_worker(rank: int, world: int, root: str) -> None:
    model, opt = make()
    path = os.path.join(root, "ckpt")
    train(model, opt, range(1), rank)
    mckpt.save(model, opt, checkpoint_id=path, extra={"step": 1})
    step_a = snapshot(model, opt)

    # A save over it that fails on rank 1 halfway through its file: every rank raises, nothing
    # is committed, and a load gives step A exactly.
    train(model, opt, range(1, 2), rank)
    check("training moved the weights", lambda: assert_differ(snapshot(model, opt), step_a))
    with failing_write(rank == 1):
        err = expect("failed write", RuntimeError, lambda: mckpt.save(
            model, opt, checkpoint_id=path, extra={"step": 2}),
            "injected write failure", "rank 1", "nothing was committed")
    check("the failure is chained", lambda: _is_checkpoint_exception(err))
    check("temporary directory removed", lambda: no_leftovers(path))
    out = mckpt.load(model, opt, checkpoint_id=path, extra={"step": 0})
    check("after a failed write: step A", lambda: (
        assert_same(snapshot(model, opt), step_a), _equal(out, {"step": 1})))

    # A commit that fails on the coordinator between moving the old checkpoint aside and
    # renaming the new one into place: the old one comes back whole.
    train(model, opt, range(1, 2), rank)
    with failing_rename(rank == 0, ".incomplete"):
        expect("failed commit", RuntimeError, lambda: mckpt.save(
            model, opt, checkpoint_id=path, extra={"step": 2}),
            "committing", "injected rename failure")
    check("no leftovers after a failed commit", lambda: no_leftovers(path))
    mckpt.load(model, opt, checkpoint_id=path)
    check("after a failed commit: step A", lambda: assert_same(snapshot(model, opt), step_a))

    # A successful overwrite gives step B exactly.
    train(model, opt, range(1, 2), rank)
    mckpt.save(model, opt, checkpoint_id=path, extra={"step": 2})
    step_b = snapshot(model, opt)
    check("new checkpoint committed", lambda: (
        no_leftovers(path), _exists(os.path.join(path, "checksums.json"))))
    train(model, opt, range(2, 3), rank)
    out = mckpt.load(model, opt, checkpoint_id=path, extra={"step": 0})
    check("after an overwrite: step B", lambda: (
        assert_same(snapshot(model, opt), step_b), _equal(out, {"step": 2})))

    # A crash between the commit's two renames leaves the previous checkpoint at <path>.old:
    # a load says so, and the next save repairs the directory and commits.
    dist.barrier()
    if rank == 0:
        os.rename(path, path + ".old")
        os.makedirs(path + ".incomplete")  # and a half-written attempt
    dist.barrier()
    expect("interrupted commit", ValueError, lambda: mckpt.load(model, opt, checkpoint_id=path),
           path + ".old")
    mckpt.save(model, opt, checkpoint_id=path, extra={"step": 3})
    step_c = snapshot(model, opt)
    check("repaired", lambda: no_leftovers(path))
    train(model, opt, range(3, 4), rank)
    mckpt.load(model, opt, checkpoint_id=path)
    check("after the repair: the new checkpoint", lambda: assert_same(snapshot(model, opt), step_c))


def test_failed_save_keeps_previous_checkpoint(ranks: RankPools) -> None:
    """A save that fails on one rank mid-write, or on the coordinator mid-commit, raises on
    every rank and leaves the previous checkpoint whole (a load gives it back bitwise); a
    successful overwrite gives the new one bitwise; an interrupted commit is repaired."""
    with tempfile.TemporaryDirectory() as root:
        ranks.run(_atomic_worker, WORLD, root, timeout_s=120)


# ---------------------------------------------------------------------- checksums

def _flip_bytes(path: str, victim_file: str) -> str:
    """Overwrite 8 bytes in the middle of the largest item of ``victim_file`` with 0xFF (a NaN
    pattern inside the tensor data); returns the item's key."""
    md = dcp.FileSystemReader(path).read_metadata()
    items = [(info.length, index.fqn, info) for index, info in md.storage_data.items()
             if info.relative_path == victim_file]
    _, fqn, info = max(items, key=lambda item: item[0])
    with open(os.path.join(path, victim_file), "r+b") as f:
        f.seek(info.offset + info.length // 2 & ~7)
        f.write(b"\xff" * 8)
    return fqn


def _checksum_worker(rank: int, world: int, root: str) -> None:
    model, opt = make()
    train(model, opt, range(1), rank)
    path = os.path.join(root, "ckpt")
    mckpt.save(model, opt, checkpoint_id=path)
    saved = snapshot(model, opt)
    # A checkpoint written by plain dcp.save (no checksum file) still loads.
    plain = os.path.join(root, "plain")
    msd, osd = mckpt.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=plain)
    check("plain checkpoint has no checksum file",
          lambda: _equal(os.path.exists(os.path.join(plain, "checksums.json")), False))

    victim = "__1_0.distcp"
    box: list[Any] = [None]
    dist.barrier()
    if rank == 0:
        box[0] = _flip_bytes(path, victim)
    dist.broadcast_object_list(box, src=0)
    key = box[0]

    train(model, opt, range(1, 2), rank)
    before = snapshot(model, opt)
    expect("corrupted item", ValueError, lambda: mckpt.load(model, opt, checkpoint_id=path),
           f"'{key}'", f"'{victim}'", "crc32")
    check("model and optimizer unchanged", lambda: assert_same(snapshot(model, opt), before))

    mckpt.load(model, opt, checkpoint_id=plain)
    check("plain checkpoint loaded", lambda: assert_same(snapshot(model, opt), saved))

    # What the check guards against: unverified, the flipped bytes load without an error.
    mckpt.load(model, opt, checkpoint_id=path, checksums=False)
    now = snapshot(model, opt)
    differs = any(not torch.equal(now[k], saved[k]) for k in saved)
    assert not all_ranks_ok(not differs), "unverified, the corrupted checkpoint loaded intact"

    # A plain dcp.save over the directory leaves a checksum file of another save: it is
    # ignored (with a warning), not reported as corruption.
    mckpt.load(model, opt, checkpoint_id=plain)  # clean weights again (no NaN)
    train(model, opt, range(1, 2), rank)
    msd, osd = mckpt.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    step_b = snapshot(model, opt)
    train(model, opt, range(2, 3), rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mckpt.load(model, opt, checkpoint_id=path)
    check("stale checksums ignored", lambda: (
        assert_same(snapshot(model, opt), step_b),
        _equal(any("belongs to another save" in str(w.message) for w in caught), True)))

    # Through a FileSystemWriter / FileSystemReader instead of a path: the same protection.
    other = os.path.join(root, "writer")
    writer = dcp.FileSystemWriter(other)
    mckpt.save(model, opt, storage_writer=writer)
    check("committed through the writer", lambda: (
        _exists(os.path.join(other, "checksums.json")), no_leftovers(other),
        _equal(str(writer.path), other)))
    dist.barrier()
    if rank == 0:
        _flip_bytes(other, "__0_0.distcp")
    dist.barrier()
    expect("corrupted item, through a reader", ValueError, lambda: mckpt.load(
        model, opt, storage_reader=dcp.FileSystemReader(other)), "'__0_0.distcp'")


def test_corrupted_checkpoint_is_rejected_before_loading(ranks: RankPools) -> None:
    """Bytes flipped in one shard file after a save: the load raises a ValueError naming the
    key and the file on every rank, with the model and optimizer unchanged bitwise; a
    checkpoint without a checksum file (plain ``dcp.save``) still loads."""
    with tempfile.TemporaryDirectory() as root:
        ranks.run(_checksum_worker, WORLD, root, timeout_s=120)
