"""Failures injected into a wrapped TinyGPT (``_models.TinyGPT`` with ``fully_shard`` blocks), for
the recovery and failing-rank tests: an exception raised inside a unit's forward or backward at
a known point of the collective schedule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

__all__ = ["InjectedError", "inject_failure", "raising"]


class InjectedError(RuntimeError):
    pass


def raising(exc: type[BaseException]) -> Callable[..., None]:
    """A hook (any arguments) that raises ``exc("injected")``."""
    def hook(*_: Any) -> None:
        raise exc("injected")
    return hook


def inject_failure(model: nn.Module, where: str,
                   exc: type[BaseException] = InjectedError) -> RemovableHandle:
    """Make the next forward (``where="forward"``: in block 1, block 2's gather prefetched) or
    backward raise inside a wrapped child. ``backward_early``: in block 1's backward, before any
    unit reduced; ``backward_late``: in block 0's backward, after block 1 launched its
    reduction."""
    if where == "forward":
        return model.blocks[1].fc1.register_forward_pre_hook(raising(exc))
    block = model.blocks[1] if where == "backward_early" else model.blocks[0]

    def arm(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(raising(exc))
    return block.fc1.register_forward_hook(arm)
