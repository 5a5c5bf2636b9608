"""Patch: ``torch.nn.utils.clip_grad_norm_`` (both names) and ``get_total_norm``, routed by
``_runtime/_clip_route.py`` (see [Note: torch clip_grad_norm_ route] there)."""

from __future__ import annotations

import functools
from typing import Any

import torch.nn.utils as nn_utils
import torch.nn.utils.clip_grad as clip_grad

from ._patch import Patch, PatchTarget, Plan

__all__ = ["PATCH", "install", "is_installed", "uninstall"]


def _plan() -> Plan:
    from .._runtime._clip_route import routed_clip_grad_norm_, routed_get_total_norm

    torch_clip = clip_grad.clip_grad_norm_

    @functools.wraps(torch_clip)
    def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
        return routed_clip_grad_norm_(torch_clip, *args, **kwargs)

    clip_grad_norm_.__doc__ = (
        f"{torch_clip.__doc__ or ''}\n\n    megatron_fsdp_v2: a list holding fully_shard "
        "parameters is handled by megatron_fsdp_v2.clip_grad_norm_ (same arguments).\n"
    )
    plan: Plan = [(PatchTarget(module, "clip_grad_norm_"), clip_grad_norm_)
                  for module in (clip_grad, nn_utils)
                  if vars(module).get("clip_grad_norm_") is torch_clip]
    torch_total = vars(nn_utils).get("get_total_norm")
    if torch_total is not None:
        @functools.wraps(torch_total)
        def get_total_norm(*args: Any, **kwargs: Any) -> Any:
            return routed_get_total_norm(torch_total, *args, **kwargs)

        get_total_norm.__doc__ = (
            f"{torch_total.__doc__ or ''}\n\n    megatron_fsdp_v2: gradients of "
            "fully_shard parameters are handled by megatron_fsdp_v2.utils.get_total_norm.\n"
        )
        plan.append((PatchTarget(nn_utils, "get_total_norm"), get_total_norm))
    return plan


PATCH = Patch(
    "clip_grad_norm",
    "torch's clip_grad_norm_/get_total_norm drop None gradients, so ranks with empty shards "
    "issue mismatched all-reduces; lists of our gradients go to the library's versions",
    _plan,
)
install, uninstall, is_installed = PATCH.install, PATCH.uninstall, PATCH.is_installed
