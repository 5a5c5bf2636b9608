"""A flat group's gradients: the persistent ``main_grad`` buffer, the gradient path of the plan
(gradients written in place by autograd or staged per micro-batch, reduced through
``_reduce.py``), and what the optimizer sees as ``.grad`` (DTensor views of ``main_grad``,
installed per parameter with torch's semantics although the buffer is shared).

[Note: gradients the optimizer sees]
Each optimizer-facing parameter gets a DTensor view of its rows of ``main_grad``, built once (so
optimizers keyed on gradient identity see stable objects) and installed after the last
micro-batch of a window. Per parameter, as in single-process torch:

* ``None`` when nothing flowed into it since its gradient was last cleared (AdamW then leaves
  it alone: no weight decay, no momentum step). Locally that is known (a compute ``.grad`` was
  set, or its in-place alias written: [Note: gradients in place]); another rank's use shows
  in the reduced values, so a parameter unused here whose reduced local gradient is exactly
  zero gets ``None``. Also ``None``: an empty local shard (fused optimizers mishandle zero-size
  tensors) and a parameter that does not train.
* Between the step and the next backward, :meth:`GroupGrads.sweep` takes in what the user
  did: all set to ``None`` (``optimizer.zero_grad()``): free the storage. Some set to ``None``
  (an optimizer over part of a unit): zero those, so they start afresh while the others keep
  accumulating. Replaced by another tensor: adopt its values. Zeroed in place on the accumulate
  path (``zero_grad(set_to_none=False)``): the zeros are valid local partial sums, so the next
  window takes the one-collective path again. Neither case reads a value on the host, nor
  does the ``None`` rule above when every parameter received a gradient here; see [Note:
  gradients known without a host read] in ``_zeroed_grads.py``.

[Note: gradients in place]
When the plan says ``grads_in_place`` (the first buffer the gradient path writes is in the
compute dtype), :meth:`GroupGrads.prepare_backward` runs before a unit's parameters receive
gradients (its pre-backward, and an activation-checkpoint recompute) and presets each compute
parameter's ``.grad`` to an alias of its region of that buffer; autograd's ``AccumulateGrad``
then adds into it in place (``grad += new``), as DDP's ``gradient_as_bucket_view`` and
Megatron's ``main_grad`` do. No staging copy, and no gradient-sized tensor per parameter lives
until the unit's post-backward.

* Accumulate path (``no_shard``, ``optim``): the aliases view ``main_grad``, zeroed when a
  window starts (state EMPTY). ``main_grad`` then holds *unscaled* local sums, and the
  pre-scale (``1/D`` or ``gradient_scaling_factor``) is applied once before the delayed
  collective (fused with the cast into the workspace when the communication dtype differs).
  Micro-batches staged on this path (below) are therefore staged unscaled too. When
  ``main_grad`` holds REDUCED values (an unmarked loop, gradients not cleared, an HSDP window
  carry) no alias is set: those micro-batches take the staging path as before.
* Reduce-each path (``optim_grads``): the aliases view the unit's ``reduce_scatter_input``
  bucket, allocated and zeroed at the pre-backward instead of the post-backward (while its
  autograd gradients would otherwise be alive: the same bytes, held as one bucket); the
  post-backward scales it in place and reduces it. Not under ZeRO-3 (``optim_grads_params``,
  HSDP outer ``optim``): there the early bucket adds to the unit's gathered weights, the
  prefetched previous unit's and the bucket still in flight; measured (4 gloo ranks, 5.3M-
  parameter GPT, ``bench_training.py``), the allocator peak grew by one block's bucket and peak
  RSS above the runtime by 3 MiB (203 -> 206), where ``no_shard``, ``optim`` and ``optim_grads``
  stayed equal; so ZeRO-3 stages, as FSDP2 does.

A unit with units nested below it (typically the root: embeddings, output head) runs its
pre-backward when backward starts and its post-backward when it ends, so its buffer, armed, is
allocated at the activation peak although most of its gradients arrive at the end
(``FSDPState.prepare_gradients``):

* Accumulate path: it arms. Staged, each of its gradients would be an autograd tensor alive
  from its arrival to the end of backward, then copied into ``main_grad`` in the critical
  path, just before the last reduction. Measured (4 gloo ranks, 29.5M-parameter GPT whose
  root holds 8.4M parameters, fp32, ``bench_training.py``): the root's ``pack_`` of 34 ms per
  step goes away; peak RSS above base grows by 16 MiB (``no_shard`` 630 -> 646 MiB, DDP 679;
  ``optim`` 461 -> 477): the root's ``main_grad`` now lives during backward, less the head's
  gradient that no longer lives beside it.
* Reduce-each path: it stages. The buffer there is a temporary bucket that would otherwise not
  exist until the post-backward, when activations are gone.

The aliases are separate tensors over the buffer's storage (``Tensor.set_``), not autograd
views, so each has its own version counter: a parameter received a gradient in this backward
iff its alias' version moved (``AccumulateGrad`` is not called for a parameter nothing flowed
into), which keeps ``.grad=None`` for unused parameters exactly as before. Whatever ``.grad``
is after backward if it is not the alias (``create_graph=True`` makes ``AccumulateGrad`` replace
it with ``grad + new``; user code may assign it) holds that parameter's whole value: it is
staged over the parameter's region. After the reduction every compute ``.grad`` is ``None``
again; the aliases are cached (the buffers keep one tensor object across storage freeing;
a trace-pool arena that is replaced or released drops them: ``forget_temporary_aliases``).

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

from .. import ops
from .._buffers._plan import GradPath
from .._profiling import traced
from . import _reduce
from ._zeroed_grads import ZeroMarks, all_zeros, reduced_nonzero, zero_outside

if TYPE_CHECKING:
    from ._coalesce import ReductionCoalescer
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
        # The delayed reduction queued in the tree's reduction buckets (see [Note: reduction
        # buckets] in _coalesce.py); ``coalescer`` is set by the root's lazy init when the tree
        # coalesces.
        self.coalescer: ReductionCoalescer | None = None
        self._coalesced: _reduce.Pending | None = None
        n = len(group.records)
        self._views: list[DTensor | None] | None = None
        self._installed: list[DTensor | None] = [None] * n
        self._any_installed = False
        # Parameters that received a gradient on this rank since the last install.
        self._received = [False] * n
        # Installed views an optimizer zeroed in place (see [Note: gradients known without a
        # host read] in _zeroed_grads.py).
        self._zero_marks = ZeroMarks(n)
        # Something was staged or reduced that the optimizer has not been shown yet.
        self.pending_install = False
        # [Note: HSDP window carry] main_grad_local's values at the window start, if any.
        self._carrying = False
        # The window's steps (HSDP's outer reduction) were launched and not yet installed.
        self._window_issued = False
        # [Note: gradients in place] The aliases of the buffer they were built over, and while
        # a backward writes through them, each armed parameter's alias version (else None).
        self._alias_base: torch.Tensor | None = None
        self._aliases: list[torch.Tensor] = []
        self._armed: list[int | None] | None = None

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
        self._drop_carry()
        self._free_window_grad()
        if self._main_grad is not None:
            self._main_grad.untyped_storage().resize_(0)
        self.state = GradState.EMPTY
        self._installed = [None] * len(self._installed)
        self._any_installed = False
        self._zero_marks.clear()
        self._window_issued = False

    def restart_accumulation_from_zeros(self) -> None:
        """``main_grad`` holds zeros: valid local partial sums, so the accumulate path goes back
        to its one collective per window."""
        self.state = (
            GradState.ACCUMULATING
            if self.group.plan.grad_path is GradPath.ACCUMULATE_THEN_REDUCE else GradState.REDUCED
        )

    # ------------------------------------------------------------------ the gradient path

    @property
    def _accumulate_scale(self) -> float:
        """The scale of what the accumulate path stages into ``main_grad`` (1 when gradients go
        in place: the delayed collective scales; see [Note: gradients in place])."""
        return 1.0 if self.group.plan.grads_in_place else self.group.grad_pre_scale

    @property
    def _collective_scale(self) -> float:
        """What the accumulate path's delayed collective multiplies ``main_grad`` by first."""
        return self.group.grad_pre_scale if self.group.plan.grads_in_place else 1.0

    @traced("mfsdp::stage")
    def _stage(self, grads: Sequence[torch.Tensor | None], full_buffer: torch.Tensor,
               accumulate: bool, scale: float) -> None:
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
            ops.pack_(inputs, offsets, full_buffer, scale=scale, accumulate=accumulate)

    # ------------------------------------------------------------------ gradients in place

    def _in_place_buffer(self) -> torch.Tensor | None:
        """The buffer this backward's gradients go into in place (allocated, zeroed where a
        window or a micro-batch starts), or None: stage them (see [Note: gradients in place])."""
        group = self.group
        if group.plan.grad_path is GradPath.ACCUMULATE_THEN_REDUCE:
            if self.state is GradState.REDUCED:
                return None  # reduced values: later micro-batches are reduced, then added
            buffer = self.ensure_main_grad()
            if self.state is GradState.EMPTY:
                buffer.zero_()
            return buffer
        buffer = group.allocator.allocate(
            group.temporary_key("reduce_scatter_input"), group.layout.total_numel,
            group.dtypes.comm, group.device,
        )
        buffer.zero_()
        return buffer

    def _aliases_of(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """One tensor per parameter over its region of ``buffer`` (a full-size flat buffer),
        each with its own version counter (not an autograd view)."""
        if self._alias_base is not buffer:
            storage, base = buffer.untyped_storage(), buffer.storage_offset()
            aliases = []
            with torch.no_grad(), torch.inference_mode(False):
                for item in self.group.layout.items:
                    region = buffer[item.offset : item.end].view(item.shape)
                    aliases.append(
                        torch.empty(0, dtype=buffer.dtype, device=buffer.device).set_(
                            storage, base + item.offset, region.shape, region.stride()
                        )
                    )
            self._aliases, self._alias_base = aliases, buffer
        return self._aliases

    def forget_temporary_aliases(self) -> None:
        """The memory temporary buckets live in was replaced or released (a trace-pool replan,
        ``release_memory_pool()``): drop aliases cached over a temporary bucket, which would
        keep the old arena alive until the next backward; they are rebuilt over the new one
        then. Aliases of ``main_grad`` stay (it is persistent)."""
        if self._armed is None and self._alias_base is not None and (
            self._alias_base is not self._main_grad
        ):
            self._aliases, self._alias_base = [], None

    def prepare_backward(self) -> None:
        """Before this group's parameters receive gradients in a backward (the unit's
        pre-backward, an activation-checkpoint recompute): preset the compute parameters'
        ``.grad`` to aliases of the plan's in-place buffer. Idempotent until :meth:`reduce`."""
        group = self.group
        if not group.plan.grads_in_place or not group.requires_grad or self._armed is not None:
            return
        # What the optimizer cleared since the install must not be added to (as in reduce).
        self.sweep()
        buffer = self._in_place_buffer()
        if buffer is None:
            return
        armed: list[int | None] = []
        for record, alias in zip(group.records, self._aliases_of(buffer)):
            param = record.compute_param
            if not param.requires_grad:
                armed.append(None)
                continue
            if param.grad is not None:  # left by user code: keep its contribution
                with torch.no_grad():  # entered only here: a measurable cost per group
                    alias.add_(param.grad)
            param.grad = alias
            armed.append(alias._version)
        self._armed = armed

    def _disarm(self) -> None:
        """Drop the aliases of a backward that will not be reduced (gradients discarded)."""
        if self._armed is not None:
            self._armed = None
            self._clear_aliases()

    def _clear_aliases(self) -> None:
        for record in self.group.records:
            record.compute_param.grad = None
        if self.group.plan.grad_path is GradPath.REDUCE_EACH_MICRO_BATCH:
            self.group.allocator.free(self.group.temporary_key("reduce_scatter_input"))

    def drop_compute_grads(self) -> None:
        """Forget this backward's compute-parameter gradients (recovery after a failure)."""
        self._disarm()
        for record in self.group.records:
            record.compute_param.grad = None

    def _collect(self, armed: list[int | None] | None
                 ) -> tuple[list[torch.Tensor | None], bool]:
        """This backward's gradients still to be staged (None: none, or already in the
        buffer), and whether any parameter received one; records who did."""
        grads: list[torch.Tensor | None] = []
        has_new = False
        for index, record in enumerate(self.group.records):
            grad = record.compute_param.grad
            version = None if armed is None else armed[index]
            if version is not None and grad is self._aliases[index]:
                received = grad._version != version
                grad = None  # in the buffer already
            else:
                received = grad is not None
                if grad is not None and grad.requires_grad:  # create_graph=True
                    grad = grad.detach()
            grads.append(grad)
            if received:
                has_new = self._received[index] = True
        return grads, has_new

    def _stage_over(self, grads: Sequence[torch.Tensor | None], buffer: torch.Tensor,
                    scale: float) -> None:
        """Gradients autograd or the user put in place of the aliases: overwrite their
        parameters' regions of ``buffer`` (they hold the whole value)."""
        if any(g is not None for g in grads):
            items = self.group.layout.items
            kept = [(g.contiguous(), item.offset) for g, item in zip(grads, items) if g is not None]
            ops.pack_([g for g, _ in kept], [o for _, o in kept], buffer, scale=scale,
                      accumulate=False)

    # ------------------------------------------------------------------ reductions

    def reduce(self, is_last_backward: bool, async_op: bool = False) -> bool:
        """Stage this micro-batch's ``param.grad`` (or take it from where autograd wrote it in
        place) and run the plan's gradient path (see the table in design.md §4). Returns
        whether anything was staged or reduced."""
        group = self.group
        if not group.requires_grad:
            return False
        armed, self._armed = self._armed, None
        if armed is None:
            # Gradients the optimizer cleared since they were installed must not be added to
            # (prepare_backward did this for an armed group).
            self.sweep()
        grads, has_new = self._collect(armed)
        if not has_new and not (is_last_backward and self.state is GradState.ACCUMULATING):
            if armed is not None:
                self._clear_aliases()
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
            if armed is not None:
                self._stage_over(grads, main_grad, self._accumulate_scale)
            elif has_new:
                self._stage(grads, main_grad, accumulate=self.state is GradState.ACCUMULATING,
                            scale=self._accumulate_scale)
            self.state = GradState.ACCUMULATING
            if is_last_backward:
                self.reduce_accumulated(async_op)
        else:
            # The reduce-each path; also an accumulate-path group that already reduced in
            # this window (an unmarked loop: every backward is "last").
            self._reduce_micro_batch(grads, async_op, in_place=armed is not None)
        self.pending_install = True
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
            group.plan, self.ensure_main_grad(), group.dtypes.comm, group.process_group,
            group.allocator, group.temporary_key("grad_comm"), group.issue, async_op,
            pre_scale=self._collective_scale,
        ))
        self.state = GradState.REDUCED

    def _reduce_micro_batch(self, grads: Sequence[torch.Tensor | None], async_op: bool,
                            in_place: bool = False) -> None:
        group = self.group
        key = group.temporary_key("reduce_scatter_input")
        scale = group.grad_pre_scale
        if in_place:  # autograd wrote into the bucket (see [Note: gradients in place])
            reduce_scatter_input = group.allocator.get(key)
            assert reduce_scatter_input is not None and group.allocator.is_allocated(key)
            if scale != 1.0:
                reduce_scatter_input.mul_(scale)
            self._stage_over(grads, reduce_scatter_input, scale)
        else:
            reduce_scatter_input = group.allocator.allocate(
                key, group.layout.total_numel, group.dtypes.comm, group.device
            )
            self._stage(grads, reduce_scatter_input, accumulate=False, scale=scale)
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
        window, which is the same on every rank, and once per window (the final callback calls
        it for groups whose reductions the unit's successor did not finish first); nothing on a
        1-D mesh."""
        group = self.group
        if not self.awaits_window_steps:
            return
        assert not self._pending, "inner reductions must be waited on first"
        self._window_issued = True
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
        if self._carrying:
            self._pending.append(_reduce.Pending(None, self._restore_carry))

    @property
    def awaits_window_steps(self) -> bool:
        """The plan's window steps (HSDP's outer reduction) are still to be launched for what
        this window reduced."""
        return (
            bool(self.group.plan.window_steps) and self.pending_install
            and self.state is GradState.REDUCED and not self._window_issued
        )

    @property
    def awaits_last_reduction(self) -> bool:
        """Locally accumulated micro-batches wait for the delayed collective of the last one."""
        return self.state is GradState.ACCUMULATING and self.pending_install

    @property
    def has_pending_reduction(self) -> bool:
        return bool(self._pending) or self._coalesced is not None

    @property
    def reduction_holds_temporary(self) -> bool:
        """An in-flight reduction of this group holds a temporary bucket until finished."""
        return any(p.holds_temporary for p in self._pending)

    @traced("mfsdp::finish_reduce")
    def wait_for_reduction(self, coalesced: bool = True) -> None:
        """Wait for in-flight gradient collectives and fold their results into ``main_grad``.
        ``coalesced=False`` leaves a reduction queued in a reduction bucket alone (it holds no
        temporary bucket of this group; the final callback issues and waits for it)."""
        if coalesced and self._coalesced is not None:
            bucketed, self._coalesced = self._coalesced, None
            bucketed.finish()
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
        records = self.group.records
        views = [self.view(index) for index in range(len(records))]
        # No gradient here, none installed: None unless another rank's use shows in the
        # reduced values (the one host read left; see [Note: gradients known without a host
        # read] in _zeroed_grads.py), read for all such parameters at once.
        unknown = [
            (index, view) for index, view in enumerate(views)
            if view is not None and not self._received[index]
            and self._installed[index] is None
        ]
        flags = reduced_nonzero([view._local_tensor for _, view in unknown])
        for (index, _), used_elsewhere in zip(unknown, flags):
            if not used_elsewhere:
                views[index] = None
        any_installed = False
        for index, (record, view) in enumerate(zip(records, views)):
            record.dist_param.grad = view
            self._installed[index] = view
            any_installed |= view is not None
        self._received = [False] * len(self._received)
        self.pending_install = False
        self._window_issued = False
        self._any_installed = any_installed
        self._zero_marks.clear()
        if not any_installed:  # nothing to show: all zeros, start the next window afresh
            self.release_storage()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (``FSDPModule.zero_grad``)."""
        self._disarm()
        for record in self.group.records:
            if set_to_none:
                record.dist_param.grad = None
            record.compute_param.grad = None
        self._received = [False] * len(self._received)
        self.pending_install = False
        self._window_issued = False
        self._zero_marks.clear()
        self._drop_carry()
        self._free_window_grad()
        if set_to_none or self.state is GradState.EMPTY:
            self.release_storage()
            return
        self.ensure_main_grad().zero_()
        self.restart_accumulation_from_zeros()

    def note_zeroed_in_place(self, indices: Iterable[int]) -> None:
        """An optimizer's ``zero_grad(set_to_none=False)`` just zeroed the installed gradients
        of these parameters, where still installed (see [Note: gradients known without a host
        read] in ``_zeroed_grads.py``)."""
        if not self._any_installed or self._main_grad is None:
            return
        records = self.group.records
        zeroed = []
        for index in indices:
            view = self._installed[index]
            if view is not None and records[index].dist_param.grad is view:
                zeroed.append((index, view))
        if zeroed:
            self._zero_marks.mark(zeroed, self._main_grad._version)

    def sweep(self) -> None:
        """Take in what the user did to the installed gradients since they were installed."""
        if not self._any_installed:
            return
        live: list[tuple[int, DTensor]] = []
        cleared = []
        replaced = False
        for index, record in enumerate(self.group.records):
            view = self._installed[index]
            if view is None:
                continue
            grad = record.dist_param.grad
            if grad is view:
                live.append((index, view))
            elif grad is None:
                cleared.append(index)
                self._installed[index] = None
            else:  # replaced by the user: adopt its values
                with torch.no_grad():
                    view._local_tensor.copy_(grad.to_local() if isinstance(grad, DTensor) else grad)
                record.dist_param.grad = view
                live.append((index, view))
                replaced = True
        if not live:
            self.release_storage()
            return
        main_grad = self.ensure_main_grad()
        # Before this sweep writes anything: zeroed by an optimizer, known without a read.
        known_zero = not replaced and self._zero_marks.all_zero(live, main_grad._version)
        self._zero_marks.clear()
        for index in cleared:
            view = self.view(index)
            assert view is not None
            view._local_tensor.zero_()
        if (
            self.group.plan.grad_path is not GradPath.ACCUMULATE_THEN_REDUCE
            or self.state is not GradState.REDUCED
        ):
            return
        if known_zero:
            # Every other row is zeroed here, whatever it held (other ranks' regions after a
            # reduce-scatter, padding, parameters without a gradient): all of main_grad is
            # zero, as after FSDPModule.zero_grad, without writing the live views again.
            zero_outside(main_grad, [view._local_tensor for _, view in live])
            self.restart_accumulation_from_zeros()
        elif all_zeros(self.main_grad_local()):
            # Zeroed by means the library did not see: read to know (one read per group).
            # Only the rest of main_grad, the other ranks' regions after a reduce-scatter
            # (nothing for no_shard), is zeroed, instead of writing the whole buffer a second
            # time (measured: 10 ms of a 110 ms forward, 1-rank 29.5M GPT).
            self._zero_outside_local()
            self.restart_accumulation_from_zeros()

    def _zero_outside_local(self) -> None:
        lo, hi = self._local_bounds()
        main_grad = self.ensure_main_grad()
        main_grad[:lo].zero_()
        main_grad[hi:].zero_()

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
