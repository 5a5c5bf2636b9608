"""Patch: ``torch.autograd.grad``, refused with respect to fully_shard parameters by
``_runtime/_autograd_guard.py`` (see [Note: autograd.grad with respect to parameters] there)."""

from __future__ import annotations

import functools
from typing import Any

import torch.autograd

from ._patch import Patch, Plan, Slot

__all__ = ["PATCH", "install", "is_installed", "uninstall"]


def _plan() -> Plan:
    from .._runtime._autograd_guard import guarded_grad

    torch_fn = torch.autograd.grad

    @functools.wraps(torch_fn)
    def grad(outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        return guarded_grad(torch_fn, outputs, inputs, *args, **kwargs)

    return [(Slot(torch.autograd, "grad"), grad)]


PATCH = Patch(
    "autograd_grad",
    "the parameters' graph is on compute copies and their gradients exist only through "
    "backward(); autograd.grad would return None silently, so it raises naming the fix",
    _plan,
)
install, uninstall, is_installed = PATCH.install, PATCH.uninstall, PATCH.is_installed
