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
``PipelineStage.perform_reduce_grad`` of torch 2.14 reads that entry: torch 2.15's stages end
the step through FSDP2's public ``set_manual_backward_finalization`` / ``finalize_backward``
(ours: [Note: manual backward finalization] in ``_runtime/_finalize.py``; both paths run the
same ``finalize``), and torch's other FSDP2 helpers reach the state through
``_get_fsdp_state()``, which answers only the ``_comm_ctx`` 2.15's schedules compare.

Schedules that split a backward into an input-gradient pass ``I`` and a deferred weight pass
``W`` (zero-bubble: ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``, any schedule with ``I``/``W`` actions) train too. ``I`` is
``torch.autograd.grad`` with respect to the stage inputs (graph kept); it records which
parameters the graph reaches from ``stage.submod.parameters()`` *read at its start*, and ``W``
differentiates those from saved intermediates, maps them back through
``stage.submod.parameters()`` *read again* and writes ``weight.grad = dw`` (or ``+=``), calling
no hook. FSDP2 works because its unsharded parameters stay registered from the forward
(``reshard_after_forward=False``) through ``W``, and ``perform_reduce_grad`` reduces their
accumulated ``.grad`` once. Ours: :func:`note_split_backward` (at the step's first ``UNSHARD``
action, which runtime schedules issue on every stage whose module is an ``FSDPModule``) sets
``split_backward_step`` on the stage's units, and while it is set (1) the compute parameters,
the leaves the forward used, stay registered (``register_dist_params`` does nothing), so
``I`` and ``W`` both read them; (2) a post-backward in a backward that will not accumulate
into the unit's compute parameters (``torch._C._will_engine_execute_node`` of a parameter's
``AccumulateGrad`` is false: an ``I`` pass) is deferred: nothing reduced, registered or freed,
gathered weights kept (``W`` reads saved tensors), and ``W`` then adds into the compute
parameters' ``.grad`` (the aliases armed by ``I``'s pre-backward, or tensors of its own).
:func:`end_pipeline_step` clears the flag and runs the deferred post-backwards, which reduce
what the ``W`` passes wrote, before ending the window. A full backward (``B``; the first
stage's ``W``, which torch runs as a full backward since it has no ``I``) runs the
post-backward as usual and reduces any deferred gradients with its own. Per flat group and
step, reduce-scatters of ``optim_grads``/``optim_grads_params``: one per full backward plus one
at the step's end for ``I`` passes after the last one (zero-bubble 1P and ZBV: N on the first
stage, 1 on the others); gathers and ``no_shard``/``optim`` as under the other schedules.
Refused: a stage whose root is not a unit (blocks wrapped only) runs no ``UNSHARD`` and no
``perform_reduce_grad`` of ours, so nothing marks the step and no hook runs after ``W``: every
stage but the first got no gradient (``.grad`` None, no error; measured with ``no_shard``
blocks under ``ScheduleInterleavedZeroBubble``). :func:`refuse_split_backward_over_blocks`
raises instead, from the units' ``reshard()`` that torch's ``_post_metadata_inference_cleanup``
calls (its frame's ``self`` is the stage, whose ``submod`` is not a unit; the schedule is found
further up the stack): every rank runs that cleanup at the first step, once its own metadata
inference is done and before the step's first action, so every rank raises. A stage without
that cleanup (torch 2.11's, or the tracer-based ``_PipelineStage``) is checked by a forward
pre-hook of every unit instead (:func:`attach`): the first stage's ranks raise at their first
forward, and the others fail in their exchange with them.
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
from .._runtime import _finalize
from .._runtime._state import FSDPState

__all__ = [
    "PipelineStepEnd", "attach", "end_pipeline_step", "note_split_backward",
    "refuse_split_backward_over_blocks",
]


def end_pipeline_step(states: list[FSDPState]) -> None:
    """End the accumulation window of ``states`` (a stage's units) after a pipeline step's last
    backward, as ``finalize_backward()`` does (see [Note: manual backward finalization] in
    ``_runtime/_finalize.py``): run the post-backwards a zero-bubble schedule's input-gradient
    passes deferred, reduce what is still accumulated, wait for every reduction, run HSDP's
    outer reduction, install the gradients; then free gathered weights and register the
    sharded parameters."""
    _finalize.finalize(states, async_op=False).finish()


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
    """Make ``fully_shard.state(module)`` (torch's) return a :class:`PipelineStepEnd`, and (on
    a torch whose stages have no metadata-inference cleanup) check at each forward that no
    split-backward schedule runs the unit in a stage whose root is not a unit."""
    module.register_forward_pre_hook(_refuse_blocks_only_stage_at_forward, prepend=True)
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


def _splits(schedule: Any, schedules: Any) -> bool:
    """Whether ``schedule`` has ``I``/``W`` actions; read once per schedule object."""
    splits = _registry.pipeline_schedule_splits.get(schedule)
    if splits is None:
        splits = _has_split_backward(schedule, schedules)
        _registry.pipeline_schedule_splits[schedule] = splits
    return splits


def refuse_split_backward_over_blocks(caller: FrameType | None) -> None:
    """Raise ``NotImplementedError`` when ``caller`` (the frame that called a unit's
    ``reshard()``) is torch's cleanup after a stage's metadata inference, the stage's root is
    not a unit, and the schedule running it splits backwards (see [Note: pipeline schedules
    over fully_shard units]): every rank runs that cleanup once its own inference is done,
    before the step's first action."""
    stage_module = sys.modules.get("torch.distributed.pipelining.stage")
    if stage_module is None or caller is None:
        return
    if caller.f_code.co_name != _CLEANUP:
        return
    _refuse_blocks_only_stage(caller, at_forward=False)


# torch's cleanup after a stage's metadata inference (``PipelineStage``, from torch 2.12).
_CLEANUP = "_post_metadata_inference_cleanup"


def _refuse_blocks_only_stage(frame: FrameType | None, at_forward: bool) -> None:
    """From ``frame`` up: the first pipeline stage found (``self`` of a frame) and the
    schedule running it; raise if the stage's root is not a unit and the schedule splits
    backwards. ``at_forward``: from a unit's forward, where a stage that has torch's cleanup
    is left to it. Looks no further than :data:`_MAX_FRAMES` frames."""
    schedules = sys.modules.get("torch.distributed.pipelining.schedules")
    stage_module = sys.modules.get("torch.distributed.pipelining.stage")
    if schedules is None or stage_module is None:
        return
    # Only frames of code in torch's stage and schedule modules are looked into (reading a
    # frame's locals costs more than comparing its globals: this runs at every unit forward
    # while pipelining is imported).
    stage_globals, schedules_globals = vars(stage_module), vars(schedules)
    stage = owner = None
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return
        if stage is None and frame.f_globals is stage_globals:
            owner = frame.f_locals.get("self")
            if isinstance(owner, stage_module._PipelineStageBase):
                if _registry.state_of(owner.submod) is not None:
                    return  # the stage root is a unit: note_split_backward handles the step
                if at_forward and hasattr(type(owner), _CLEANUP):
                    return  # refused at the cleanup, on every rank
                stage = owner
        elif stage is not None and frame.f_globals is schedules_globals:
            owner = frame.f_locals.get("self")
            if isinstance(owner, schedules._PipelineSchedule):
                break
        frame = frame.f_back
    else:
        return
    if _splits(owner, schedules):
        raise NotImplementedError(
            f"{type(owner).__name__} splits each backward into an input-gradient pass and a "
            f"deferred weight-gradient pass, and stage {stage.stage_index}'s module "
            f"({type(stage.submod).__name__}) is not a fully_shard unit (only modules inside "
            "it are): nothing would reduce the gradients the weight passes write, so every "
            "stage but the first would train without gradients. Wrap the stage module with "
            "fully_shard too (after its blocks), or use a schedule without I/W actions"
        )


# How far up the stack a unit's check looks for the pipeline stage and schedule calling it
# (torch's schedule -> stage -> module call: about a dozen frames).
_MAX_FRAMES = 40


def _refuse_blocks_only_stage_at_forward(module: nn.Module, args: Any) -> None:
    """Forward pre-hook for stages without torch's metadata-inference cleanup (torch 2.11):
    the same refusal at a unit's forward. The first stage's rank raises at its shape
    inference, before the schedule's first action; the other ranks' processes then fail in
    their first exchange with it (torchrun ends the job), as they cannot reach a forward."""
    # Not imported: no schedule can be calling (the library never imports pipelining itself).
    if "torch.distributed.pipelining.stage" in sys.modules:
        _refuse_blocks_only_stage(sys._getframe(1), at_forward=True)


def note_split_backward(module: nn.Module, caller: FrameType | None) -> None:
    """When ``caller`` (the frame that called ``module.unshard()``) is a
    ``torch.distributed.pipelining`` schedule that splits backwards into input and weight
    passes, mark the step on ``module``'s units (``split_backward_step``: compute parameters
    registered until the step's end, input-gradient passes' post-backwards deferred to it; see
    [Note: pipeline schedules over fully_shard units])."""
    # Not imported: no schedule can be calling (the library never imports pipelining itself).
    schedules = sys.modules.get("torch.distributed.pipelining.schedules")
    if schedules is None or caller is None:
        return
    schedule = caller.f_locals.get("self")
    if not isinstance(schedule, schedules._PipelineSchedule):
        return
    if _splits(schedule, schedules):
        for _, state in _registry.unit_states(module):
            state.split_backward_step = True
