"""Patch: ``torch.distributed.checkpoint.state_dict._get_optim_state_dict``, with
``_runtime/_optim_state_check.py``'s check in front (every rank refuses a full optimizer state
dict that would pair different tensors)."""

from __future__ import annotations

import functools
from typing import Any

from ._patch import Patch, PatchTarget, Plan

__all__ = ["PATCH", "install", "is_installed", "uninstall"]


def _plan() -> Plan:
    from torch.distributed.checkpoint import state_dict as dsd

    from .._runtime._optim_state_check import check_full_optim_state_dict

    torch_fn = dsd._get_optim_state_dict

    @functools.wraps(torch_fn)
    def _get_optim_state_dict(model: Any, optimizers: Any, info: Any) -> Any:
        check_full_optim_state_dict(optimizers, info)
        return torch_fn(model, optimizers, info)

    return [(PatchTarget(dsd, "_get_optim_state_dict"), _get_optim_state_dict)]


PATCH = Patch(
    "optim_state_dict",
    "torch gathers full optimizer states rank by rank in each rank's own order; a rank with an "
    "empty shard has no state, so ranks would pair different tensors (refused on every rank)",
    _plan,
)
install, uninstall, is_installed = PATCH.install, PATCH.uninstall, PATCH.is_installed
