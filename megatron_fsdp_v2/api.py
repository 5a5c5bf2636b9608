"""Public configuration types: sharding strategies and the mixed-precision policy. No logic beyond
validation and dtype resolution."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["ShardingStrategy", "MixedPrecisionPolicy", "ResolvedDtypes", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class ShardingStrategy(str, enum.Enum):
    """What each rank keeps sharded. Names and integer codes follow Megatron-FSDP.

    ========================  =============  ============  ==========
    strategy                  model weights  main weights  main grads
    ========================  =============  ============  ==========
    ``no_shard`` (0, DDP)     replicated     replicated    replicated
    ``optim`` (1, ZeRO-1)     replicated     sharded       replicated
    ``optim_grads`` (2, Z-2)  replicated     sharded       sharded
    ``optim_grads_params`` 3  sharded        sharded       sharded
    ========================  =============  ============  ==========
    """

    NO_SHARD = "no_shard"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"

    @classmethod
    def parse(cls, value: ShardingStrategy | str | int) -> ShardingStrategy:
        """Accept a member, its name (``"optim_grads"``) or its Megatron-FSDP code (0-3)."""
        if isinstance(value, ShardingStrategy):
            return value
        if isinstance(value, bool):  # bool is an int; reject it explicitly
            raise TypeError(f"sharding_strategy must be a str or int, got {value!r}")
        if isinstance(value, int):
            members = list(cls)
            if 0 <= value < len(members):
                return members[value]
        elif isinstance(value, str):
            for member in cls:
                if member.value == value.lower():
                    return member
        else:
            raise TypeError(
                f"sharding_strategy must be a str or int, got {type(value).__name__}"
            )
        valid = ", ".join(f"{m.value!r} ({i})" for i, m in enumerate(cls))
        raise ValueError(f"unknown sharding_strategy {value!r}; valid strategies are {valid}")

    @property
    def shards_main_weights(self) -> bool:
        return self is not ShardingStrategy.NO_SHARD

    @property
    def shards_grads(self) -> bool:
        return self in (ShardingStrategy.OPTIM_GRADS, ShardingStrategy.OPTIM_GRADS_PARAMS)

    @property
    def shards_model_weights(self) -> bool:
        return self is ShardingStrategy.OPTIM_GRADS_PARAMS


class ResolvedDtypes(NamedTuple):
    """The dtypes of one flat group's buffers."""

    model: torch.dtype  # compute weights (what forward/backward see)
    main: torch.dtype  # optimizer-facing weights
    grad: torch.dtype  # main grads (equal to ``main``: optimizers need grad.dtype == param.dtype)
    comm: torch.dtype  # gradient reduction


def _check_dtype(name: str, dtype: torch.dtype | None) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"MixedPrecisionPolicy.{name} must be a torch.dtype or None, got {dtype!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"MixedPrecisionPolicy.{name}={dtype} is not supported; use one of {SUPPORTED_DTYPES}"
        )


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of compute weights, optimizer weights, gradients and gradient communication.

    Both vocabularies are accepted; each pair below names the same thing:

    * ``param_dtype`` (FSDP2): dtype of the compute weights. Unset: the parameters' dtype at wrap
      time (Megatron-FSDP: cast the model before wrapping).
    * ``main_params_dtype`` (Megatron-FSDP): dtype of the optimizer-facing weights. Unset: the
      parameters' dtype at wrap time, so ``param_dtype=bf16`` on an fp32 model keeps fp32 main
      weights, as FSDP2 keeps fp32 sharded parameters.
    * ``main_grads_dtype`` (Megatron-FSDP): dtype of the gradients the optimizer sees. It must
      equal the main weight dtype (``param.grad.dtype == param.dtype``); unset means equal.
    * ``grad_comm_dtype`` (Megatron-FSDP) and ``reduce_dtype`` (FSDP2): the dtype gradients are
      reduced in. Unset: the main grad dtype. Setting both to different values is an error.
    * ``cast_forward_inputs`` (FSDP2): cast floating-point forward inputs of each unit to the
      compute dtype when ``param_dtype`` is set.
    * ``output_dtype`` (FSDP2): cast floating-point forward outputs of each unit to this dtype
      (unset: outputs keep the dtype the unit's forward produced).

    FSDP2's own ``torch.distributed.fsdp.MixedPrecisionPolicy`` is accepted by ``fully_shard``
    too (see :meth:`from_fsdp2`). One default differs: FSDP2 reduces gradients in
    ``param_dtype`` when ``reduce_dtype`` is unset, this class in the main grad dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    main_params_dtype: torch.dtype | None = None
    main_grads_dtype: torch.dtype | None = None
    grad_comm_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    output_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "main_params_dtype", "main_grads_dtype",
                     "grad_comm_dtype", "output_dtype"):
            _check_dtype(name, getattr(self, name))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                "MixedPrecisionPolicy.cast_forward_inputs must be a bool, got "
                f"{type(self.cast_forward_inputs).__name__}"
            )
        if (
            self.reduce_dtype is not None
            and self.grad_comm_dtype is not None
            and self.reduce_dtype != self.grad_comm_dtype
        ):
            raise ValueError(
                f"MixedPrecisionPolicy: reduce_dtype={self.reduce_dtype} and grad_comm_dtype="
                f"{self.grad_comm_dtype} name the same setting with different values; set one"
            )
        if (
            self.main_grads_dtype is not None
            and self.main_params_dtype is not None
            and self.main_grads_dtype != self.main_params_dtype
        ):
            raise ValueError(
                f"MixedPrecisionPolicy: main_grads_dtype={self.main_grads_dtype} differs from "
                f"main_params_dtype={self.main_params_dtype}; the optimizer needs gradients in "
                "the dtype of the parameters it updates. Set them equal (or leave "
                "main_grads_dtype unset) and use grad_comm_dtype for a cheaper reduction"
            )

    @classmethod
    def from_fsdp2(cls, policy: object) -> MixedPrecisionPolicy:
        """The equivalent of FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy`` (or
        anything with its four fields): same compute, reduction and output dtypes, same input
        casting. FSDP2 keeps sharded parameters and gradients in the parameters' own dtype, as
        the unset ``main_params_dtype`` does here, and reduces in ``param_dtype`` when
        ``reduce_dtype`` is unset, which is made explicit."""
        param_dtype = getattr(policy, "param_dtype", None)
        reduce_dtype = getattr(policy, "reduce_dtype", None)
        return cls(
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype if reduce_dtype is not None else param_dtype,
            output_dtype=getattr(policy, "output_dtype", None),
            cast_forward_inputs=getattr(policy, "cast_forward_inputs", True),
        )

    def resolve(self, original_dtype: torch.dtype) -> ResolvedDtypes:
        """Buffer dtypes for parameters whose dtype at wrap time is ``original_dtype``."""
        model = self.param_dtype or original_dtype
        main = self.main_params_dtype or original_dtype
        grad = self.main_grads_dtype or main
        if grad != main:
            raise ValueError(
                f"MixedPrecisionPolicy: main_grads_dtype={grad} differs from the main weight "
                f"dtype {main} (parameters are {original_dtype}); set main_params_dtype={grad} "
                "or leave main_grads_dtype unset"
            )
        comm = self.grad_comm_dtype or self.reduce_dtype or grad
        return ResolvedDtypes(model, main, grad, comm)
