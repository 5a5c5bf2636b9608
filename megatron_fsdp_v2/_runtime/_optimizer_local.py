"""The optimizer step on local tensors (see [Note: local optimizer step]).

[Note: local optimizer step]
The optimizer-facing parameters are DTensors, so a ``torch.optim`` step dispatches every one of
its per-parameter ops (about twelve per parameter for a for-loop AdamW) through DTensor's
Python dispatcher. Measured (``benchmarks/bench_optimizer_step.py``, one CPU process): AdamW
over the 29.5M-parameter GPT's 101 parameters 96 ms through DTensor, 75 ms on the local
tensors, 80 ms for plain torch; SGD over 128 tiny parameters 5.6 ms, 1.5 ms and 0.8 ms.

For optimizers whose update of a parameter reads only that parameter's own elements (the
classes in ``ELEMENTWISE_OPTIMIZERS``), running the step on the DTensors' local tensors gives
the same bits: DTensor runs exactly these ops on exactly these local tensors, with no
collective (the placements are ``Replicate`` or ``Shard``, and an elementwise op needs no
redistribution). So the global pre-step hook swaps, in the optimizer's own lists, each managed
DTensor parameter for its local tensor, that tensor's ``.grad`` for the local gradient, and
each per-parameter state tensor for its local tensor; the post-step hook swaps everything
back, and wraps state tensors the step created (the first step) as DTensors with the
parameter's placements, which is what the DTensor step would have created.

Any doubt keeps the DTensor step: another optimizer class (it may read other elements, e.g. a
norm per parameter), a subclass (it may override ``step``), a ``differentiable`` group, step
hooks other than ours (user hooks must see what they saw before), a gradient that is not a
DTensor, per-parameter state that is not a DTensor placed as its parameter (e.g. loaded by hand:
DTensor would redistribute it or refuse, a local tensor might broadcast), a DTensor parameter
this library does not manage, or ``torch.compile`` tracing the step. A step that raises leaves
the swap in place; the next step, ``state_dict`` or ``load_state_dict`` of that optimizer undoes
it first.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import optimizer as torch_optimizer

from .. import _registry

__all__ = [
    "ELEMENTWISE_OPTIMIZERS", "LocalSwap", "ParamPositions", "restore", "swap_in_local_tensors",
]

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
    # Rprop's masked assignments (``sign[sign.gt(0)] = etaplus``) are in-place index_put_ on a
    # sharded mask, which DTensor refuses; on the local rows they are what one process does.
    torch.optim.Rprop,
)
# Their state tensors shaped like the parameter (DTensors under the DTensor step); ``step`` is
# a plain scalar tensor either way.
_PER_PARAM_STATE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer",
                              "prev", "step_size"})


@dataclass
class LocalSwap:
    """What a local step swapped in one optimizer's lists, to swap back after it."""

    # (the param group's list, index, the DTensor parameter, its local tensor)
    params: list[tuple[list[Any], int, DTensor, torch.Tensor]] = field(default_factory=list)
    # id of a local state tensor -> the DTensor state it came from (reused on the way back)
    state_of_local: dict[int, DTensor] = field(default_factory=dict)


def _only_our_hooks(optimizer: torch.optim.Optimizer) -> bool:
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return False
    handles = _registry.optimizer_hook_handles  # [our pre-step hook, our post-step hook]
    pre = getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
    post = getattr(torch_optimizer, "_global_optimizer_post_hooks", None)
    return (
        len(handles) == 2 and pre is not None and post is not None
        and list(pre) == [handles[0].id] and list(post) == [handles[1].id]
    )


def _eligible(optimizer: torch.optim.Optimizer) -> bool:
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS or torch.compiler.is_compiling():
        return False
    if any(group.get("differentiable", False) for group in optimizer.param_groups):
        return False
    return _only_our_hooks(optimizer)


def _placed_as(value: Any, p: DTensor) -> bool:
    return value is None or isinstance(value, DTensor) and (
        value.placements == p.placements and value.device_mesh == p.device_mesh
        and value.shape == p.shape and value._local_tensor.shape == p._local_tensor.shape
    )


@dataclass
class ParamPositions:
    """Where an optimizer holds managed DTensor parameters (cached: the hook runs every step)."""

    param_count: int
    generation: int
    # (the param group's list, index, the DTensor parameter)
    entries: list[tuple[list[Any], int, DTensor]]
    # id(parameter) -> its per-parameter state values last seen placed as the parameter
    placed_state: dict[int, tuple[Any, ...]] = field(default_factory=dict)


def _find_positions(optimizer: torch.optim.Optimizer) -> ParamPositions | None:
    """The managed DTensor parameters of ``optimizer`` and where they are (cached while its
    lists hold the same objects); None if it holds a DTensor this library does not manage."""
    param_count = sum(len(g["params"]) for g in optimizer.param_groups)
    cached = _registry.local_step_positions.get(optimizer)
    if (
        cached is not None and cached.param_count == param_count
        and cached.generation == _registry.wrap_generation[0]
        and all(params[index] is p for params, index, p in cached.entries)
    ):
        return cached
    entries = []
    for group in optimizer.param_groups:
        for index, p in enumerate(group["params"]):
            if isinstance(p, DTensor):
                if _registry.record_of(p) is None:
                    _registry.local_step_positions.pop(optimizer, None)
                    return None
                entries.append((group["params"], index, p))
    found = ParamPositions(param_count, _registry.wrap_generation[0], entries)
    _registry.local_step_positions[optimizer] = found
    return found


def swap_in_local_tensors(optimizer: torch.optim.Optimizer) -> None:
    """Before ``optimizer.step()``: let it step on local tensors where that gives the same
    bits (see [Note: local optimizer step]); a no-op otherwise."""
    restore(optimizer)  # a step that raised left its swap behind
    if not _eligible(optimizer):
        return
    positions = _find_positions(optimizer)
    if positions is None:
        return  # a DTensor we do not manage: the DTensor step
    state = optimizer.state
    swaps: list[tuple[list[Any], int, DTensor, torch.Tensor]] = []
    for params, index, p in positions.entries:
        grad = p.grad
        if not (grad is None or isinstance(grad, DTensor)):
            return  # a plain gradient: the DTensor step
        param_state = state.get(p)
        if param_state:
            values = tuple(map(param_state.get, _PER_PARAM_STATE))
            seen = positions.placed_state.get(id(p))
            if seen is None or not all(map(operator.is_, seen, values)):
                if not all(_placed_as(value, p) for value in values):
                    return  # state placed otherwise (DTensor would redistribute it, or refuse)
                positions.placed_state[id(p)] = values
        swaps.append((params, index, p, p._local_tensor))
    if not swaps:
        return
    swap = LocalSwap()
    for params, index, p, local in swaps:
        grad = p.grad
        local.grad = grad._local_tensor if isinstance(grad, DTensor) else None
        params[index] = local
        param_state = state.pop(p, None)
        if param_state is not None:
            local_state = {}
            for key, value in param_state.items():
                if isinstance(value, DTensor):
                    swap.state_of_local[id(value._local_tensor)] = value
                    value = value._local_tensor
                local_state[key] = value
            state[local] = local_state
    swap.params = swaps
    _registry.local_step_swaps[optimizer] = swap
    if optimizer not in _registry.local_step_restore_hooked:
        optimizer.register_state_dict_pre_hook(restore)
        optimizer.register_load_state_dict_pre_hook(lambda opt, state_dict: restore(opt))
        _registry.local_step_restore_hooked.add(optimizer)


def restore(optimizer: torch.optim.Optimizer) -> None:
    """Undo :func:`swap_in_local_tensors`: the DTensor parameters back in the optimizer's lists,
    its state keyed by them again, with DTensor values (new ones for state the step created)."""
    swap = _registry.local_step_swaps.pop(optimizer, None)
    if swap is None:
        return
    state = optimizer.state
    for params, index, p, local in swap.params:
        params[index] = p
        local.grad = None
        local_state = state.pop(local, None)
        if local_state is None:
            continue
        param_state = {}
        for key, value in local_state.items():
            if key in _PER_PARAM_STATE and isinstance(value, torch.Tensor) and not isinstance(
                    value, DTensor):
                original = swap.state_of_local.get(id(value))
                if original is not None and original._local_tensor is value:
                    value = original
                else:
                    value = DTensor.from_local(
                        value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                        stride=p.stride(),
                    )
            param_state[key] = value
        state[p] = param_state
