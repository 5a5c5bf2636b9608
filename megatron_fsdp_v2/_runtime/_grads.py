"""A flat group's gradients (:class:`GroupGrads`): the persistent ``main_grad`` buffer and the
gradient state machine of the plan (accumulate locally, or reduce each micro-batch; the window
and its end, :meth:`GroupGrads.end_window`), reducing through ``_reduce.py``. It holds two
components, each in its own module and owning its fields: ``staging``, the staging of each
micro-batch's ``param.grad`` (:class:`~._grad_staging.GradStaging`, [Note: gradients in place])
and ``views``, what the optimizer sees as ``.grad`` (:class:`~._grad_views.OptimizerGradViews`,
[Note: gradients the optimizer sees]).

[Note: HSDP window carry]
On a 2-D mesh with an outer ``no_shard`` axis the plan has ``window_steps``: at the end of each
window (:meth:`GroupGrads.reduce_across_replicas`) the inner-reduced shard is all-reduced over
the outer group. That is only right if ``main_grad`` held nothing but this window's
contributions. A window can start with globally reduced values in it (gradients not cleared
between steps, an unmarked loop where every backward is "last", a second backward over a
retained graph): all-reducing those again would count them R times. So the first write of a
window (``pending_install`` False) that finds ``main_grad`` REDUCED moves what the optimizer-
facing part holds into a temporary ``window_carry`` scratch buffer and restarts from EMPTY; after
the window's outer all-reduce the carry is added back and freed. Clearing gradients in between
(``zero_grad``, all installed gradients set to ``None``) drops the carry. A group with an
all-reduce hook carries the same way on any mesh, and adds the carry back after the hook (see
[Note: the all-reduce hook] in ``_all_reduce_hook.py``).

The accumulate path (``no_shard``, ``optim``) carries the same way on any mesh: its one
collective at the window's end would otherwise reduce the installed values again, together with
the local partial sums. Whatever the user did to the installed gradients in place (``optimizer.
zero_grad(set_to_none=False)``, clipping, an add through ``to_local()``) is carried as it is,
so the library never needs to know whether they are zero: no value is read and no torch
function is wrapped (see [Note: gradients known without a host read] in ``_zeroed_grads.py``).
The cost, per group and window that starts on installed gradients: a scratch buffer of the
optimizer-facing part (this rank's shard under ``optim``) from the window's first write to its
end, one copy into it and one add back; the collectives stay one per window. ``no_shard`` with
gradients in place and reduced in their own dtype needs no carry: the local sums are added onto
the installed values, the same on every rank, and the all-reduce's ``1/D`` gives them back
unchanged (DDP's arithmetic; ``GroupGrads._reduction_keeps_replicated_values``). Measured
(``bench_training.py --quick --model-size small --world 2 --zero-grad zeros``, the group
buffers' peak of ``memory_report`` and the peak RSS above base): ``optim`` 25.2 -> 31.5 MiB
(193-194 -> 201 MiB; ZeRO-1 182) by its carry; ``no_shard`` stays at 25.2 MiB (198 MiB, DDP
194), where a carry had made it 37.8 MiB (208-209 MiB).

With an outer ``optim`` axis the window's micro-batches add into a temporary ``window_grad``
scratch buffer (the inner shard; the plan's ``window_grad_span``) and the window step
reduce-scatters it over the outer group into ``main_grad`` (this rank's sub-shard), overwriting it:
the same carry rule keeps what ``main_grad`` held. Clearing gradients frees ``window_grad`` too.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from .._buffers._plan import Collective, Extent, GradPath
from .._profiling import traced
from . import _reduce
from ._all_reduce_hook import AllReduceHook, run_all_reduce_hook
from ._grad_staging import GradStaging
from ._grad_state import GradState, WindowState
from ._grad_views import OptimizerGradViews
from ._issuer import Deferred, Finishable

if TYPE_CHECKING:
    from ._coalesce import ReductionCoalescer
    from ._flat_param_group import FlatParamGroup

__all__ = ["GradState", "GroupGrads", "finalize_unsynchronized"]


class GroupGrads:
    """The gradients of one flat group: ``main_grad`` and the gradient state machine, with its
    staging (``staging``: :class:`~._grad_staging.GradStaging`) and the optimizer-facing views
    (``views``: :class:`~._grad_views.OptimizerGradViews`) as components."""

    def __init__(self, group: FlatParamGroup) -> None:
        self.group = group  # its plan, layout, dtypes, allocator and issuer: read only
        self.state = GradState.EMPTY
        self._main_grad: torch.Tensor | None = None  # storage freed while EMPTY
        self._pending: list[Finishable] = []  # in-flight reductions and window steps
        # The delayed reduction queued in the tree's reduction buckets (see [Note: reduction
        # buckets] in _coalesce.py); ``coalescer`` is set by the root's lazy init when the tree
        # coalesces.
        self.coalescer: ReductionCoalescer | None = None
        self._coalesced: Deferred | None = None
        # What the optimizer has not been shown yet (see WindowState).
        self.window = WindowState.CLOSED
        # [Note: HSDP window carry] main_grad_local's values at the window start, if any.
        self._carrying = False
        # [Note: manual backward finalization] (_finalize.py): the finalization that launched
        # this group's window end and has not finished it yet (its handle not waited on).
        self.finalization: Deferred | None = None
        # [Note: the all-reduce hook] FSDP2's hook on the window's reduced shard, its stream.
        self.all_reduce_hook: AllReduceHook | None = None
        self.all_reduce_hook_stream: torch.cuda.Stream | None = None
        # [Note: gradients in place] the aliases autograd writes through, and the packing.
        self.staging = GradStaging(group)
        # [Note: gradients the optimizer sees] the DTensor views installed as ``.grad``.
        self.views = OptimizerGradViews(group, self.main_grad_local)

    # ------------------------------------------------------------------ main_grad

    def ensure_main_grad(self) -> torch.Tensor:
        """``main_grad`` with its storage allocated (one tensor object for life, so cached
        gradient views stay valid; see [Note: storage-freeing scratch buffers])."""
        main_grad = self._main_grad
        if main_grad is None:
            lo, hi = self.group.plan.main_grad_span
            host = self.group.host_offload  # CPU offload: in host memory
            main_grad = (
                host.empty(hi - lo, self.group.dtypes.grad) if host is not None
                else torch.empty(hi - lo, dtype=self.group.dtypes.grad, device=self.group.device)
            )
            self._main_grad = main_grad
        elif main_grad.untyped_storage().nbytes() == 0:
            main_grad.untyped_storage().resize_(main_grad.numel() * main_grad.element_size())
        return main_grad

    def _local_bounds(self) -> tuple[int, int]:
        """Where in ``main_grad`` the optimizer-facing gradients lie."""
        offset = self.group.plan.main_grad_span[0]
        lo, hi = self.group.plan.main_weight_span
        return lo - offset, hi - offset

    def main_grad_local(self) -> torch.Tensor:
        """The part of ``main_grad`` behind the optimizer-facing gradients."""
        lo, hi = self._local_bounds()
        return self.ensure_main_grad()[lo:hi]

    def release_storage(self) -> None:
        """Forget the gradients (state EMPTY: the next window starts from zeros) and free
        ``main_grad``'s storage, unless [Note: main_grad kept on CPU] keeps it."""
        self._drop_carry()
        self._free_window_grad()
        if self._main_grad is not None and not self._keeps_storage(self._main_grad):
            self._main_grad.untyped_storage().resize_(0)
        self.state = GradState.EMPTY
        self.views.forget_installed()
        if self.window is WindowState.ENDING:  # its outer steps were waited on already
            self.window = WindowState.OPEN

    def _keeps_storage(self, main_grad: torch.Tensor) -> bool:
        # [Note: main_grad kept on CPU] On the accumulate path (``no_shard``, ``optim``)
        # ``main_grad`` is the full-size buffer every backward writes, and a window starting
        # from EMPTY zeroes it anyway. Freed storage on CUDA goes back to the caching allocator,
        # which hands it to the forward's activations and back for free, so it is freed there.
        # On CPU a freed buffer of that size is unmapped, and growing it again costs a page
        # fault per 4 KiB page in the next backward: measured (4 gloo ranks, the 29.5M GPT,
        # fp32, `bench_training.py --systems no_shard,ddp,optim,zero1 --rounds 3`), `no_shard`
        # went from 1.07x DDP's step time to 1.02-1.05x and its peak RSS above base from 0.95x
        # to 1.01x DDP's, which keeps its buckets the same way. The reduce-each path's
        # ``main_grad`` (the shard) is freed everywhere, as FSDP2 frees its sharded gradients.
        return (self.group.plan.grad_path is GradPath.ACCUMULATE_THEN_REDUCE
                and main_grad.device.type == "cpu" and self.group.host_offload is None)

    def restart_accumulation_from_zeros(self) -> None:
        """``main_grad`` holds zeros: valid local partial sums, so the accumulate path goes back
        to its one collective per window."""
        self.state = (
            GradState.ACCUMULATING
            if self.group.plan.grad_path is GradPath.ACCUMULATE_THEN_REDUCE else GradState.REDUCED
        )

    # ------------------------------------------------------------------ staging

    @property
    def _accumulate_scale(self) -> float:
        """The scale of what the accumulate path stages into ``main_grad`` (1 when gradients go
        in place: the delayed collective scales; see [Note: gradients in place])."""
        return 1.0 if self.group.plan.grads_in_place else self.group.grad_pre_scale

    @property
    def _collective_scale(self) -> float:
        """What the accumulate path's delayed collective multiplies ``main_grad`` by first."""
        return self.group.grad_pre_scale if self.group.plan.grads_in_place else 1.0

    def _in_place_buffer(self) -> torch.Tensor | None:
        """The buffer this backward's gradients go into in place (allocated, zeroed where a
        window or a micro-batch starts), or None: stage them (see [Note: gradients in place])."""
        group = self.group
        if group.plan.grad_path is GradPath.ACCUMULATE_THEN_REDUCE:
            if self.state is GradState.REDUCED:
                if not self.window_starts_on_reduced_values:
                    return None  # reduced in this window: later micro-batches reduce, then add
                self.start_window_on_reduced_values()  # carried, or accumulated onto
            buffer = self.ensure_main_grad()
            if self.state is GradState.EMPTY:
                buffer.zero_()
            return buffer
        buffer = group.allocator.allocate(
            group.temporary_key("staged_grad"), group.layout.total_numel,
            group.dtypes.comm, group.device,
        )
        buffer.zero_()
        return buffer

    def prepare_backward(self) -> None:
        """Before this group's parameters receive gradients in a backward (the unit's
        pre-backward, an activation-checkpoint recompute): preset the compute parameters'
        ``.grad`` to aliases of the plan's in-place buffer. Idempotent until :meth:`reduce`."""
        group = self.group
        if (not group.plan.grads_in_place or not group.requires_grad or self.staging.is_armed
                or self.staging.stages_spmd_grads):
            return
        # What the optimizer cleared since the install must not be added to (as in reduce).
        self.sweep()
        buffer = self._in_place_buffer()
        if buffer is not None:
            self.staging.arm(buffer)

    def forget_temporary_aliases(self) -> None:
        """Scratch-buffer memory was replaced or released: the staging's aliases over it go
        (:meth:`GradStaging.forget_temporary_aliases`; those of ``main_grad`` stay)."""
        self.staging.forget_temporary_aliases(self._main_grad)

    def drop_compute_grads(self) -> None:
        """Forget this backward's compute-parameter gradients (recovery after a failure)."""
        self.staging.disarm()
        self._return_unused_carry()
        for record in self.group.records:
            record.compute_param.grad = None

    # ------------------------------------------------------------------ reductions

    def reduce(self, is_last_backward: bool, async_op: bool = False) -> bool:
        """Stage this micro-batch's ``param.grad`` (or take it from where autograd wrote it in
        place) and run the plan's gradient path (see the table in design.md §4). Returns
        whether anything was staged or reduced."""
        group = self.group
        if not group.requires_grad and not self.pending_install:
            # Nothing trains and nothing is held: no reduction. A group frozen in the middle
            # of a window still reduces what its earlier micro-batches accumulated.
            return False
        staging = self.staging
        armed = staging.take_armed()
        if armed is None:
            # Gradients the optimizer cleared since they were installed must not be added to
            # (prepare_backward did this for an armed group).
            self.sweep()
        grads, received = staging.collect(armed)
        self.views.note_received(received)
        has_new = any(received)
        if not has_new and not (is_last_backward and self.state is GradState.ACCUMULATING):
            if armed is not None:
                staging.clear_aliases()
                self._return_unused_carry()
            return False
        if self.window_starts_on_reduced_values:
            self.start_window_on_reduced_values()
        delayed = (
            group.plan.grad_path is GradPath.ACCUMULATE_THEN_REDUCE
            and self.state is not GradState.REDUCED
        )
        if delayed:
            main_grad = self.ensure_main_grad()
            if armed is not None:
                staging.stage_over(grads, main_grad, self._accumulate_scale)
            elif has_new:
                staging.stage(grads, main_grad, accumulate=self.state is GradState.ACCUMULATING,
                              scale=self._accumulate_scale)
            self.state = GradState.ACCUMULATING
            if is_last_backward:
                self.reduce_accumulated(async_op)
        else:
            # The reduce-each path; also an accumulate-path group that already reduced in
            # this window (an unmarked loop: every backward is "last").
            self._reduce_micro_batch(grads, async_op, in_place=armed is not None)
        if self.window is WindowState.CLOSED:
            self.window = WindowState.OPEN
        for record in group.records:
            record.compute_param.grad = None
        return True

    def reduce_accumulated(self, async_op: bool) -> None:
        """The accumulate path's one collective over ``main_grad`` (or its place in a
        reduction bucket, when the tree coalesces and the collective runs in the background)."""
        group = self.group
        if self.coalescer is not None and async_op:
            self._coalesced = self.coalescer.add(group, self.ensure_main_grad(),
                                                 self._collective_scale)
            self.state = GradState.REDUCED
            return
        self._pending.append(_reduce.reduce_accumulated(
            group.plan, self.ensure_main_grad(), group.dtypes.comm, group.issuer,
            group.allocator, group.temporary_key("grad_comm"), async_op,
            pre_scale=self._collective_scale,
        ))
        self.state = GradState.REDUCED

    def _reduce_micro_batch(self, grads: Sequence[torch.Tensor | None], async_op: bool,
                            in_place: bool = False) -> None:
        group = self.group
        key = group.temporary_key("staged_grad")
        scale = group.grad_pre_scale
        if in_place:  # autograd wrote into the scratch buffer (see [Note: gradients in place])
            staged_grad = group.allocator.get(key)
            assert staged_grad is not None and group.allocator.is_allocated(key)
            if scale != 1.0:
                staged_grad.mul_(scale)
            self.staging.stage_over(grads, staged_grad, scale)
        else:
            staged_grad = group.allocator.allocate(
                key, group.layout.total_numel, group.dtypes.comm, group.device
            )
            self.staging.stage(grads, staged_grad, accumulate=False, scale=scale)
        accumulate = self.state is not GradState.EMPTY
        self._pending.append(_reduce.reduce_micro_batch(
            group.plan, staged_grad, self._reduction_target(), accumulate,
            group.issuer, group.allocator, key, async_op, host=group.host_offload,
        ))
        self.state = GradState.REDUCED

    def _reduction_target(self) -> torch.Tensor:
        """Where a micro-batch's reduction adds up: the optimizer-facing part of ``main_grad``,
        or the plan's ``window_grad`` scratch buffer (HSDP outer optim: the inner shard, alive
        across the window until ``window_steps`` reduce it into ``main_grad``)."""
        span = self.group.plan.window_grad_span
        if span is None:
            return self.main_grad_local()
        group = self.group
        return group.allocator.allocate(
            group.temporary_key("window_grad"), span[1] - span[0], group.dtypes.grad,
            group.device,
        )

    def _free_window_grad(self) -> None:
        if self.group.plan.window_grad_span is not None:
            self.group.allocator.free(self.group.temporary_key("window_grad"))

    # ------------------------------------------------------------------ HSDP outer axis

    def _carry_key(self) -> tuple[tuple[int, int], str]:
        return self.group.temporary_key("window_carry")

    @property
    def window_starts_on_reduced_values(self) -> bool:
        """The first write of a window finds reduced values in ``main_grad`` that the window's
        collectives must not count again: the accumulate path (its one collective would reduce
        them with the local partial sums), an HSDP window (its outer step) or a group with an
        all-reduce hook. They are carried (see [Note: HSDP window carry]). Decided by the state
        machine only, which is the same on every rank, never by the values."""
        plan = self.group.plan
        return not self.pending_install and self.state is GradState.REDUCED and (
            plan.grad_path is GradPath.ACCUMULATE_THEN_REDUCE or bool(plan.window_steps)
            or self.all_reduce_hook is not None
        )

    @property
    def _reduction_keeps_replicated_values(self) -> bool:
        """The window's one all-reduce returns installed values unchanged when every rank adds
        its local sums onto them in place: ``no_shard`` on a 1-D mesh, gradients in place (the
        collective scales by ``1/D`` and nothing else does), reduced in the gradient dtype (no
        rounding of the installed values to a lower one) and no all-reduce hook. The installed
        values are the same on every rank (they were reduced, and user code writes them alike),
        so ``1/D * sum over ranks (V + local sum) = V + mean of the local sums``: DDP's own
        arithmetic, without a carry."""
        group = self.group
        plan = group.plan
        return (
            plan.optimizer_placement is Extent.FULL and plan.grads_in_place
            and not plan.window_steps and self.all_reduce_hook is None
            and group.dtypes.comm == group.dtypes.grad
            and self._collective_scale * group.world_size == 1.0
        )

    def start_window_on_reduced_values(self) -> None:
        """The first write of a window finds installed values (``window_starts_on_reduced_
        values``): accumulate onto them where the reduction keeps them, else set them aside."""
        if self._reduction_keeps_replicated_values:
            self.state = GradState.ACCUMULATING
        else:
            self._carry_over()

    def _carry_over(self) -> None:
        """A window starts on reduced values: set them aside (see [Note: HSDP window carry])."""
        local = self.main_grad_local()
        carry = self.group.allocator.allocate(
            self._carry_key(), local.numel(), local.dtype, local.device
        )
        carry.copy_(local)
        self._carrying = True
        self.state = GradState.EMPTY  # the next write overwrites main_grad

    def _restore_carry(self) -> None:
        if self._carrying:
            carry = self.group.allocator.get(self._carry_key())
            assert carry is not None
            self.main_grad_local().add_(carry)
            self._drop_carry()

    def _return_unused_carry(self) -> None:
        """A window set its starting values aside (an armed pre-backward) and then received
        nothing: they go back, as they were (nothing was reduced in between)."""
        if self._carrying and self.state is GradState.EMPTY and not self.pending_install:
            carry = self.group.allocator.get(self._carry_key())
            assert carry is not None
            self.main_grad_local().copy_(carry)
            self._drop_carry()
            self.state = GradState.REDUCED

    def _drop_carry(self) -> None:
        if self._carrying:
            self.group.allocator.free(self._carry_key())
            self._carrying = False

    def reduce_across_replicas(self, async_op: bool) -> None:
        """End of a window whose inner reductions were waited on: the plan's ``window_steps``
        (HSDP outer no_shard: all-reduce the optimizer-facing shard over the outer group; outer
        optim: reduce-scatter the ``window_grad`` scratch buffer into it), then the window carry
        added back, both when :meth:`wait_for_reduction` runs. Only for a group that reduced in this
        window, which is the same on every rank, and once per window (the final callback calls
        it for groups whose reductions the unit's successor did not finish first); nothing on a
        1-D mesh."""
        group = self.group
        if not self.awaits_window_steps:
            return
        assert not self._pending, "inner reductions must be waited on first"
        self.window = WindowState.ENDING
        window_key = group.temporary_key("window_grad")
        window_grad = (
            group.allocator.get(window_key) if group.plan.window_grad_span is not None else None
        )
        assert window_grad is None or group.allocator.is_allocated(window_key)
        self._pending += _reduce.reduce_window(
            group.plan, self.main_grad_local(), window_grad, group.dtypes.comm, group.issuer,
            group.allocator, group.temporary_key("outer_comm"), window_key, async_op,
        )
        if self._carrying and self.all_reduce_hook is None:  # else after the hook
            self._pending.append(Deferred("the window carry added back", self._restore_carry))

    @property
    def awaits_window_steps(self) -> bool:
        """The plan's window steps (HSDP's outer reduction) are still to be launched for what
        this window reduced."""
        return (
            bool(self.group.plan.window_steps) and self.window is WindowState.OPEN
            and self.state is GradState.REDUCED
        )

    @property
    def pending_install(self) -> bool:
        """Something was staged or reduced that the optimizer has not been shown yet."""
        return self.window is not WindowState.CLOSED

    @property
    def awaits_last_reduction(self) -> bool:
        """Locally accumulated micro-batches wait for the delayed collective of the last one."""
        return self.state is GradState.ACCUMULATING and self.pending_install

    @property
    def reduction_holds_temporary(self) -> bool:
        """An in-flight reduction of this group holds a scratch buffer until finished."""
        return any(p.holds_temporary for p in self._pending)

    @property
    def reduction_holds_memory(self) -> bool:
        """An in-flight reduction of this group holds memory until finished: a scratch buffer
        of ours, or a reduce-scatter, whose transport may hold a copy of its input (see [Note:
        in-place reductions in flight] in ``_state.py``). Only an all-reduce in place into a
        persistent buffer holds none."""
        steps = self.group.plan.reduce_steps
        return self.reduction_holds_temporary or (
            bool(self._pending) and any(s.op is Collective.REDUCE_SCATTER for s in steps))

    @traced("mfsdp::finish_reduce")
    def wait_for_reduction(self, coalesced: bool = True) -> None:
        """Wait for in-flight gradient collectives and fold their results into ``main_grad``.
        ``coalesced=False`` leaves a reduction queued in a reduction bucket alone (it holds no
        scratch buffer of this group; the final callback issues and waits for it)."""
        if coalesced and self._coalesced is not None:
            bucketed, self._coalesced = self._coalesced, None
            bucketed.finish()
        pending, self._pending = self._pending, []
        for reduction in pending:
            reduction.finish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (``FSDPModule.zero_grad``)."""
        if self.finalization is not None:  # installed first, so that nothing installs later
            self.finalization.finish()
        self.staging.disarm()
        for record in self.group.records:
            if set_to_none:
                record.dist_param.grad = None
            record.compute_param.grad = None
        self.views.forget_window()
        self.window = WindowState.CLOSED
        self._drop_carry()
        self._free_window_grad()
        if set_to_none or self.state is GradState.EMPTY:
            self.release_storage()
            return
        self.ensure_main_grad().zero_()
        self.restart_accumulation_from_zeros()

    def end_window(self, async_op: bool) -> Deferred:
        """The end of an accumulation window, the one sequence for both ends of a window (the
        final callback of a backward marked last, and :func:`finalize_unsynchronized` for
        windows no backward marked): the delayed collective of what is still accumulated, the
        inner reductions waited on, the plan's window steps launched (HSDP's outer reduction;
        nothing on a 1-D mesh). The returned handle's ``finish()`` waits for them and installs
        the gradients; the final callback launches every group's window end before finishing
        any, so the outer collectives run together (same order on every rank)."""
        if self.awaits_last_reduction:
            self.reduce_accumulated(async_op=False)
        if self._coalesced is not None:
            assert self.coalescer is not None
            self.coalescer.flush()  # its bucket, if still open (the final callback flushed it)
        self.wait_for_reduction()
        self.reduce_across_replicas(async_op)
        return Deferred("gradient window end: reductions waited, gradients installed",
                        self._finish_window)

    def _finish_window(self) -> None:
        self.wait_for_reduction()
        if self.group.host_offload is not None:  # the one host sync (see [Note: host offload])
            self.group.host_offload.wait_for_copies()
        hook = self.all_reduce_hook
        if hook is not None and self.pending_install and self.state is GradState.REDUCED:
            run_all_reduce_hook(hook, self.all_reduce_hook_stream, self.main_grad_local())
        self._restore_carry()
        self.install()

    # ------------------------------------------------------------------ what the optimizer sees

    @traced("mfsdp::install")
    def install(self) -> None:
        """Expose the reduced gradients (after the window's last micro-batch) as the
        optimizer-facing parameters' ``.grad`` (:meth:`OptimizerGradViews.install`)."""
        if self.state is not GradState.REDUCED:
            return
        self.ensure_main_grad()
        any_installed = self.views.install()
        self.window = WindowState.CLOSED
        if not any_installed:  # nothing to show: all zeros, start the next window afresh
            self.release_storage()

    def sweep(self) -> None:
        """Take in what the user did to the installed gradients since they were installed
        (:meth:`OptimizerGradViews.sweep`); all of them cleared: free ``main_grad``."""
        if self.views.sweep():
            self.release_storage()

    def note_frozen(self, index: int) -> None:
        """Parameter ``index`` stopped requiring gradients (see
        :meth:`OptimizerGradViews.note_frozen`)."""
        self.views.note_frozen(index)

    def memory_bytes(self) -> int:
        lo, hi = self.group.plan.main_grad_span
        return (hi - lo) * self.group.dtypes.grad.itemsize if self.group.requires_grad else 0


def finalize_unsynchronized(groups: Iterable[FlatParamGroup], where: str) -> None:
    """Reduce and expose gradients that no backward marked as the last of its window, so that
    ``where`` (the optimizer step, clipping) never silently works on missing gradients. An
    asynchronous ``finalize_backward()`` whose handle was not waited on yet is finished first."""
    groups = list(groups)
    for group in groups:
        if group.grads.finalization is not None:
            group.grads.finalization.finish()  # clears the field of every group it ended
    finalized = []
    for group in groups:
        if group.grads.pending_install:
            group.grads.end_window(async_op=False).finish()
            finalized.append(group)
    if finalized:
        warnings.warn(
            f"{where} found gradients that were never synchronized across ranks: every backward "
            "since the last step ran with set_is_last_backward(False) (or inside no_sync(), or "
            "with set_requires_all_reduce(False) on an HSDP unit). "
            "fully_shard reduced them now, without overlap; call "
            "model.set_is_last_backward(True) before the last micro-batch's backward (or leave "
            "the no_sync() context for it) so the reduction overlaps backward",
            UserWarning,
            stacklevel=3,
        )
