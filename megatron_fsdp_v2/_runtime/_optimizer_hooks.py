"""The optimizer side: global ``torch.optim`` step hooks, installed by the first ``fully_shard``
call (nothing at import time).

Before a step they catch an optimizer built before wrapping (it holds the compute parameters,
which would be updated as stale copies that never see a gradient), reduce gradients of a window
no backward marked last, and mark the groups the optimizer holds for the refresh of their
compute weights (see [Note: replicated-buffer refresh]), and let an elementwise optimizer step on
the local tensors (see [Note: local optimizer step]), or hand ``torch.optim.Muon`` its step on
whole matrices as a closure (see [Note: distributed Muon] in ``_muon.py``); after it, swap the
DTensors back, give back the gradients the Muon step hid, and mark the groups again.
``optimizer.zero_grad`` needs nothing from here: however the gradients were cleared, the next
window takes it in without reading a value (see [Note: gradients known without a host read] in
``_zeroed_grads.py``).

The first time they see an optimizer that holds managed parameters they also give it
``state_dict`` / ``load_state_dict`` post-hooks (``_state_dict_hooks.optimizer_*``), so that
``torch.distributed.checkpoint.state_dict``'s ``get_state_dict`` / ``set_state_dict`` with
``dcp.save`` / ``dcp.load`` handle its uneven shards (see [Note: uneven shards in state dicts]).
torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` step an optimizer without
state first, so these hooks exist before its first ``state_dict()`` with anything in it;
``checkpoint.get_state_dict`` / ``set_state_dict`` also install them (an optimizer that got its
state from a plain ``load_state_dict`` and never stepped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from .. import _registry
from .._profiling import traced
from ._flat_param_group import FlatParamGroup
from ._grads import finalize_unsynchronized
from ._muon import is_distributed_muon, muon_closure, restore_hidden_grads
from ._optimizer_checks import sharded_step_refusal
from ._optimizer_local import restore, swap_in_local_tensors
from ._state_dict_hooks import (
    optimizer_load_state_dict_post_hook,
    optimizer_state_dict_post_hook,
)

__all__ = ["install_optimizer_hooks", "install_state_dict_hooks", "note_wrap"]

# Optimizers given the state-dict hooks (once each; the hooks die with the optimizer).


def note_wrap() -> None:
    """A unit was wrapped: optimizers cached before it are checked again, and the hooks exist."""
    _registry.wrap_generation[0] += 1
    install_optimizer_hooks()


def install_optimizer_hooks() -> None:
    if not _registry.optimizer_hook_handles:
        _registry.optimizer_hook_handles.extend([
            register_optimizer_step_pre_hook(_optimizer_pre_step),
            register_optimizer_step_post_hook(_optimizer_post_step),
        ])


@dataclass
class _OptimizerGroups:
    param_count: int
    generation: int
    groups: list[FlatParamGroup] = field(default_factory=list)
    stale_params: list[str] = field(default_factory=list)
    # Why this optimizer may not step on these groups (see [Note: optimizers that read across
    # parameters]); None: it may.
    refusal: str | None = None


def _optimizer_groups(optimizer: torch.optim.Optimizer) -> _OptimizerGroups:
    # Runs twice per step: the cache check must not walk the parameters.
    param_count = sum(len(g["params"]) for g in optimizer.param_groups)
    cached = _registry.optimizer_cache.get(optimizer)
    if (
        cached is not None and cached.param_count == param_count
        and cached.generation == _registry.wrap_generation[0]
    ):
        return cached
    info = _OptimizerGroups(param_count, _registry.wrap_generation[0])
    seen: set[int] = set()
    for param_group in optimizer.param_groups:
        for p in param_group["params"]:
            record = _registry.record_of(p)
            if record is None:
                continue
            if p is record.compute_param:
                info.stale_params.append(
                    f"'{record.fqn}' of {record.group.owner}, shape {tuple(record.item.shape)}"
                )
                continue
            if id(record.group) not in seen:
                seen.add(id(record.group))
                info.groups.append(record.group)
    info.refusal = sharded_step_refusal(optimizer, info.groups)
    _registry.optimizer_cache[optimizer] = info
    if info.groups:
        install_state_dict_hooks(optimizer)
    return info


def install_state_dict_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` the state-dict post-hooks that mark its managed states for DCP and
    unmark what it adopts on load (no-ops for parameters no unit manages); once."""
    if optimizer in _registry.optimizer_state_dict_hooked:
        return
    optimizer.register_state_dict_post_hook(optimizer_state_dict_post_hook)
    optimizer.register_load_state_dict_post_hook(optimizer_load_state_dict_post_hook)
    _registry.optimizer_state_dict_hooked.add(optimizer)


@traced("mfsdp::optimizer_pre_step")
def _optimizer_pre_step(
    optimizer: torch.optim.Optimizer, args: Any, kwargs: Any
) -> tuple[Any, Any] | None:
    restore_hidden_grads(optimizer)  # a distributed Muon step that raised left them hidden
    info = _optimizer_groups(optimizer)
    if info.stale_params:
        raise RuntimeError(
            f"{type(optimizer).__name__} holds parameters that fully_shard replaced "
            f"({len(info.stale_params)}, first: {info.stale_params[0]}): the optimizer was "
            "built before wrapping, or between a reshard_after_forward=False forward and its "
            "backward (the modules hold the unsharded parameters then, as FSDP2's do), so it "
            "would update stale copies and never see gradients. Build the optimizer after "
            "fully_shard (after wrapping the root), from model.parameters(), outside forward "
            "and backward"
        )
    if info.refusal is not None:
        raise NotImplementedError(info.refusal)
    # torch.optim.Muon: its plan (and every check of it) before anything changes; the step
    # itself runs as the closure, after the user's (see [Note: distributed Muon]).
    muon = is_distributed_muon(optimizer)
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    step_closure = muon_closure(
        optimizer, closure, lambda: finalize_unsynchronized(info.groups, "optimizer.step()")
    ) if muon else None
    finalize_unsynchronized(info.groups, "optimizer.step()")
    # Marked before the step too: a step that raises half-way has still changed main weights.
    for group in info.groups:
        group.mark_main_weights_updated()
    if step_closure is not None:
        if len(args) > 1:
            return (args[0], step_closure, *args[2:]), kwargs
        return args, {**kwargs, "closure": step_closure}
    if info.groups:
        swap_in_local_tensors(optimizer)
    # torch passes the step's arguments with the optimizer first: (optimizer, closure?).
    if closure is None or optimizer not in _registry.local_step_swaps:
        return None
    # The closure (zero_grad, forward, backward) runs inside the step, after the swap: on the
    # local tensors it would clear their gradients while backward fills the DTensors', and
    # the step would see none. It runs on the DTensor parameters, the swap redone after it.
    if len(args) > 1:
        return (args[0], _on_dtensors(optimizer, closure), *args[2:]), kwargs
    return args, {**kwargs, "closure": _on_dtensors(optimizer, closure)}


def _on_dtensors(optimizer: torch.optim.Optimizer, closure: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        restore(optimizer)
        try:
            return closure()
        finally:
            swap_in_local_tensors(optimizer)
    return run


def _optimizer_post_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    restore(optimizer)
    restore_hidden_grads(optimizer)
    for group in _optimizer_groups(optimizer).groups:
        group.mark_main_weights_updated()
