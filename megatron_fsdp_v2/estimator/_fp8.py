"""FP8 parameters in the estimate: torchao float8 linears with FP8 all-gathers (design.md §3
"FP8 parameters").

[Note: estimating FP8 parameters]
An FP8 group's FP8 buffers, its gathered dtype and its scales are made by the first refresh or
gather (``fsdp_pre_all_gather``, or the fused cast with precomputed scales), never by the wrap,
so on the meta model the estimate runs what a training iteration runs to make them, minus the
collectives, and then reads the runtime's own objects as for plain groups:

* torchao's ``precompute_float8_dynamic_scale_for_fsdp(model)`` on the wrapped meta model (the
  loop the estimate assumes calls it after every optimizer step, as torchtitan and
  ``examples/train.py --fp8`` do; it is also what a rank holding no row of a weight needs). Its
  collectives (one all-reduce of every amax, over the DTensors' sharded mesh dims; none under
  ``no_shard``) are recorded at the dispatcher, as ``examples/comm_counter.py`` counts them, and
  added to the iteration's;
* each FP8 group's refresh (``optim``/``optim_grads``: the persistent FP8 buffer) or gather
  (ZeRO-3, scratch buffers freed after) without its all-gather
  (``ExtensionGather.fill_without_collective``), which leaves the metadata scales in the compute
  weights as a real refresh does;

then ``memory_report`` counts ``fp8_weights`` and ``fp8_scales`` with the same code as in a real
run, and the gathers, refreshes and replayed scratch buffers of an FP8 group use its gathered
dtypes (``ExtensionGather.gathered_dtypes``: 1 byte per element for float8). Only torchao's
``WeightWithDynamicFloat8CastTensor`` is estimated: another subclass's pre-all-gather may
communicate or depend on values, which a meta model does not have.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .._runtime._flat_param_group import FlatParamGroup
from .._runtime._subclass_gather import has_all_gather_extensions

__all__ = ["convert_to_float8", "fp8_groups_filled", "gathered_dtypes", "refuse_other_subclasses"]

_TORCHAO = "torchao.float8"


def _torchao() -> Any:
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ImportError(
            f"estimating FP8 parameters needs torchao (float8 training), not importable here "
            f"({e}); pip install torchao, or estimate without float8/--param-dtype fp8"
        ) from e
    return float8


def convert_to_float8(model: nn.Module, selects: Callable[[nn.Module], bool]) -> None:
    """``estimate(float8=True)``: the ``nn.Linear`` modules inside the units ``selects`` picks
    (the blocks; the embedding and an output head outside them stay in the compute dtype, as
    torchtitan leaves its output layer) whose dims are multiples of 16 (float8 matmuls) become
    torchao float8 linears with FP8 all-gathers."""
    float8 = _torchao()
    inside = {id(sub) for unit in model.modules() if unit is not model and selects(unit)
              for sub in unit.modules()}
    from torchao.float8.float8_linear import Float8Linear

    float8.convert_to_float8_training(  # (a model_fn's own float8 linears are left as they are)
        model, config=float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True),
        module_filter_fn=lambda module, _fqn: id(module) in inside
        and not isinstance(module, Float8Linear)
        and module.in_features % 16 == 0 and module.out_features % 16 == 0,
    )


def refuse_other_subclasses(model: nn.Module) -> bool:
    """Whether ``model`` has FP8 parameters to estimate (torchao float8 with FP8 all-gathers);
    a parameter of another class with FSDP2's all-gather extensions raises
    ``NotImplementedError`` (see [Note: estimating FP8 parameters])."""
    found = False
    for name, param in model.named_parameters():
        if not has_all_gather_extensions(param):
            continue
        cls = type(param)
        if cls.__qualname__ != "WeightWithDynamicFloat8CastTensor" or \
                not cls.__module__.startswith(_TORCHAO):
            raise NotImplementedError(
                f"parameter {name!r} is a {cls.__module__}.{cls.__qualname__} with FSDP2 "
                "all-gather extensions: estimate counts torchao float8 weights "
                "(WeightWithDynamicFloat8CastTensor) only, whose all-gather inputs it can "
                "derive on a meta model; estimate the model without this subclass"
            )
        found = True
    return found


class _Collectives(TorchDispatchMode):
    """The collectives dispatched inside it: (kind, payload bytes, group size) each, payload
    being the largest tensor involved, as ``examples/comm_counter.py`` counts it."""

    _KINDS = {"all_reduce": "all_reduce"}
    _OTHERS = ("gather", "scatter", "reduce", "broadcast", "all_to_all", "alltoall", "send",
               "recv")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if DTensor in types:
            return NotImplemented  # DTensor desugars first; its collectives come back here
        out = func(*args, **(kwargs or {}))
        if getattr(func, "namespace", None) not in ("c10d", "_c10d_functional", "_dtensor"):
            return out
        name = func._overloadpacket.__name__.rstrip("_")
        kind = self._KINDS.get(name)
        if kind is None and not any(word in name for word in self._OTHERS):
            return out  # wait_tensor, autograd wrappers: no payload
        # _c10d_functional.all_reduce(tensor, reduce_op, group_name): the group's name is last.
        group = args[-1] if args and isinstance(args[-1], str) else None
        if kind is None or group is None:
            raise NotImplementedError(
                f"precompute_float8_dynamic_scale_for_fsdp issued {func}, which the estimate "
                "does not model (it expects one functional all-reduce of the amaxes)"
            )
        size = dist.distributed_c10d._resolve_process_group(group).size()  # type: ignore[arg-type]
        nbytes = max(t.numel() * t.element_size() for t in (args[0], out))
        self.seen.append((kind, nbytes, size))
        return out


def fp8_groups_filled(model: nn.Module, groups: list[FlatParamGroup]
                      ) -> list[tuple[str, int, int]]:
    """Run the scale precompute and every FP8 group's refresh or gather on the wrapped meta
    model (see [Note: estimating FP8 parameters]); returns the precompute's collectives per
    iteration: (kind, payload bytes, group size) each."""
    with _Collectives() as recorder:
        _torchao().precompute_float8_dynamic_scale_for_fsdp(model)
    for group in groups:
        if group.extension is not None and (group.plan.refresh_steps or group.plan.gather_steps):
            group.extension.fill_without_collective()
    return recorder.seen


def gathered_dtypes(group: FlatParamGroup) -> tuple[torch.dtype, ...]:
    """What a gather or refresh of ``group`` moves, one dtype per all-gather: the compute dtype,
    or an FP8 group's all-gather input dtypes."""
    if group.extension is None:
        return (group.dtypes.model,)
    return group.extension.gathered_dtypes
