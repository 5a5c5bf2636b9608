"""A flat group's gradients: the persistent ``main_grad`` buffer, the gradient path of the plan
(stage each micro-batch, reduce through ``_reduce.py``), and what the optimizer sees as
``.grad`` (DTensor views of ``main_grad``, installed per parameter with torch's semantics
although the buffer is shared).

[Note: gradients the optimizer sees]
Each optimizer-facing parameter gets a DTensor view of its rows of ``main_grad``, built once (so
optimizers keyed on gradient identity see stable objects) and installed after the last
micro-batch of a window. Per parameter, as in single-process torch:

* ``None`` when nothing flowed into it since its gradient was last cleared (AdamW then leaves
  it alone: no weight decay, no momentum step). Locally that is known; another rank's use shows
  in the reduced values, so a parameter unused here whose reduced local gradient is exactly
  zero gets ``None``. Also ``None``: an empty local shard (fused optimizers mishandle zero-size
  tensors) and a parameter that does not train.
* Between the step and the next backward, :meth:`GroupGrads.sweep` takes in what the user
  did: all set to ``None`` (``optimizer.zero_grad()``): free the storage. Some set to ``None``
  (an optimizer over part of a unit): zero those, so they start afresh while the others keep
  accumulating. Replaced by another tensor: adopt its values. Zeroed in place on the accumulate
  path (``zero_grad(set_to_none=False)``): the zeros are valid local partial sums, so the next
  window takes the one-collective path again.

[Note: HSDP window carry]
On a 2-D mesh with an outer ``no_shard`` axis the plan has ``window_steps``: at the end of each
window (:meth:`GroupGrads.reduce_across_replicas`) the inner-reduced shard is all-reduced over
the outer group. That is only right if ``main_grad`` held nothing but this window's
contributions. A window can start with globally reduced values in it (gradients not cleared
between steps, an unmarked loop where every backward is "last", a second backward over a
retained graph): all-reducing those again would count them R times. So the first reduction of a
window (``pending_install`` False) that finds ``main_grad`` REDUCED moves what the optimizer-
facing part holds into a temporary ``window_carry`` bucket and restarts from EMPTY; after the
window's outer all-reduce the carry is added back and freed. Clearing gradients in between
(``zero_grad``, all installed gradients set to ``None``) drops the carry.

With an outer ``optim`` axis the window's micro-batches add into a temporary ``window_grad``
bucket (the inner shard; the plan's ``window_grad_span``) and the window step reduce-scatters it
over the outer group into ``main_grad`` (this rank's sub-shard), overwriting it: the same carry
rule keeps what ``main_grad`` held. Clearing gradients frees ``window_grad`` too.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from . import _reduce, ops
from ._plan import GradPath
from ._profiling import traced

if TYPE_CHECKING:
    from ._flat_param_group import FlatParamGroup

__all__ = ["GradState", "GroupGrads", "finalize_unsynchronized"]


class GradState(enum.Enum):
    """What ``main_grad`` holds."""

    EMPTY = "empty"
    """Nothing: the next gradient write overwrites (storage may be freed)."""
    ACCUMULATING = "accumulating"
    """Local, unreduced sums in the full-size ``main_grad`` (the accumulate path between the
    first and the last micro-batch)."""
    REDUCED = "reduced"
    """Reduced sums in this rank's part of ``main_grad``; new micro-batches are reduced first and
    then added."""


class GroupGrads:
    """The gradients of one flat group (see [Note: gradients the optimizer sees])."""

    def __init__(self, group: FlatParamGroup) -> None:
        self.group = group
        self.state = GradState.EMPTY
        self._main_grad: torch.Tensor | None = None  # storage freed while EMPTY
        self._pending: list[_reduce.Pending] = []
        n = len(group.records)
        self._views: list[DTensor | None] | None = None
        self._installed: list[DTensor | None] = [None] * n
        self._any_installed = False
        # Parameters that received a gradient on this rank since the last install.
        self._received = [False] * n
        # Something was staged or reduced that the optimizer has not been shown yet.
        self.pending_install = False
        # [Note: HSDP window carry] main_grad_local's values at the window start, if any.
        self._carrying = False

    # ------------------------------------------------------------------ main_grad

    def ensure_main_grad(self) -> torch.Tensor:
        """``main_grad`` with its storage allocated (one tensor object for life, so cached
        gradient views stay valid; see [Note: storage-freeing buckets])."""
        main_grad = self._main_grad
        if main_grad is None:
            lo, hi = self.group.plan.main_grad_span
            main_grad = torch.empty(hi - lo, dtype=self.group.dtypes.grad, device=self.group.device)
            self._main_grad = main_grad
        elif main_grad.untyped_storage().nbytes() == 0:
            main_grad.untyped_storage().resize_(main_grad.numel() * main_grad.element_size())
        return main_grad

    def main_grad_local(self) -> torch.Tensor:
        """The part of ``main_grad`` behind the optimizer-facing gradients."""
        main_grad = self.ensure_main_grad()
        offset = self.group.plan.main_grad_span[0]
        lo, hi = self.group.plan.main_weight_span
        return main_grad[lo - offset : hi - offset]

    def release_storage(self) -> None:
        self._drop_carry()
        self._free_window_grad()
        if self._main_grad is not None:
            self._main_grad.untyped_storage().resize_(0)
        self.state = GradState.EMPTY
        self._installed = [None] * len(self._installed)
        self._any_installed = False

    def restart_accumulation_from_zeros(self) -> None:
        """``main_grad`` holds zeros: valid local partial sums, so the accumulate path goes back
        to its one collective per window."""
        self.state = (
            GradState.ACCUMULATING
            if self.group.plan.grad_path is GradPath.ACCUMULATE_THEN_REDUCE else GradState.REDUCED
        )

    # ------------------------------------------------------------------ the gradient path

    @traced("mfsdp::stage")
    def _stage(self, grads: Sequence[torch.Tensor | None], full_buffer: torch.Tensor,
               accumulate: bool) -> None:
        """Write (or add) ``scale * param.grad`` into a full-size flat buffer."""
        layout = self.group.layout
        inputs, offsets = [], []
        for grad, item in zip(grads, layout.items):
            if grad is not None:
                inputs.append(grad if grad.is_contiguous() else grad.contiguous())
                offsets.append(item.offset)
        if not accumulate:
            # Regions nothing writes: padding, gaps, and parameters without a gradient.
            for lo, hi in self.group.uncovered:
                full_buffer[lo:hi].zero_()
            for grad, item in zip(grads, layout.items):
                if grad is None:
                    full_buffer[item.offset : item.end].zero_()
        if inputs:
            ops.pack_(inputs, offsets, full_buffer, scale=self.group.grad_pre_scale,
                      accumulate=accumulate)

    def reduce(self, is_last_backward: bool, async_op: bool = False) -> bool:
        """Stage this micro-batch's ``param.grad`` and run the plan's gradient path (see the
        table in design.md §4). Returns whether anything was staged or reduced."""
        group = self.group
        if not group.requires_grad:
            return False
        # Gradients the optimizer cleared since they were installed must not be added to.
        self.sweep()
        grads = [r.compute_param.grad for r in group.records]
        has_new = False
        for index, grad in enumerate(grads):
            if grad is not None:
                has_new = self._received[index] = True
        if not has_new and not (is_last_backward and self.state is GradState.ACCUMULATING):
            return False
        if (
            group.plan.window_steps and not self.pending_install
            and self.state is GradState.REDUCED
        ):
            self._carry_over()
        delayed = (
            group.plan.grad_path is GradPath.ACCUMULATE_THEN_REDUCE
            and self.state is not GradState.REDUCED
        )
        if delayed:
            main_grad = self.ensure_main_grad()
            if has_new:
                self._stage(grads, main_grad, accumulate=self.state is GradState.ACCUMULATING)
            self.state = GradState.ACCUMULATING
            if is_last_backward:
                self.reduce_accumulated(async_op)
        else:
            # The reduce-each path; also an accumulate-path group that already reduced in
            # this window (an unmarked loop: every backward is "last").
            self._reduce_micro_batch(grads, async_op)
        self.pending_install = True
        for record in group.records:
            record.compute_param.grad = None
        return True

    def reduce_accumulated(self, async_op: bool) -> None:
        """The accumulate path's one collective over ``main_grad``."""
        group = self.group
        self._pending.append(_reduce.reduce_accumulated(
            group.plan, self.ensure_main_grad(), group.dtypes.comm, group.process_group,
            group.allocator, group.temporary_key("grad_comm"), group.issue, async_op,
        ))
        self.state = GradState.REDUCED

    def _reduce_micro_batch(self, grads: Sequence[torch.Tensor | None], async_op: bool) -> None:
        group = self.group
        key = group.temporary_key("reduce_scatter_input")
        reduce_scatter_input = group.allocator.allocate(
            key, group.layout.total_numel, group.dtypes.comm, group.device
        )
        self._stage(grads, reduce_scatter_input, accumulate=False)
        accumulate = self.state is not GradState.EMPTY
        self._pending.append(_reduce.reduce_micro_batch(
            group.plan, reduce_scatter_input, self._reduction_target(), accumulate,
            group.process_group, group.allocator, key, group.issue, async_op,
        ))
        self.state = GradState.REDUCED

    def _reduction_target(self) -> torch.Tensor:
        """Where a micro-batch's reduction adds up: the optimizer-facing part of ``main_grad``,
        or the plan's ``window_grad`` bucket (HSDP outer optim: the inner shard, alive across
        the window until ``window_steps`` reduce it into ``main_grad``)."""
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

    def _drop_carry(self) -> None:
        if self._carrying:
            self.group.allocator.free(self._carry_key())
            self._carrying = False

    def reduce_across_replicas(self, async_op: bool) -> None:
        """End of a window whose inner reductions were waited on: the plan's ``window_steps``
        (HSDP outer no_shard: all-reduce the optimizer-facing shard over the outer group; outer
        optim: reduce-scatter the ``window_grad`` bucket into it), then the window carry added
        back, both when :meth:`wait_for_reduction` runs. Only for a group that reduced in this
        window, which is the same on every rank; nothing on a 1-D mesh."""
        group = self.group
        if not group.plan.window_steps:
            return
        if not self.pending_install or self.state is not GradState.REDUCED:
            return
        assert not self._pending, "inner reductions must be waited on first"
        window_key = group.temporary_key("window_grad")
        window_grad = (
            group.allocator.get(window_key) if group.plan.window_grad_span is not None else None
        )
        assert window_grad is None or group.allocator.is_allocated(window_key)
        self._pending += _reduce.reduce_window(
            group.plan, self.main_grad_local(), window_grad, group.dtypes.comm,
            group.axis_groups, group.allocator, group.temporary_key("outer_comm"), window_key,
            group.issue, async_op,
        )
        self._pending.append(_reduce.Pending(None, self._restore_carry))

    @property
    def awaits_last_reduction(self) -> bool:
        """Locally accumulated micro-batches wait for the delayed collective of the last one."""
        return self.state is GradState.ACCUMULATING and self.pending_install

    @property
    def has_pending_reduction(self) -> bool:
        return bool(self._pending)

    @traced("mfsdp::finish_reduce")
    def wait_for_reduction(self) -> None:
        """Wait for in-flight gradient collectives and fold their results into ``main_grad``."""
        pending, self._pending = self._pending, []
        for reduction in pending:
            reduction.finish()

    # ------------------------------------------------------------------ what the optimizer sees

    def forget_views(self) -> None:
        self._views = None

    def view(self, index: int) -> DTensor | None:
        """Parameter ``index``'s gradient view (None: empty local shard or not trained)."""
        if self._views is None:
            group = self.group
            local = self.main_grad_local()
            self._views = []
            for i, record in enumerate(group.records):
                rows = group.local_view(local, i)
                self._views.append(
                    group.to_dtensor(rows, i)
                    if rows.numel() > 0 and record.dist_param.requires_grad else None
                )
        return self._views[index]

    @traced("mfsdp::install")
    def install(self) -> None:
        """Expose the reduced gradients (after the window's last micro-batch)."""
        if self.state is not GradState.REDUCED:
            return
        self.ensure_main_grad()
        any_installed = False
        for index, record in enumerate(self.group.records):
            view = self.view(index)
            had_grad = self._received[index] or self._installed[index] is not None
            if view is not None and not had_grad and not bool(view._local_tensor.any()):
                view = None
            record.dist_param.grad = view
            self._installed[index] = view
            any_installed |= view is not None
        self._received = [False] * len(self._received)
        self.pending_install = False
        self._any_installed = any_installed
        if not any_installed:  # nothing to show: all zeros, start the next window afresh
            self.release_storage()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (``FSDPModule.zero_grad``)."""
        for record in self.group.records:
            if set_to_none:
                record.dist_param.grad = None
            record.compute_param.grad = None
        self._received = [False] * len(self._received)
        self.pending_install = False
        self._drop_carry()
        self._free_window_grad()
        if set_to_none or self.state is GradState.EMPTY:
            self.release_storage()
            return
        self.ensure_main_grad().zero_()
        self.restart_accumulation_from_zeros()

    def sweep(self) -> None:
        """Take in what the user did to the installed gradients since they were installed."""
        if not self._any_installed:
            return
        live = False
        cleared = []
        for index, record in enumerate(self.group.records):
            view = self._installed[index]
            if view is None:
                continue
            grad = record.dist_param.grad
            if grad is view:
                live = True
            elif grad is None:
                cleared.append(index)
                self._installed[index] = None
            else:  # replaced by the user: adopt its values
                with torch.no_grad():
                    view._local_tensor.copy_(grad.to_local() if isinstance(grad, DTensor) else grad)
                record.dist_param.grad = view
                live = True
        if not live:
            self.release_storage()
            return
        for index in cleared:
            view = self.view(index)
            assert view is not None
            view._local_tensor.zero_()
        if (
            self.group.plan.grad_path is GradPath.ACCUMULATE_THEN_REDUCE
            and self.state is GradState.REDUCED
            and not bool(self.main_grad_local().any())
        ):
            self.ensure_main_grad().zero_()
            self.restart_accumulation_from_zeros()

    def finalize(self) -> bool:
        """Reduce and install gradients that no backward marked as the last of its window
        (``set_is_last_backward(False)`` throughout). Returns whether there were any."""
        if not self.pending_install:
            return False
        if self.state is GradState.ACCUMULATING:
            self.reduce_accumulated(async_op=False)
        self.wait_for_reduction()
        self.reduce_across_replicas(async_op=False)
        self.wait_for_reduction()
        self.install()
        return True

    def memory_bytes(self) -> int:
        lo, hi = self.group.plan.main_grad_span
        return (hi - lo) * self.group.dtypes.grad.itemsize if self.group.requires_grad else 0


def finalize_unsynchronized(groups: Iterable[FlatParamGroup], where: str) -> None:
    """Reduce and expose gradients that no backward marked as the last of its window, so that
    ``where`` (the optimizer step, clipping) never silently works on missing gradients."""
    finalized = [group for group in groups if group.grads.finalize()]
    if finalized:
        warnings.warn(
            f"{where} found gradients that were never synchronized across ranks: every backward "
            "since the last step ran with set_is_last_backward(False) (or inside no_sync()). "
            "fully_shard reduced them now, without overlap; call "
            "model.set_is_last_backward(True) before the last micro-batch's backward (or leave "
            "the no_sync() context for it) so the reduction overlaps backward",
            UserWarning,
            stacklevel=3,
        )
