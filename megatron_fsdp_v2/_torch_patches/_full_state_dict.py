"""Patch: ``torch.distributed._state_dict_utils._distribute_state_dict`` and
``_distribute_tensors`` (and their names in ``checkpoint.state_dict``), with
``_runtime/_torch_full_state_dict.py``'s cut at our rows, and ``checkpoint.state_dict.
_load_model_state_dict``, with its rank-agreed model load in the combined ``set_state_dict``
with ``broadcast_from_rank0`` (see [Note: torch's full-state-dict loads] there)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ._patch import Patch, PatchTarget, Plan
from ._targets import modules_holding

__all__ = ["PATCH", "install", "is_installed", "uninstall"]

_HOLDERS = ("torch.distributed._state_dict_utils", "torch.distributed.checkpoint.state_dict")


def _wrap(torch_fn: Callable[..., None], logic: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(torch_fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        logic(torch_fn, *args, **kwargs)

    return wrapper


def _wrap_returning(torch_fn: Callable[..., Any], logic: Callable[..., Any]
                    ) -> Callable[..., Any]:
    @functools.wraps(torch_fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return logic(torch_fn, *args, **kwargs)

    return wrapper


def _plan() -> Plan:
    from torch.distributed import _state_dict_utils as utils

    from .._runtime import _torch_full_state_dict as logic

    plan: Plan = []
    for name, replacement in (("_distribute_state_dict", logic.distribute_state_dict),
                              ("_distribute_tensors", logic.distribute_tensors)):
        torch_fn = vars(utils).get(name)
        if torch_fn is None:
            continue
        wrapper = _wrap(torch_fn, replacement)
        plan.extend((target, wrapper) for target in modules_holding(_HOLDERS, name, torch_fn))
    from torch.distributed.checkpoint import state_dict as dsd

    load_model = vars(dsd).get("_load_model_state_dict")
    if load_model is not None:
        plan.append((PatchTarget(dsd, "_load_model_state_dict"),
                     _wrap_returning(load_model, logic.load_model_state_dict)))
    return plan


PATCH = Patch(
    "full_state_dict",
    "torch cuts full tensors at torch.chunk rows (distribute_tensor) before any hook of ours "
    "runs, in set_model/optimizer_state_dict(full_state_dict=True); its combined set_state_dict "
    "with broadcast_from_rank0 loads the model on rank 0 only (a hang)",
    _plan,
)
install, uninstall, is_installed = PATCH.install, PATCH.uninstall, PATCH.is_installed
