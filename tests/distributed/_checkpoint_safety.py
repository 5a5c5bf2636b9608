"""What the ``test_checkpoint_safety_*`` files share: a model and optimizer to checkpoint,
snapshots compared bitwise, and failures injected into DCP's writes and renames.

Every failure is injected on one rank only; every rank must raise (no hang: each spawn has a
timeout), and whatever is loaded afterwards must be exactly (bitwise) one complete checkpoint.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import fully_shard

# private: the units' parameter groups (flat buffers) a failed load must leave unchanged
from megatron_fsdp_v2._registry import state_of

from _models import OddMLP, all_ranks_ok, mlp_loss

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


def _equal(actual: Any, expected: Any) -> None:
    assert actual == expected, f"{actual} != {expected}"


def _exists(path: str) -> None:
    assert os.path.exists(path), f"{path} is missing"


def _is_checkpoint_exception(exc: BaseException | None) -> None:
    assert exc is not None and isinstance(exc.__cause__, CheckpointException), (
        f"cause {None if exc is None else exc.__cause__!r}")
