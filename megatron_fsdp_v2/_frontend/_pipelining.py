"""``torch.distributed.pipelining`` over our units: the end of a pipeline step.

[Note: pipeline schedules over fully_shard units]
torch's ``PipelineStage`` treats a stage module that is a ``torch.distributed.fsdp.FSDPModule``
(ours are, see ``_fsdp2_surface.py``) as FSDP2: before every micro-batch's backward it calls
``set_is_last_backward(False)``, ``set_reshard_after_backward(False)`` and
``set_requires_gradient_sync(False)`` (our methods: the window stays open, ZeRO-3 weights stay
gathered between micro-batches), and once per step, after the last backward of the stage,
``perform_reduce_grad`` sets the three back to ``True`` and then reaches into FSDP2's state:
``fully_shard.state(module)._state_ctx.all_states[*]._fsdp_param_groups[*].post_backward()`` and
``._root_post_backward_final_callback()``. Our units have no FSDP2 state, so that raised
``AttributeError: 'NoneType' object has no attribute '_state_ctx'`` at the end of every step.

:func:`attach` stores a :class:`PipelineStepEnd` where ``fully_shard.state(module)`` looks (the
module's composable-API state dict, under torch's ``fully_shard`` function): no FSDP2 param
groups (``all_states`` is empty) and a final callback that ends the stage's accumulation
window the way the final callback of a backward marked last does: the delayed reduction of
``no_shard``/``optim``, the per-micro-batch reductions of ``optim_grads``/``optim_grads_params``
waited on, HSDP's outer reduction, gradients installed; then the gathered weights kept across
the micro-batches are freed and the sharded parameters registered again. torch then divides
the installed gradients by the number of micro-batches (``scale_grads``), as under FSDP2. Only
``PipelineStage.perform_reduce_grad`` reads that entry: torch's other FSDP2 helpers reach the
state through ``_get_fsdp_state()``, which stays refused.

Schedules that split a backward into an input-gradient pass and a deferred weight-gradient
pass (zero-bubble: ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``, any schedule with ``I``/``W`` actions) are refused. Their weight pass
takes ``torch.autograd.grad`` with respect to ``stage.submod.parameters()``, the sharded
DTensor parameters the optimizer sees, while the forward ran on our compute weights: those are
not in the graph, and the pass failed deep inside torch with a shape error on some ranks while
the others waited for their pipeline peers. :func:`refuse_split_backward` raises instead, at
the step's first ``UNSHARD`` action, which every rank runs before any pipeline communication.
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any

import torch.nn as nn
from torch.distributed._composable.contract import STATE_KEY
from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as _torch_fully_shard

from .. import _registry
from .._runtime._state import FSDPState

__all__ = ["PipelineStepEnd", "attach", "end_pipeline_step", "refuse_split_backward"]


def end_pipeline_step(states: list[FSDPState]) -> None:
    """End the accumulation window of ``states`` (a stage's units) after a pipeline step's last
    backward: reduce what is still accumulated, wait for every reduction, run HSDP's outer
    reduction, install the gradients; then free gathered weights kept across micro-batches and
    register the sharded parameters. The same groups in the same order on every rank of the
    stage's data-parallel mesh, so the collectives match."""
    groups = [group for state in states for group in state.groups]
    windows = [group.end_window(async_op=False) for group in groups
               if group.grads.pending_install]
    for window in windows:
        window.finish()
    for state in states:
        state.reshard()
        state.register_dist_params()


class PipelineStepEnd:
    """What ``PipelineStage.perform_reduce_grad`` finds as ``fully_shard.state(module)`` on one
    of our units (see [Note: pipeline schedules over fully_shard units])."""

    # FSDP2's per-state param groups: none, the final callback ends every group's window.
    all_states: tuple[Any, ...] = ()

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)  # the module holds this object: no cycle

    @property
    def _state_ctx(self) -> PipelineStepEnd:
        return self

    def _root_post_backward_final_callback(self) -> None:
        module = self._module()
        if module is None:
            return
        states = [s for _, s in _registry.unit_states(module)]
        end_pipeline_step(states)


def attach(module: nn.Module) -> None:
    """Make ``fully_shard.state(module)`` (torch's) return a :class:`PipelineStepEnd`."""
    key = getattr(_torch_fully_shard, "__wrapped__", None)
    if key is None:
        return  # a torch whose contract keys differently: pipelining cannot find it either
    module.__dict__.setdefault(STATE_KEY, {})[key] = PipelineStepEnd(module)


def _has_split_backward(schedule: Any, schedules: Any) -> bool:
    split_backward = (schedules.BACKWARD_INPUT, schedules.BACKWARD_WEIGHT)  # zero-bubble I, W
    orders = getattr(schedule, "pipeline_order_with_comms", None) or getattr(
        schedule, "pipeline_order", None) or {}
    pending = [a for actions in orders.values() for a in actions if a is not None]
    while pending:
        action = pending.pop()
        if action.computation_type in split_backward:
            return True
        pending.extend(getattr(action, "sub_actions", None) or ())  # not on every release
    return False


def refuse_split_backward(caller: FrameType | None) -> None:
    """Raise ``NotImplementedError`` when ``caller`` (the frame that called ``unshard()``) is a
    ``torch.distributed.pipelining`` schedule that splits backwards into input and weight
    passes (see [Note: pipeline schedules over fully_shard units])."""
    # Not imported: no schedule can be calling (the library never imports pipelining itself).
    schedules = sys.modules.get("torch.distributed.pipelining.schedules")
    if schedules is None or caller is None:
        return
    schedule = caller.f_locals.get("self")
    if not isinstance(schedule, schedules._PipelineSchedule):
        return
    # Read once per schedule object, not at every step.
    splits = _registry.pipeline_schedule_splits.get(schedule)
    if splits is None:
        splits = _has_split_backward(schedule, schedules)
        _registry.pipeline_schedule_splits[schedule] = splits
    if splits:
        raise NotImplementedError(
            f"{type(schedule).__name__} splits each backward into an input-gradient pass and a "
            "deferred weight-gradient pass (zero-bubble I/W actions), which "
            "megatron_fsdp_v2.fully_shard stages do not support: the weight pass differentiates "
            "the sharded parameters, not the weights the forward computed with. Use "
            "ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B or ScheduleLoopedBFS"
        )
