"""How gradients are reduced and compute weights gathered or refreshed: functions over flat
buffers that issue one group's collectives and return a :class:`Pending` handle. *When* they run
is decided by ``_state.py``; *which* buffers exist by the group's plan (``_plan.py``).

Every function takes ``issue``, the group's way to launch a collective (the debug order check,
then a side stream or ``async_op``; see [Note: asynchronous collectives] in ``_collectives.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping

import torch
import torch.distributed as dist

from .. import ops
from .._buffers._allocator import BucketAllocator
from .._buffers._plan import BufferPlan, Collective, Refresh
from .._comm import _collectives as comm
from .._profiling import traced

__all__ = [
    "Issue", "Pending", "cast_and_gather_weights", "gather_weights", "reduce_accumulated",
    "reduce_micro_batch", "reduce_window", "refresh_weights",
]

# issue(description, launch, async_op=..., reduce=...) -> handle or None (already done)
Issue = Callable[..., "comm.CommHandle | None"]


class Pending:
    """An issued collective: :meth:`wait` blocks until its output is written; :meth:`finish`
    also runs what consumes it (a copy-out, freeing a temporary bucket), exactly once."""

    __slots__ = ("_handle", "_finish")

    def __init__(
        self, handle: comm.CommHandle | None, finish: Callable[[], None] | None = None
    ) -> None:
        self._handle = handle
        self._finish = finish

    @traced("mfsdp::wait")
    def wait(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.wait()

    @property
    def holds_temporary(self) -> bool:
        """Whether finishing it consumes a temporary bucket (a reduction in place into a
        persistent buffer has nothing left to run)."""
        return self._finish is not None

    def finish(self) -> None:
        self.wait()
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


def _launch_reduction(
    plan: BufferPlan, reduced: torch.Tensor, reduce_scatter_input: torch.Tensor,
    group: dist.ProcessGroup, issue: Issue, async_op: bool,
) -> comm.CommHandle | None:
    """The plan's reduction of ``reduce_scatter_input``: an all-reduce in place, or a
    reduce-scatter into ``reduced`` (this rank's slot of the input, or a persistent shard)."""
    (step,) = plan.reduce_steps  # one mesh axis today; see [Note: buffer plan]
    if step.op is Collective.ALL_REDUCE:
        def launch(a: bool) -> dist.Work | None:
            return comm.all_reduce_inplace(reduce_scatter_input, group, a)
    else:
        def launch(a: bool) -> dist.Work | None:
            return comm.reduce_scatter_into(reduced, reduce_scatter_input, group, a)
    return issue(step.op.value, launch, async_op=async_op, reduce=True)


@traced("mfsdp::reduce")
def reduce_accumulated(
    plan: BufferPlan, main_grad: torch.Tensor, comm_dtype: torch.dtype,
    group: dist.ProcessGroup, allocator: BucketAllocator, workspace_key: Hashable,
    issue: Issue, async_op: bool, pre_scale: float = 1.0,
) -> Pending:
    """The delayed collective of the accumulate path (``no_shard``: all-reduce, ``optim``:
    reduce-scatter) over a full-size ``main_grad``: in place when the communication dtype is the
    gradient dtype, else through a workspace bucket in the communication dtype. ``pre_scale``
    multiplies ``main_grad`` first (gradients written in place hold unscaled sums), fused with
    the copy into the workspace when there is one."""
    shard = slice(*plan.shard_span)
    if comm_dtype == main_grad.dtype:
        if pre_scale != 1.0:
            main_grad.mul_(pre_scale)
        return Pending(_launch_reduction(plan, main_grad[shard], main_grad, group, issue, async_op))
    workspace = allocator.allocate(workspace_key, main_grad.numel(), comm_dtype, main_grad.device)
    ops.reduce_scatter_copy_in_(main_grad, workspace, pre_scale=pre_scale)
    whole = plan.reduce_steps[0].op is Collective.ALL_REDUCE
    reduced, target = (workspace, main_grad) if whole else (workspace[shard], main_grad[shard])

    def finish() -> None:
        ops.reduce_scatter_copy_out_(reduced, target)
        allocator.free(workspace_key)

    return Pending(_launch_reduction(plan, reduced, workspace, group, issue, async_op), finish)


@traced("mfsdp::reduce")
def reduce_micro_batch(
    plan: BufferPlan, reduce_scatter_input: torch.Tensor, target: torch.Tensor, accumulate: bool,
    group: dist.ProcessGroup, allocator: BucketAllocator, input_key: Hashable,
    issue: Issue, async_op: bool,
) -> Pending:
    """Reduce one micro-batch's staged ``reduce_scatter_input`` (a temporary bucket) and write
    or add the result into ``target``, the optimizer-facing part of ``main_grad``."""
    whole = plan.reduce_steps[0].op is Collective.ALL_REDUCE
    reduced: torch.Tensor | None
    if whole:
        reduced = reduce_scatter_input
        output = reduce_scatter_input
    elif not accumulate and reduce_scatter_input.dtype == target.dtype:
        reduced = None  # first write, same dtype: reduce straight into the persistent shard
        output = target
    else:
        reduced = reduce_scatter_input[slice(*plan.shard_span)]
        output = reduced

    def finish() -> None:
        if reduced is not None:
            ops.reduce_scatter_copy_out_(reduced, target, accumulate=accumulate)
        allocator.free(input_key)

    return Pending(
        _launch_reduction(plan, output, reduce_scatter_input, group, issue, async_op), finish
    )


@traced("mfsdp::reduce")
def reduce_window(
    plan: BufferPlan, local_grad: torch.Tensor, window_grad: torch.Tensor | None,
    comm_dtype: torch.dtype, groups: Mapping[str, dist.ProcessGroup],
    allocator: BucketAllocator, workspace_key: Hashable, window_key: Hashable,
    issue: Issue, async_op: bool,
) -> list[Pending]:
    """The plan's ``window_steps`` into ``local_grad``, the optimizer-facing part of
    ``main_grad``, once the window's inner reductions were waited on. ``groups`` maps a step's
    axis to its process group.

    * all-reduce (HSDP outer ``no_shard``): ``local_grad`` in place;
    * reduce-scatter (HSDP outer ``optim``): the ``window_grad`` bucket (the inner shard the
      micro-batches added into, at ``plan.window_grad_span``) into ``local_grad``, its slot;
      the bucket (``window_key``) is freed when the step finishes.

    In place when the communication dtype is the gradient dtype, else through a workspace
    bucket in the communication dtype."""
    pending: list[Pending] = []
    for step in plan.window_steps:
        group = groups[step.axis]
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

        def launch(a: bool, buffer: torch.Tensor = buffer, output: torch.Tensor = output,
                   group: dist.ProcessGroup = group, op: Collective = step.op) -> dist.Work | None:
            if op is Collective.ALL_REDUCE:
                return comm.all_reduce_inplace(buffer, group, a)
            return comm.reduce_scatter_into(output, buffer, group, a)

        handle = issue(f"{step.axis} {step.op.value}", launch, async_op=async_op, reduce=True,
                       process_group=group)
        # An all-reduce in place into local_grad leaves nothing to finish: no temporary held.
        pending.append(Pending(handle, finish if copies_out or frees_window else None))
    return pending


@traced("mfsdp::gather")
def gather_weights(
    unsharded_model_weight: torch.Tensor, model_weight_shard: torch.Tensor,
    group: dist.ProcessGroup, issue: Issue, async_op: bool, after: Pending | None = None,
) -> Pending:
    """ZeRO-3: gather every rank's model-weight shard into the temporary unsharded bucket.
    ``after``: a refresh that rebuilds the shard first (HSDP outer ``optim``: the outer
    all-gather), waited on where the gather launches (on CUDA: by the side stream, in stream
    order; on gloo: the work, before the gather is issued)."""
    def launch(a: bool) -> dist.Work | None:
        if after is not None:
            after.wait()
        return comm.all_gather_into(unsharded_model_weight, model_weight_shard, group, a)

    return Pending(issue("all-gather", launch, async_op=async_op, reduce=False))


def cast_and_gather_weights(
    unsharded_model_weight: torch.Tensor, main_weight_shard: torch.Tensor, offset: int,
    group: dist.ProcessGroup, issue: Issue, async_op: bool,
) -> Pending:
    """ZeRO-3 with a separate main buffer (``Refresh.CAST_AT_GATHER``): cast this rank's main
    shard into its own slot of the temporary unsharded bucket (``offset``: where the slot
    starts), then all-gather that slot in place. The same bits as casting into a persistent
    shard first and gathering from it."""
    ops.refresh_from_shard_(main_weight_shard, unsharded_model_weight, offset)
    own_slot = unsharded_model_weight[offset : offset + main_weight_shard.numel()]
    return gather_weights(unsharded_model_weight, own_slot, group, issue, async_op)


@traced("mfsdp::refresh")
def refresh_weights(
    plan: BufferPlan, main_weight: torch.Tensor, model_weight: torch.Tensor,
    groups: Mapping[str, dist.ProcessGroup], issue: Issue, async_op: bool,
) -> Pending | None:
    """Rebuild compute weights from updated main weights (see [Note: replicated-buffer
    refresh] in ``_flat_param_group.py``): cast the main weights into their slot of
    ``model_weight`` (when separate), then the plan's ``refresh_steps`` (in-place all-gathers of
    that slot over the step's axis; ``groups`` maps an axis to its process group). Returns the
    pending all-gather, if the plan has one."""
    if plan.refresh is Refresh.NONE:
        return None
    offset = plan.main_weight_span[0] - plan.model_weight_span[0]
    if plan.main_weight_separate:
        # Cast the main weights (all of them, or this rank's shard) into their place.
        ops.refresh_from_shard_(main_weight, model_weight, offset)
    if not plan.refresh_steps:
        return None
    (step,) = plan.refresh_steps
    assert step.op is Collective.ALL_GATHER, step
    own_slot = model_weight[offset : offset + main_weight.numel()]
    group = groups[step.axis]

    def launch(a: bool) -> dist.Work | None:
        return comm.all_gather_into(model_weight, own_slot, group, a)

    what = "refresh all-gather" if step.axis == "shard" else f"{step.axis} refresh all-gather"
    return Pending(issue(what, launch, async_op=async_op, reduce=False, process_group=group))
