"""Checkpoint safety: misuse raises clear ``ValueError``/``RuntimeError`` instead of DCP's
``CheckpointException`` (a ``BaseException``); see ``_checkpoint_safety.py``.
"""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _checkpoint_safety import (
    WORLD,
    _equal,
    _is_checkpoint_exception,
    assert_same,
    expect,
    make,
    no_leftovers,
    snapshot,
    train,
)
from torch.distributed.checkpoint.storage import StorageWriter

from megatron_fsdp_v2 import checkpoint as mckpt

from _models import agree as check
from _pool import RankPools

# ---------------------------------------------------------------------- clear errors

class _FailingWriter(StorageWriter):
    """A non-filesystem storage writer that fails while planning on rank 1."""

    def reset(self, checkpoint_id=None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        if dist.get_rank() == 1:
            raise OSError("injected storage failure")
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def write_data(self, plan, planner):
        raise AssertionError("not reached")

    def finish(self, metadata, results) -> None:
        raise AssertionError("not reached")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


class _FailingReader(dcp.FileSystemReader):
    """Fails while reading on rank 1."""

    def read_data(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError("injected read failure")
        return super().read_data(plan, planner)


def _errors_worker(rank: int, world: int, root: str) -> None:
    model, opt = make()
    train(model, opt, range(1), rank)

    # A path that is a regular file: ValueError naming it, on every rank, nothing written.
    path = os.path.join(root, "a_file")
    if rank == 0:
        with open(path, "w") as f:
            f.write("not a checkpoint")
    dist.barrier()
    expect("save to a regular file", ValueError,
           lambda: mckpt.save(model, opt, checkpoint_id=path), path)
    check("nothing written", lambda: (
        _equal(open(path).read(), "not a checkpoint"), no_leftovers(path)))

    # DCP's CheckpointException (a BaseException) becomes a chained RuntimeError.
    err = expect("failing storage writer", RuntimeError,
                 lambda: mckpt.save(model, opt, storage_writer=_FailingWriter()),
                 "injected storage failure")
    check("save: chained", lambda: _is_checkpoint_exception(err))
    ckpt = os.path.join(root, "ckpt")
    mckpt.save(model, opt, checkpoint_id=ckpt, extra={"epoch": 3})
    err = expect("failing storage reader", RuntimeError, lambda: mckpt.load(
        model, opt, storage_reader=_FailingReader(ckpt)), "injected read failure")
    check("load: chained", lambda: _is_checkpoint_exception(err))

    # An extra key the checkpoint lacks: ValueError naming it and listing what it has, before
    # anything is loaded.
    saved = snapshot(model, opt)
    train(model, opt, range(1, 2), rank)
    before = snapshot(model, opt)
    expect("missing extra key", ValueError, lambda: mckpt.load(
        model, opt, checkpoint_id=ckpt, extra={"step": 0, "epoch": 0}), "'step'", "'epoch'")
    check("nothing loaded", lambda: assert_same(snapshot(model, opt), before))
    out = mckpt.load(model, opt, checkpoint_id=ckpt, extra={"epoch": 0})
    check("extra read back", lambda: (
        _equal(out, {"epoch": 3}), assert_same(snapshot(model, opt), saved)))
    out = mckpt.load(model, opt, checkpoint_id=ckpt, strict=False, extra={"step": 7})
    check("non-strict: the given value", lambda: _equal(out, {"step": 7}))


def test_clear_errors(ranks: RankPools) -> None:
    """Saving to a regular file raises a ValueError naming it before anything is written; DCP's
    CheckpointException leaves save/load as a chained RuntimeError; an extra key the checkpoint
    lacks raises a ValueError naming it and listing the checkpoint's extra keys."""
    with tempfile.TemporaryDirectory() as root:
        ranks.run(_errors_worker, WORLD, root, timeout_s=120)
