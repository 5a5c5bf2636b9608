"""How one group's gradients are reduced: functions over flat buffers that prepare what the
plan's reduction needs (a workspace in the communication dtype, the copy-in), describe the
collective with what completes it, and launch it through the group's issuer, returning its
:class:`~._issuer.Pending` handle. *When* they run is decided by the gradient state machine
(``_grads.py``); *which* buffers exist by the group's plan (``_plan.py``); weight gathers and
refreshes are in ``_gather.py``. See [Note: who issues collectives] in ``_issuer.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import torch

from .. import ops
from .._buffers._allocator import ScratchAllocator
from .._buffers._plan import BufferPlan, Collective
from .._profiling import traced
from ._issuer import CollectiveLaunch, GroupIssuer, Pending

if TYPE_CHECKING:
    from ._offload import HostOffload

__all__ = ["reduce_accumulated", "reduce_micro_batch", "reduce_window"]


def _launch_reduction(
    plan: BufferPlan, reduced: torch.Tensor, reduction_input: torch.Tensor,
    issuer: GroupIssuer, async_op: bool, complete: Callable[[], None] | None = None,
) -> Pending:
    """The plan's reduction of ``reduction_input`` (a staged micro-batch, ``main_grad`` or its
    workspace): an all-reduce in place, or a reduce-scatter into ``reduced`` (this rank's slot of
    the input, or a persistent shard)."""
    (step,) = plan.reduce_steps  # one mesh axis today; see [Note: buffer plan]
    part = None if step.op is Collective.ALL_REDUCE else reduced
    return issuer.launch(CollectiveLaunch(
        step.op, reduction_input, part, what=step.op.value, complete=complete,
    ), async_op)


@traced("mfsdp::reduce")
def reduce_accumulated(
    plan: BufferPlan, main_grad: torch.Tensor, comm_dtype: torch.dtype,
    issuer: GroupIssuer, allocator: ScratchAllocator, workspace_key: Hashable,
    async_op: bool, pre_scale: float = 1.0,
) -> Pending:
    """The delayed collective of the accumulate path (``no_shard``: all-reduce, ``optim``:
    reduce-scatter) over a full-size ``main_grad``: in place when the communication dtype is the
    gradient dtype, else through a workspace scratch buffer in the communication dtype.
    ``pre_scale`` multiplies ``main_grad`` first (gradients written in place hold unscaled sums),
    fused with the copy into the workspace when there is one."""
    shard = slice(*plan.shard_span)
    if comm_dtype == main_grad.dtype:
        if pre_scale != 1.0:
            main_grad.mul_(pre_scale)
        return _launch_reduction(plan, main_grad[shard], main_grad, issuer, async_op)
    workspace = allocator.allocate(workspace_key, main_grad.numel(), comm_dtype, main_grad.device)
    ops.reduce_scatter_copy_in_(main_grad, workspace, pre_scale=pre_scale)
    whole = plan.reduce_steps[0].op is Collective.ALL_REDUCE
    reduced, target = (workspace, main_grad) if whole else (workspace[shard], main_grad[shard])

    def finish() -> None:
        ops.reduce_scatter_copy_out_(reduced, target)
        allocator.free(workspace_key)

    return _launch_reduction(plan, reduced, workspace, issuer, async_op, finish)


@traced("mfsdp::reduce")
def reduce_micro_batch(
    plan: BufferPlan, staged_grad: torch.Tensor, target: torch.Tensor, accumulate: bool,
    issuer: GroupIssuer, allocator: ScratchAllocator, input_key: Hashable, async_op: bool,
    host: HostOffload | None = None,
) -> Pending:
    """Reduce one micro-batch's staged ``staged_grad`` (a scratch buffer) and write
    or add the result into ``target``, the optimizer-facing part of ``main_grad``. ``host``:
    ``target`` is in host memory (CPU offload): the result is reduced into its slot of the
    input, then copied there (see [Note: host offload] in ``_offload.py``)."""
    whole = plan.reduce_steps[0].op is Collective.ALL_REDUCE
    reduced: torch.Tensor | None
    if whole:
        reduced = staged_grad
        output = staged_grad
    elif host is None and not accumulate and staged_grad.dtype == target.dtype:
        reduced = None  # first write, same dtype: reduce straight into the persistent shard
        output = target
    else:
        reduced = staged_grad[slice(*plan.shard_span)]
        output = reduced

    def finish() -> None:
        if reduced is not None and host is not None:
            host.grad_to_host(reduced, target, accumulate)
        elif reduced is not None:
            ops.reduce_scatter_copy_out_(reduced, target, accumulate=accumulate)
        allocator.free(input_key)

    return _launch_reduction(plan, output, staged_grad, issuer, async_op, finish)


@traced("mfsdp::reduce")
def reduce_window(
    plan: BufferPlan, local_grad: torch.Tensor, window_grad: torch.Tensor | None,
    comm_dtype: torch.dtype, issuer: GroupIssuer, allocator: ScratchAllocator,
    workspace_key: Hashable, window_key: Hashable, async_op: bool,
) -> list[Pending]:
    """The plan's ``window_steps`` into ``local_grad``, the optimizer-facing part of
    ``main_grad``, once the window's inner reductions were waited on; each over its step's axis.

    * all-reduce (HSDP outer ``no_shard``): ``local_grad`` in place;
    * reduce-scatter (HSDP outer ``optim``): the ``window_grad`` scratch buffer (the inner shard the
      micro-batches added into, at ``plan.window_grad_span``) into ``local_grad``, its slot;
      the scratch buffer (``window_key``) is freed when the step finishes.

    In place when the communication dtype is the gradient dtype, else through a workspace
    scratch buffer in the communication dtype."""
    pending: list[Pending] = []
    for step in plan.window_steps:
        if step.op is Collective.ALL_REDUCE:
            source, slot = local_grad, slice(None)
        else:
            assert step.op is Collective.REDUCE_SCATTER and window_grad is not None, step
            assert plan.window_grad_span is not None
            source = window_grad
            offset = plan.window_grad_span[0]
            slot = slice(plan.main_grad_span[0] - offset, plan.main_grad_span[1] - offset)
        frees_window = source is window_grad
        buffer = source
        if comm_dtype != local_grad.dtype:
            buffer = allocator.allocate(workspace_key, source.numel(), comm_dtype, source.device)
            ops.reduce_scatter_copy_in_(source, buffer)
        copies_out = buffer is not local_grad and (buffer is not source or not frees_window)
        # Same dtype, reduce-scatter: straight into local_grad. Otherwise into the buffer's slot
        # (in place), copied out afterwards.
        output = local_grad if buffer is source and frees_window else buffer[slot]

        def finish(buffer: torch.Tensor = buffer, output: torch.Tensor = output,
                   copies_out: bool = copies_out, frees_window: bool = frees_window) -> None:
            if copies_out:
                ops.reduce_scatter_copy_out_(output, local_grad)
                allocator.free(workspace_key)
            if frees_window:
                allocator.free(window_key)

        # An all-reduce in place into local_grad leaves nothing to finish: no temporary held.
        pending.append(issuer.launch(CollectiveLaunch(
            step.op, buffer, None if step.op is Collective.ALL_REDUCE else output,
            what=f"{step.axis} {step.op.value}", axis=step.axis,
            complete=finish if copies_out or frees_window else None,
        ), async_op))
    return pending
