"""Patch: DTensor's ``redistribute_local_tensor`` (in every module that holds it) and
``OpDispatcher.redistribute_local_args``, with the uneven-shard gather of
``_dtensor/_redistribute.py`` (see [Note: uneven redistribution] there)."""

from __future__ import annotations

import functools
from typing import Any

from ._patch import Patch, PatchTarget, Plan
from ._targets import modules_holding

__all__ = ["PATCH", "install", "is_installed", "uninstall"]

# Modules that hold ``redistribute_local_tensor`` under that name on torch 2.14 (the defining
# module, and those that imported it by name). A module missing from a torch version is skipped.
_HOLDERS = (
    "torch.distributed.tensor._redistribute",
    "torch.distributed.tensor._api",
    "torch.distributed.tensor._dispatch",
    "torch.distributed.tensor.experimental._tp_transform",
)
_NAME = "redistribute_local_tensor"


def _plan() -> Plan:
    from torch.distributed.tensor import _redistribute as torch_redistribute_module
    from torch.distributed.tensor._dispatch import OpDispatcher

    from .._dtensor import _redistribute as logic

    torch_redistribute = torch_redistribute_module.redistribute_local_tensor
    torch_args = OpDispatcher.redistribute_local_args  # the function under the staticmethod

    @functools.wraps(torch_redistribute)
    def redistribute_local_tensor(local_tensor: Any, current_spec: Any, target_spec: Any,
                                  **kwargs: Any) -> Any:
        return logic.redistribute_local_tensor(
            torch_redistribute, local_tensor, current_spec, target_spec, **kwargs
        )

    @functools.wraps(torch_args)
    def redistribute_local_args(op_info: Any, suggested_input_schema: Any,
                                use_val_from_redistribute_schema: bool) -> None:
        logic.redistribute_local_args(
            torch_args, torch_redistribute, op_info, suggested_input_schema,
            use_val_from_redistribute_schema,
        )

    plan: Plan = [(target, redistribute_local_tensor)
                  for target in modules_holding(_HOLDERS, _NAME, torch_redistribute)]
    plan.append((PatchTarget(OpDispatcher, "redistribute_local_args"),
                 staticmethod(redistribute_local_args)))
    return plan


PATCH = Patch(
    "redistribute",
    "DTensor pads and unpads Shard(d) by torch.chunk sizes; fully_shard's rows are uneven, so "
    "full_tensor()/redistribute()/implicit redistributions need the true sizes gathered first",
    _plan,
)
install, uninstall, is_installed = PATCH.install, PATCH.uninstall, PATCH.is_installed
