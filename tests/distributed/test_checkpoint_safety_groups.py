"""Checkpoint safety: every checkpoint collective runs on the units' communication group, so a
missing rank fails the others after ``fully_shard``'s timeout (see ``_checkpoint_safety.py``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _checkpoint_safety import (
    STRATEGY,
    WORLD,
    _equal,
    expect,
    train,
)

from megatron_fsdp_v2 import checkpoint as mckpt
from megatron_fsdp_v2 import fully_shard

# private: the units' parameter groups (flat buffers) a checkpoint writes
from megatron_fsdp_v2._registry import state_of
from megatron_fsdp_v2.checkpoint._process_group import model_process_group
from megatron_fsdp_v2.testing import run_distributed

from _models import OddMLP, TinyGPT
from _models import agree as check
from _pool import RankPools

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
        (len(groups), model_process_group(gpt) is groups[0], groups[0] is units), (2, True, True)))
    with recording_collectives() as calls:
        mckpt.load_full_state_dict(gpt, mckpt.get_full_state_dict(gpt, rank0_only=False))
    check("nested units: collectives on the units' groups", lambda: _equal(
        [n for n, g in calls if all(g is not u for u in groups)], []))


def test_checkpoint_collectives_run_on_the_units_group(ranks: RankPools) -> None:
    """Every collective of save, load (its checks included), set_state_dict and the full state
    dict functions runs on the units' communication group (fully_shard's timeout), never on
    the default group."""
    with tempfile.TemporaryDirectory() as root:
        ranks.run(_groups_worker, WORLD, root, timeout_s=120)


SHORT_TIMEOUT_S = 3  # fully_shard's collective timeout in the test below
LATE_S = 15  # the longest rank 1 stays away (alive, so its connections stay open)


def _missing_rank_worker(rank: int, world: int, failed_path: str) -> float | None:
    torch.manual_seed(0)
    model = fully_shard(OddMLP(), sharding_strategy=STRATEGY, timeout=SHORT_TIMEOUT_S)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, range(1), rank)
    msd, osd = mckpt.get_state_dict(model, opt)
    dist.barrier()
    if rank == 1:  # never calls set_state_dict; stays until rank 0 has failed (or LATE_S)
        deadline = time.monotonic() + LATE_S
        while not os.path.exists(failed_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    start = time.monotonic()
    try:
        mckpt.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    except RuntimeError:
        elapsed = time.monotonic() - start
        open(failed_path, "w").close()
        return elapsed
    raise AssertionError("set_state_dict returned without rank 1")


def test_missing_rank_fails_within_the_units_timeout() -> None:
    """A rank that never calls set_state_dict makes the others raise after fully_shard's short
    timeout, not the default group's (60 s here) or when the missing rank exits (it exits only
    once rank 0 has failed, or after LATE_S)."""
    with tempfile.TemporaryDirectory() as root:
        elapsed = run_distributed(_missing_rank_worker, WORLD, os.path.join(root, "failed"),
                                  timeout_s=60)[0]
    assert elapsed is not None and elapsed < LATE_S - 5, (
        f"rank 0 raised after {elapsed:.1f}s, expected about {SHORT_TIMEOUT_S}s")
