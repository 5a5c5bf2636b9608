"""Patch: ``torch.optim.Optimizer.zero_grad``, followed by ``_runtime/_optimizer_hooks.py``'s
note of the gradients zeroed in place (see [Note: gradients known without a host read] in
``_runtime/_zeroed_grads.py``)."""

from __future__ import annotations

import functools

import torch

from ._patch import Patch, Plan, Slot

__all__ = ["PATCH", "install", "is_installed", "uninstall"]


def _plan() -> Plan:
    from .._runtime._optimizer_hooks import zero_grad as logic

    torch_fn = torch.optim.Optimizer.zero_grad

    @functools.wraps(torch_fn)
    @torch._disable_dynamo  # as torch's own: host-side bookkeeping, nothing to compile
    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        logic(torch_fn, self, set_to_none)

    return [(Slot(torch.optim.Optimizer, "zero_grad"), zero_grad)]


PATCH = Patch(
    "zero_grad",
    "torch has no zero_grad hook; zero_grad(set_to_none=False) must tell the groups which "
    "installed gradients are zero, so no value is read back to learn it",
    _plan,
)
install, uninstall, is_installed = PATCH.install, PATCH.uninstall, PATCH.is_installed
