"""Which parameter classes a unit's flat buffers can hold (see the note below); checked at wrap
time by ``_wrap_checks.collect_managed_params``, before any buffer is built."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["check_param_class"]

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


def check_param_class(fqn: str, param: torch.Tensor) -> None:
    """Refuse a parameter of a tensor subclass the flat buffers cannot hold, naming it, its class
    and what to do (see [Note: tensor-subclass parameters])."""
    cls = type(param)
    if _is_plain_parameter_class(cls):
        return
    name = f"{cls.__module__}.{cls.__qualname__}"
    if isinstance(param, nn.UninitializedParameter):
        raise TypeError(
            f"parameter '{fqn}' is a {name} of a lazy module (nn.Lazy*), which has no shape "
            "yet; run one forward pass (or module.initialize_parameters(...)) to materialize "
            "it before fully_shard"
        )
    if cls.__module__.startswith("torchao.float8"):
        hint = (
            "torchao float8 training with enable_fsdp_float8_all_gather=True is not supported "
            "yet: convert with Float8LinearConfig(enable_fsdp_float8_all_gather=False) (weights "
            "are gathered in full precision and cast to float8 in each forward, which is "
            "supported)"
        )
    else:
        hint = (
            "fully_shard holds plain tensors only (a wrapper subclass would keep computing with "
            "its inner tensors from wrap time while the optimizer updates the flat buffers). "
            "If it is frozen (e.g. the quantized base weights of QLoRA), pass it in "
            "ignored_params: it then stays whole and unmanaged on every rank; otherwise convert "
            "it to a plain nn.Parameter before fully_shard"
        )
    raise TypeError(f"parameter '{fqn}' is a tensor subclass ({name}) that fully_shard does not "
                    f"support; {hint}")
