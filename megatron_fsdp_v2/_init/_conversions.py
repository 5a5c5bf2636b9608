"""Conversions of wrapped modules: ``.to()``, ``.float()``, ``.cuda()``, ``.to_empty()``...
(``nn.Module._apply``) applied through the flat buffers, or refused before anything changes.

[Note: conversions after wrapping]
``nn.Module._apply`` (behind ``.to()``, ``.float()``, ``.cuda()``, ``.to_empty()``...) would
replace the DTensor parameters that view the flat buffers. ``FSDPModule._apply`` first applies
the conversion to every managed parameter and classifies the result (``classify``): the same
object (a no-op ``.to``) changes nothing; a new tensor of the same kind, placements, shape,
dtype and device (``to_empty(device=<the buffers' device>)``, or any value-only map) is copied
into this rank's main weights, which are then marked updated (compute weights are refreshed
before the next forward), and clears a pending meta init: ``to_empty`` means the user
initializes (torchtitan: ``init_weights()`` writing in place through the DTensor parameters, or
``checkpoint.load_full_state_dict(..., broadcast_from_rank0=True)``). Anything else (another
dtype or device) raises ``NotImplementedError`` before anything changed. Non-managed tensors
(buffers, ignored parameters) go through ``nn.Module._apply`` as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import _registry
from ._materialize import mark_initialized_by_user

if TYPE_CHECKING:
    from .._runtime._flat_param_group import FlatParamGroup
    from .._runtime._state import FSDPState

__all__ = ["applying", "apply_to_units", "classify", "copy_converted"]


def applying() -> bool:
    """Inside a unit's ``_apply``, which already handled every unit below it."""
    return _registry.applying_depth[0] > 0


@contextlib.contextmanager
def _applying_conversion() -> Iterator[None]:
    _registry.applying_depth[0] += 1
    try:
        yield
    finally:
        _registry.applying_depth[0] -= 1


def classify(fn: Callable[[torch.Tensor], Any], param: nn.Parameter) -> str | None:
    """What ``fn`` (an ``nn.Module._apply`` conversion) does to the managed DTensor parameter
    ``param``: ``"same"`` (returns it), ``"copy"`` (a new value of the same kind, placements,
    shape, dtype and device: its values can be copied into the buffers), or ``None`` (anything
    else: not supported). See [Note: conversions after wrapping]."""
    try:
        out = fn(param)
    except Exception:  # noqa: BLE001 - any failure means it cannot be applied in place
        return None
    if out is param:
        return "same"
    local = param._local_tensor  # type: ignore[attr-defined]
    if (
        isinstance(out, DTensor)
        and isinstance(param, DTensor)
        and out.placements == param.placements
        and out.device_mesh == param.device_mesh
        and out.shape == param.shape
        and out.dtype == param.dtype
        and out._local_tensor.device == local.device
        and out._local_tensor.shape == local.shape
    ):
        return "copy"
    return None


@torch.no_grad()
def copy_converted(fn: Callable[[torch.Tensor], Any], group: FlatParamGroup, index: int) -> None:
    """Apply ``fn`` (classified ``"copy"``) to parameter ``index`` of ``group`` again and write
    the result into this rank's main weights; the caller marks the group updated."""
    param = group.records[index].dist_param
    out = fn(param)
    param._local_tensor.copy_(out._local_tensor)  # type: ignore[attr-defined]


def apply_to_units(
    module: nn.Module, states: list[FSDPState], fn: Callable[[torch.Tensor], Any],
    module_apply: Callable[[], Any],
) -> Any:
    """``module._apply(fn)`` for the units ``states`` (``module``'s own, and those below it when
    recursing): check that every managed parameter can take ``fn``, copy the values of those it
    changes into the main weights, then run ``module_apply`` (``nn.Module._apply``) over
    everything else, the managed parameters hidden from it. See [Note: conversions after
    wrapping]."""
    to_copy: list[tuple[FlatParamGroup, int]] = []
    for state in states:
        for group in state.groups:
            for index, (fqn, dist_param) in enumerate(zip(group.fqns, group.dist_params)):
                verdict = classify(fn, dist_param)
                if verdict is None:
                    raise NotImplementedError(
                        f"{type(module).__name__}: converting or moving parameters after "
                        f"fully_shard is not supported (parameter '{fqn}' would change "
                        f"dtype or device from {dist_param.dtype} on {group.device}); "
                        "nothing was changed. Call .to(device/dtype), .bfloat16(), "
                        ".double() before fully_shard (to_empty(device=...) after it only "
                        f"to {group.device}), and use MixedPrecisionPolicy(param_dtype=...) "
                        "for compute in another dtype"
                    )
                if verdict == "copy":
                    to_copy.append((group, index))
    # Every parameter can take the conversion: only now does anything change.
    for group, index in to_copy:
        copy_converted(fn, group, index)
        group.mark_main_weights_updated()
    if to_copy:
        for state in states:
            mark_initialized_by_user(state.module)
    # Managed parameters stay as they are: hide them from nn.Module._apply, then put them
    # back in their original order (parameters() order is the optimizer's).
    hidden: list[tuple[dict[str, Any], list[str], dict[str, Any]]] = []
    for state in states:
        for parameters, mapping in state.registered_params.dist_registration:
            order = list(parameters)
            popped = {name: parameters.pop(name) for name in mapping if name in parameters}
            if popped:
                hidden.append((parameters, order, popped))
    try:
        with _applying_conversion():
            return module_apply()
    finally:
        for parameters, order, popped in reversed(hidden):
            rest = dict(parameters)
            parameters.clear()
            for name in order:
                parameters[name] = popped[name] if name in popped else rest.pop(name)
            parameters.update(rest)
