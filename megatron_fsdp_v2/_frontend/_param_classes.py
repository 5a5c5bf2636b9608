"""Which parameter classes a unit's flat buffers can hold (see the note below); checked at wrap
time by ``_wrap_checks.collect_managed_params``, before any buffer is built."""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import _registry
from .._runtime._subclass_gather import has_all_gather_extensions, values_names

__all__ = ["check_param_class", "extension_refusal"]

# [Note: tensor-subclass parameters]
# The library keeps a managed parameter's values in flat buffers of plain dtype and gives the
# module back its original parameter object with ``.data`` rebound to a view of those buffers
# (the compute parameter). That is only right for a parameter whose values *are* its storage: a
# plain ``nn.Parameter`` (or a Python subclass of it that changes no tensor behaviour, i.e. one
# that only carries attributes). A tensor subclass that wraps inner tensors (torchao's
# ``WeightWithDynamicFloat8CastTensor`` for FP8 all-gathers, ``NF4Tensor`` for QLoRA, MX/NVFP4
# tensors, ``TwoTensor``) computes with its inner tensors: rebinding ``.data`` reaches the wrapper,
# not what it computes with, so the optimizer would update the buffers while forward keeps using
# the inner tensors from wrap time -- training on stale weights with no error. Such a parameter,
# and any subclass that overrides ``__torch_function__``/``__torch_dispatch__``, is refused at
# wrap time by ``check_param_class``, before any buffer is built.
#
# The exception is a subclass that implements FSDP2's all-gather extensions
# (``fsdp_pre_all_gather``/``fsdp_post_all_gather``) around exactly one inner tensor with the
# parameter's shape and dtype (torchao's ``WeightWithDynamicFloat8CastTensor``): the flat buffers
# hold that inner tensor, and the library rebuilds the subclass over its buffer views and calls
# the extensions (see [Note: FSDP2 all-gather extensions] in ``_runtime/_subclass_gather.py``).
# A protocol over several inner tensors (torchao's ``NF4Tensor``) is refused: the flat buffers
# cannot honour it. On an HSDP (2-D) mesh it works with outer ``no_shard`` (every replica runs
# the 1-D design over the shard axis) and outer ``optim`` (the inner shard held as FP8 bytes,
# rebuilt by an outer FP8 all-gather after each step; design.md §3 "FP8 parameters").

_PLAIN_TORCH_FUNCTION = nn.Parameter.__torch_function__
_PLAIN_TORCH_DISPATCH = torch.Tensor.__torch_dispatch__


def _is_plain_parameter_class(cls: type) -> bool:
    """``nn.Parameter``, ``torch.Tensor``, or a Python subclass of ``nn.Parameter`` that keeps
    their tensor behaviour (see [Note: tensor-subclass parameters])."""
    if cls is nn.Parameter or cls is torch.Tensor:
        return True
    return (
        issubclass(cls, nn.Parameter)
        and not issubclass(cls, nn.UninitializedParameter)
        and getattr(cls, "__torch_function__", None) is _PLAIN_TORCH_FUNCTION
        and getattr(cls, "__torch_dispatch__", None) is _PLAIN_TORCH_DISPATCH
    )


def extension_refusal(param: torch.Tensor) -> str | None:
    """Why ``param``'s all-gather extensions cannot be honoured by the flat buffers, or None if
    they can (see [Note: tensor-subclass parameters]). Only asked of a class that defines both
    extension methods."""
    flatten = getattr(param, "__tensor_flatten__", None)
    if flatten is None:
        return "it does not define __tensor_flatten__/__tensor_unflatten__"
    inner_names, _ = flatten()
    inner = {n: t for n in inner_names if isinstance(t := getattr(param, n, None), torch.Tensor)}
    values = values_names(param)
    # Besides the values, only 0-d metadata: torchao's _precomputed_scale when the scale was
    # precomputed before fully_shard (dropped at wrap: the wrapped weights get their own).
    if len(values) != 1 or any(t.dim() for n, t in inner.items() if n not in values):
        return (f"its values are held by {len(inner)} inner tensors ({', '.join(inner_names)}), "
                "not by one inner tensor of the parameter's shape and dtype, which is what the "
                "flat buffers can hold")
    return None


def check_param_class(fqn: str, param: torch.Tensor) -> None:
    """Refuse a parameter of a tensor subclass the flat buffers cannot hold, naming it, its class
    and what to do (see [Note: tensor-subclass parameters]). (Plain parameters annotated by
    ``spmd_types``: [Note: spmd_types parameters] in ``_spmd_types.py``.)"""
    cls = type(param)
    if _is_plain_parameter_class(cls):
        return
    name = f"{cls.__module__}.{cls.__qualname__}"
    if has_all_gather_extensions(param) and not isinstance(param, nn.UninitializedParameter):
        why = extension_refusal(param)
        # (The estimator wraps meta models: nothing is materialized there, see [Note: meta
        # buffers] in _registry.)
        if why is None and param.device.type == "meta" and not _registry.meta_buffers[0]:
            raise NotImplementedError(
                f"parameter '{fqn}' is a {name} on the meta device: fully_shard does not "
                "materialize parameters with FSDP2 all-gather extensions yet; build the model "
                "on a real device before fully_shard (or convert it to float8 with "
                "enable_fsdp_float8_all_gather=False)"
            )
        if why is None:
            return  # gathered through its extensions (_runtime/_subclass_gather.py)
        raise TypeError(
            f"parameter '{fqn}' is a tensor subclass ({name}) with FSDP2 all-gather extensions "
            f"that fully_shard cannot honour: {why}. If it is frozen (e.g. the quantized base "
            "weights of QLoRA), pass it in ignored_params: it then stays whole and unmanaged on "
            "every rank; otherwise convert it to a plain nn.Parameter before fully_shard"
        )
    if isinstance(param, nn.UninitializedParameter):
        raise TypeError(
            f"parameter '{fqn}' is a {name} of a lazy module (nn.Lazy*), which has no shape "
            "yet; run one forward pass (or module.initialize_parameters(...)) to materialize "
            "it before fully_shard"
        )
    hint = (
            "fully_shard holds plain tensors only (a wrapper subclass would keep computing with "
            "its inner tensors from wrap time while the optimizer updates the flat buffers). "
            "If it is frozen (e.g. the quantized base weights of QLoRA), pass it in "
            "ignored_params: it then stays whole and unmanaged on every rank; otherwise convert "
            "it to a plain nn.Parameter before fully_shard"
        )
    raise TypeError(f"parameter '{fqn}' is a tensor subclass ({name}) that fully_shard does not "
                    f"support; {hint}")
