"""Checkpoint safety: ``checkpoint.save`` is atomic (a failed save keeps the previous checkpoint
whole), ``checkpoint.load`` verifies per-item checksums before touching the model, misuse
raises clear ``ValueError``/``RuntimeError`` instead of DCP's ``CheckpointException`` (a
``BaseException``), and every checkpoint collective runs on the units' communication group, so
a missing rank fails the others after ``fully_shard``'s timeout.

Every failure is injected on one rank only; every rank must raise (no hang: each spawn has a
timeout), and whatever is loaded afterwards must be exactly (bitwise) one complete checkpoint.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import StorageWriter
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import checkpoint as mckpt
from megatron_fsdp_v2 import fully_shard
from megatron_fsdp_v2._registry import state_of
from megatron_fsdp_v2.checkpoint._group import model_group
from megatron_fsdp_v2.testing import run_distributed

from _models import OddMLP, TinyGPT, all_ranks_ok, mlp_loss
from _models import agree as check

WORLD = 2
STRATEGY = "optim_grads_params"  # sharded main weights and optimizer state: one file per rank


# ---------------------------------------------------------------------- helpers

def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = fully_shard(OddMLP(), sharding_strategy=STRATEGY)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model, opt, steps: range, rank: int) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + rank)
        loss = mlp_loss(model, (torch.randn(4, 15, generator=g), torch.randn(4, 3, generator=g)))
        loss.backward()
        opt.step()
        opt.zero_grad()


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    """This rank's main-weight shards and optimizer state, copied."""
    groups = [g for m in model.modules() if (s := state_of(m)) is not None for g in s.groups]
    out = {f"main_weight[{i}]": g.main_weight.detach().clone() for i, g in enumerate(groups)}
    for pid, entries in opt.state_dict()["state"].items():
        for name, value in entries.items():
            value = value.to_local() if isinstance(value, DTensor) else value
            out[f"state[{pid}].{name}"] = value.detach().clone()
    return out


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected), f"{list(actual)} != {list(expected)}"
    for key, value in expected.items():
        assert torch.equal(actual[key], value), f"{key} differs"


def assert_differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert any(not torch.equal(a[k], b[k]) for k in a), "snapshots are equal"


def expect(what: str, kind: type[Exception], fn: Callable[[], Any], *fragments: str
           ) -> Exception | None:
    """``fn`` (run on every rank) must raise ``kind`` whose message contains ``fragments``.
    A ``BaseException`` such as DCP's ``CheckpointException`` is not caught: it fails the test
    on that rank."""
    caught: Exception | None = None
    try:
        fn()
        err = f"no {kind.__name__} raised"
    except kind as e:
        caught = e
        missing = [f for f in fragments if f not in str(e)]
        err = f"message {str(e)!r} lacks {missing}" if missing else None
    if not all_ranks_ok(err is None):
        raise AssertionError(f"{what}: {err or 'failed on another rank'}")
    return caught


@contextlib.contextmanager
def failing_write(active: bool) -> Iterator[None]:
    """On this rank (if ``active``): DCP writes its first item, then 64 bytes of the second
    one, then the disk "fails"."""
    original = dcp_fs._write_item
    calls = [0]

    def write_item(transforms, stream, data, write_item, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            stream.write(b"\x00" * 64)
            raise OSError("injected write failure")
        return original(transforms, stream, data, write_item, *args, **kwargs)

    if active:
        dcp_fs._write_item = write_item
    try:
        yield
    finally:
        dcp_fs._write_item = original


@contextlib.contextmanager
def failing_rename(active: bool, suffix: str) -> Iterator[None]:
    """On this rank (if ``active``): renaming a path ending in ``suffix`` fails."""
    original = os.rename

    def rename(src, dst, *args, **kwargs):
        if str(src).endswith(suffix):
            raise OSError(f"injected rename failure of {src}")
        return original(src, dst, *args, **kwargs)

    if active:
        os.rename = rename
    try:
        yield
    finally:
        os.rename = original


def no_leftovers(path: str) -> None:
    for suffix in (".incomplete", ".old"):
        assert not os.path.exists(path + suffix), f"{path + suffix} was left behind"


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


def _equal(actual: Any, expected: Any) -> None:
    assert actual == expected, f"{actual} != {expected}"


def _exists(path: str) -> None:
    assert os.path.exists(path), f"{path} is missing"


def test_failed_save_keeps_previous_checkpoint() -> None:
    """A save that fails on one rank mid-write, or on the coordinator mid-commit, raises on
    every rank and leaves the previous checkpoint whole (a load gives it back bitwise); a
    successful overwrite gives the new one bitwise; an interrupted commit is repaired."""
    with tempfile.TemporaryDirectory() as root:
        run_distributed(_atomic_worker, WORLD, root, timeout_s=120)


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


def test_corrupted_checkpoint_is_rejected_before_loading() -> None:
    """Bytes flipped in one shard file after a save: the load raises a ValueError naming the
    key and the file on every rank, with the model and optimizer unchanged bitwise; a
    checkpoint without a checksum file (plain ``dcp.save``) still loads."""
    with tempfile.TemporaryDirectory() as root:
        run_distributed(_checksum_worker, WORLD, root, timeout_s=120)


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


def _is_checkpoint_exception(exc: BaseException | None) -> None:
    assert exc is not None and isinstance(exc.__cause__, CheckpointException), (
        f"cause {None if exc is None else exc.__cause__!r}")


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


def test_clear_errors() -> None:
    """Saving to a regular file raises a ValueError naming it before anything is written; DCP's
    CheckpointException leaves save/load as a chained RuntimeError; an extra key the checkpoint
    lacks raises a ValueError naming it and listing the checkpoint's extra keys."""
    with tempfile.TemporaryDirectory() as root:
        run_distributed(_errors_worker, WORLD, root, timeout_s=120)


# ---------------------------------------------------------------------- collective groups

# Every torch.distributed collective the checkpoint code (or DCP, on its behalf) could call.
_COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
    "all_reduce", "all_to_all", "barrier", "broadcast", "broadcast_object_list", "gather",
    "gather_object", "monitored_barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "scatter", "scatter_object_list",
)


@contextlib.contextmanager
def recording_collectives() -> Iterator[list[tuple[str, Any]]]:
    """Record ``(name, group)`` of every ``torch.distributed.<collective>`` call (``group`` as
    passed: ``None`` is the default group)."""
    calls: list[tuple[str, Any]] = []
    originals = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}

    def recorder(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, signature.bind(*args, **kwargs).arguments.get("group")))
            return fn(*args, **kwargs)
        return call

    for name, fn in originals.items():
        setattr(dist, name, recorder(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _groups_of(model: torch.nn.Module) -> list[Any]:
    """The distinct process groups of ``model``'s units, in module order."""
    groups: list[Any] = []
    for m in model.modules():
        for g in state_of(m).groups if state_of(m) is not None else ():
            if all(g.process_group is not seen for seen in groups):
                groups.append(g.process_group)
    return groups


def _groups_worker(rank: int, world: int, root: str) -> None:
    torch.manual_seed(0)
    model = fully_shard(OddMLP(), sharding_strategy=STRATEGY, timeout=30)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, range(1), rank)
    (units,) = _groups_of(model)
    check("the units' group is the library's own", lambda: _equal(
        (units is not dist.group.WORLD, dist.get_process_group_ranks(units)),
        (True, list(range(world)))))
    path = os.path.join(root, "ckpt")
    full: dict[str, Any] = {}  # filled by get_full_state_dict below
    loaded: dict[str, Any] = {}  # filled by the user's own dcp.load below

    def manual_dcp_load() -> None:  # the user's own dcp.load: not recorded
        msd, osd = mckpt.get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        loaded.update(model_state_dict=msd, optim_state_dict=osd)

    def bad_full_state_dict() -> None:
        bad = {k: (v[:1] if k == "mid.weight" else v) for k, v in full.items()}
        expect("bad shape", ValueError, lambda: mckpt.load_full_state_dict(model, bad),
               "mid.weight")

    # (what, call, whether its collectives are checked)
    cases: list[tuple[str, Callable[[], Any], bool]] = [
        ("save", lambda: mckpt.save(model, opt, checkpoint_id=path, extra={"step": 1}), True),
        ("load", lambda: mckpt.load(model, opt, checkpoint_id=path, extra={"step": 0}), True),
        ("load rejecting a missing extra key", lambda: expect(
            "missing extra", ValueError,
            lambda: mckpt.load(model, opt, checkpoint_id=path, extra={"nope": 0}), "'nope'"), True),
        ("dcp.load by hand", manual_dcp_load, False),
        ("set_state_dict", lambda: mckpt.set_state_dict(model, opt, **loaded), True),
        ("get_full_state_dict", lambda: full.update(mckpt.get_full_state_dict(
            model, rank0_only=False)), True),
        ("load_full_state_dict", lambda: mckpt.load_full_state_dict(model, full), True),
        ("load_full_state_dict(broadcast_from_rank0=True)", lambda: mckpt.load_full_state_dict(
            model, full if rank == 0 else None, broadcast_from_rank0=True), True),
        ("load_full_state_dict rejecting a bad shape", bad_full_state_dict, True),
    ]
    wrong: dict[str, Any] = {}
    for what, fn, checked in cases:
        if not checked:
            fn()
            continue
        with recording_collectives() as calls:
            fn()
        # expect() agrees on its verdict with a collective of its own, on the default group.
        calls = [(n, g) for n, g in calls if not (what.endswith(("key", "shape"))
                                                  and n == "all_reduce" and g is None)]
        others = [(n, "default" if g is None else dist.get_process_group_ranks(g))
                  for n, g in calls if g is not units]
        if others or not calls:
            wrong[what] = others or "no collective"
    check("collectives on the units' group", lambda: _equal(wrong, {}))

    # Several groups over the same ranks (two timeouts): the root unit's group is the model's.
    torch.manual_seed(0)
    gpt = TinyGPT(layers=2)
    for block in gpt.blocks:
        fully_shard(block, sharding_strategy=STRATEGY, timeout=31)
    fully_shard(gpt, sharding_strategy=STRATEGY, timeout=30)
    groups = _groups_of(gpt)
    check("two library groups, the root's first", lambda: _equal(
        (len(groups), model_group(gpt) is groups[0], groups[0] is units), (2, True, True)))
    with recording_collectives() as calls:
        mckpt.load_full_state_dict(gpt, mckpt.get_full_state_dict(gpt, rank0_only=False))
    check("nested units: collectives on the units' groups", lambda: _equal(
        [n for n, g in calls if all(g is not u for u in groups)], []))


def test_checkpoint_collectives_run_on_the_units_group() -> None:
    """Every collective of save, load (its checks included), set_state_dict and the full state
    dict functions runs on the units' communication group (fully_shard's timeout), never on
    the default group."""
    with tempfile.TemporaryDirectory() as root:
        run_distributed(_groups_worker, WORLD, root, timeout_s=120)


SHORT_TIMEOUT_S = 3  # fully_shard's collective timeout in the test below
LATE_S = 15  # how long rank 1 stays away (alive, so its connections stay open)


def _missing_rank_worker(rank: int, world: int) -> float | None:
    torch.manual_seed(0)
    model = fully_shard(OddMLP(), sharding_strategy=STRATEGY, timeout=SHORT_TIMEOUT_S)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, range(1), rank)
    msd, osd = mckpt.get_state_dict(model, opt)
    dist.barrier()
    if rank == 1:  # never calls set_state_dict
        time.sleep(LATE_S)
        return None
    start = time.monotonic()
    try:
        mckpt.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    except RuntimeError:
        return time.monotonic() - start
    raise AssertionError("set_state_dict returned without rank 1")


def test_missing_rank_fails_within_the_units_timeout() -> None:
    """A rank that never calls set_state_dict makes the others raise after fully_shard's short
    timeout, not the default group's (60 s here) or when the missing rank exits."""
    elapsed = run_distributed(_missing_rank_worker, WORLD, timeout_s=60)[0]
    assert elapsed is not None and elapsed < LATE_S - 5, (
        f"rank 0 raised after {elapsed:.1f}s, expected about {SHORT_TIMEOUT_S}s")
