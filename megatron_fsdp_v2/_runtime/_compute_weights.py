"""A flat group's compute weights made ready and freed: bound as views of the unsharded
buffer, gathered (ZeRO-3) or refreshed from updated main weights through ``_gather.py`` (see
[Note: replicated-buffer refresh] there), waited on and freed. A component of
:class:`~._flat_param_group.FlatParamGroup` (``group.weights``): it owns the weights' state and
works on the group's buffers (``model_weight``, ``main_weight``), which the group builds.

[Note: gathered weights never older than the main weights]
Gathered (ZeRO-3) weights can outlive the hook that would free them: kept past a backward
(``set_reshard_after_backward(False)``, ``reshard_after_forward=False``; [Note: keeping
gathered weights] in ``_unit_state.py``) or gathered by the user's ``unshard()``. An optimizer
step or an edit of the main weights in between makes them stale, and the next forward, which
finds them gathered, would compute with the weights from before the step (FSDP2 does, after
``unshard()``). Each group counts the changes of its main weights (``main_generation``: every
``mark_main_weights_updated``, which the optimizer step hooks and the root's pre-forward check
of the parameters' version counters call) and records the count its weights were gathered at;
a unit's pre-forward frees gathered weights whose count is behind
(:meth:`ComputeWeights.drop_stale_gathered`) and gathers them again. One integer comparison per
group and forward; nothing is read from the device.

[Note: resharding to a smaller group]
``reshard_after_forward=n`` (FSDP2's int, ZeRO++'s hpZ): after forward a ZeRO-3 group keeps a
``1/n`` slice of its gathered weights instead of freeing them all, so that the backward gather
runs only among ``n`` consecutive ranks (node-local on GPUs). Layout: the unsharded buffer
(``layout.total_numel``, a multiple of the shard axis' size ``S``, and ``n`` divides ``S``) is
cut into ``n`` equal slots; the rank ``k``-th in its group of ``n`` keeps slot ``k`` in the
scratch buffer ``post_forward_model_weight`` (a copy, after which the unsharded buffer is freed:
the peak is ``T + T/n`` for the moment of the copy, as FSDP2's). Before backward (or any other
use: a recompute, a second forward) one ``all_gather_into_tensor`` over the group of ``n`` fills
the whole unsharded buffer from the slots, in place of the world gather, and frees the slice
when it completes. The slice is current for the main weights it was gathered from: a change of
the main weights (``main_generation``) frees it, and the next use gathers over the world. Per
micro-batch: the forward gather over the ``S`` ranks, the backward one over ``n``; memory
between forward and backward: ``T/n`` per unit instead of nothing (or ``T`` with ``False``).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch
import torch.distributed

from .._buffers._plan import Refresh
from .._profiling import traced
from ._gather import cast_and_gather_weights, gather_weights, refresh_weights
from ._issuer import Finishable, Pending

if TYPE_CHECKING:
    from ._flat_param_group import FlatParamGroup
    from ._param_record import ParamRecord
    from ._refresh_buckets import RefreshBucket

__all__ = ["ComputeWeights", "WeightState", "set_compute_local"]


class WeightState(enum.Enum):
    """Where a group's compute weights stand (FSDP2's ``ShardedState``, with what is in
    flight). A group that gathers (ZeRO-3): ``SHARDED`` -> ``GATHERING`` (issued) ->
    ``GATHERED`` (waited on) -> ``SHARDED`` (freed). A group whose compute weights are
    replicated: ``REPLICATED``, ``REFRESHING`` while a refresh from updated main weights is in
    flight (whether they are stale is ``needs_refresh``)."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"
    REPLICATED = "replicated"
    REFRESHING = "refreshing"


_GATHERED_STATES = frozenset({WeightState.GATHERING, WeightState.GATHERED})
_IN_FLIGHT = {WeightState.GATHERING: WeightState.GATHERED,  # -> what waiting makes it
              WeightState.REFRESHING: WeightState.REPLICATED}


def set_compute_local(record: ParamRecord, local: torch.Tensor) -> None:
    """Make ``local`` what the compute parameter computes with: its ``.data``, or for a
    tensor-parallel DTensor parameter its local tensor (the DTensor keeps its TP mesh and
    placements; see [Note: 2-D parameters] in ``_dtensor/_tp_params.py``); a plain
    spmd_types-annotated one is bound like a plain parameter."""
    if record.tp is None:
        record.compute_param.data = local
    elif record.tp.plain_compute:
        # spmd_types' type checker (a torch-function mode) would check the rebinding as an op
        # mixing the annotated parameter with an unannotated view: it is not computation
        # (FSDP2 unshards with type checking off too).
        with torch._C.DisableTorchFunction():
            record.compute_param.data = local
    else:
        record.compute_param._local_tensor = local  # type: ignore[attr-defined]


class ComputeWeights:
    """A flat group's compute weights: where they stand (:class:`WeightState`), whether they
    are older than the main weights, and the gather or refresh in flight."""

    def __init__(self, group: FlatParamGroup) -> None:
        self.group = group  # its plan, buffers, records, allocator and issuer
        self.state = (  # see WeightState
            WeightState.SHARDED if group.plan.gathers_weights else WeightState.REPLICATED
        )
        self._stale = group.extension is not None  # FP8 bytes exist after a refresh
        self._pending: Finishable | None = None  # the gather or refresh in flight
        # The refresh bucket planned for this group's next refresh, if any (see [Note: refresh
        # buckets] in _refresh_buckets.py).
        self.refresh_bucket: RefreshBucket | None = None
        self._views_bound = False
        self._bound_to: torch.Tensor | None = None  # the buffer the compute views are of
        # Bumped whenever the compute views are bound to another buffer (a trace-pool scratch
        # buffer that moved): graphs built before must not be backwarded (FSDPState._pre_backward).
        self.views_generation = 0
        # The optimizer-facing parameters' version counters when last looked at.
        self._main_version = group.dist_param_version()
        # [Note: gathered weights never older than the main weights]: the main weights' changes
        # counted, and the count the gathered weights were gathered at.
        self.main_generation = 0
        self._gathered_generation = 0
        # [Note: resharding to a smaller group]: the size of the group of n ranks (0: none),
        # this rank's place in it, and the main generation the slice kept after forward is
        # current for (None: no slice held).
        self.post_forward_size = 0
        self.post_forward_rank = 0
        self._post_forward_generation: int | None = None

    def bind(self) -> None:
        """Make the compute parameters zero-copy views of the unsharded weights, which releases
        their original storage. A group that gathers has no unsharded scratch buffer until its first
        gather (so wrapping never holds a full-size copy): until then they hold an empty
        placeholder. Parameters with all-gather extensions: see ``_subclass_gather.py``."""
        group = self.group
        if group.extension is not None:
            if group.plan.keeps_model_weight:  # no_shard: full precision, cast per forward
                group.extension.bind_full_precision(group.model_weight)
            else:  # rebuilt from the gathered inputs at the first gather or refresh
                for index, record in enumerate(group.records):
                    record.compute_param = group.extension.placeholder(index)
            return
        if not group.plan.gathers_weights:
            self._bind_compute_views(group.model_weight)
            return
        with torch.no_grad():
            for record in group.records:
                set_compute_local(record, torch.empty(0, dtype=group.dtypes.model,
                                                      device=group.device))

    def _bind_compute_views(self, unsharded_model_weight: torch.Tensor) -> None:
        # Outside inference mode: a view made inside it could never be updated in place again.
        with torch.no_grad(), torch.inference_mode(False):
            for record in self.group.records:
                item = record.item
                flat = unsharded_model_weight[item.offset : item.end]
                set_compute_local(record, flat.view(item.shape))
        self._views_bound = True
        self._bound_to = unsharded_model_weight
        self.views_generation += 1

    def note_views_exposed(self) -> None:
        """The compute parameters are about to be used (forward, recompute, backward): tensors
        autograd saves may view the gathered scratch buffer until backward, so it must get the same
        memory whenever it is gathered again in this iteration (``ScratchAllocator.pin``)."""
        group = self.group
        gathered = self.is_gathered
        if gathered and group.extension is not None:
            group.extension.pin_scratch()
        elif gathered:
            group.allocator.pin(group.temporary_key("unsharded_model_weight"))

    def drop_gathered_views(self) -> None:
        """A group that gathers, not gathered now: its compute parameters let go of the
        scratch buffer (back to the placeholder of :meth:`bind`), so a trace-pool arena that
        was replaced or released is freed; the next gather binds them again."""
        plan, extension = self.group.plan, self.group.extension
        if extension is not None:
            if plan.gathers_weights and not self.is_gathered:
                extension.forget_compute_params()
            return
        if not plan.gathers_weights or self.is_gathered or not self._views_bound:
            return
        self.bind()
        self._views_bound = False
        self._bound_to = None
        self.views_generation += 1  # a graph saved before must not be backwarded now

    @property
    def needs_refresh(self) -> bool:
        return self._stale

    def mark_main_weights_updated(self) -> None:
        """The main weights changed: rebuild compute weights before their next use (a no-op
        where compute weights are the main weights), and gather again weights gathered before
        (see [Note: gathered weights never older than the main weights])."""
        self.main_generation += 1
        self.drop_post_forward_slice()  # stale now: free its memory at once
        if self.group.plan.refresh is not Refresh.NONE:
            self._stale = True

    def drop_stale_gathered(self) -> bool:
        """Before a forward: free gathered weights gathered before the main weights last
        changed, so the forward gathers them again; returns whether it freed them."""
        if self._post_forward_generation not in (None, self.main_generation):
            self.drop_post_forward_slice()
        if self.is_gathered and self._gathered_generation != self.main_generation:
            return self.free_gathered_weights()
        return False

    def use_post_forward_process_group(self, process_group: torch.distributed.ProcessGroup) -> None:
        """Reshard to ``process_group`` (this rank's group of ``n`` consecutive ranks of the
        shard axis) after forward: see [Note: resharding to a smaller group]."""
        size = torch.distributed.get_world_size(process_group)
        numel = self.group.layout.total_numel
        assert self.group.plan.gathers_weights and numel % size == 0, (numel, size)
        self.group.issuer.axis_process_groups["post_forward"] = process_group
        self.post_forward_size = size
        self.post_forward_rank = torch.distributed.get_rank(process_group)

    def reshard_after_forward(self) -> bool:
        """After forward: free the gathered weights, keeping this rank's slot of them for the
        group of ``n`` where the unit reshards to one (see [Note: resharding to a smaller
        group]). Returns whether gathered weights were freed."""
        if not self.post_forward_size:
            return self.free_gathered_weights()
        self.wait_for_compute_weights()
        group, allocator = self.group, self.group.allocator
        key = group.temporary_key("unsharded_model_weight")
        unsharded = allocator.get(key)
        if not self.is_gathered or unsharded is None or not allocator.is_allocated(key):
            return self.free_gathered_weights()
        slot_numel = group.layout.total_numel // self.post_forward_size
        start = self.post_forward_rank * slot_numel
        with torch.no_grad(), torch.inference_mode(False):
            kept = allocator.allocate(group.temporary_key("post_forward_model_weight"),
                                      slot_numel, unsharded.dtype, unsharded.device)
            kept.copy_(unsharded[start : start + slot_numel])
        self._post_forward_generation = self._gathered_generation
        return self.free_gathered_weights()

    def stop_post_forward_resharding(self) -> None:
        """``set_reshard_after_forward(<bool>)`` replaces the int, as FSDP2's does: from now on
        weights are freed whole after forward (or kept), and a slice held now is dropped (its
        unit's next use gathers over the world)."""
        self.drop_post_forward_slice()
        self.group.issuer.axis_process_groups.pop("post_forward", None)
        self.post_forward_size = 0

    def drop_post_forward_slice(self) -> None:
        """Free the slice kept after forward (see [Note: resharding to a smaller group])."""
        if self._post_forward_generation is not None:
            self._post_forward_generation = None
            self.group.allocator.free(self.group.temporary_key("post_forward_model_weight"))

    def forget_main_weight_edits(self) -> None:
        """The optimizer-facing parameters' writes so far are not edits to refresh from (meta
        materialization wrote them: the weights are current)."""
        self._main_version = self.group.dist_param_version()

    def detect_main_weight_edits(self) -> None:
        """Mark the group stale when an in-place op on an optimizer-facing parameter (e.g.
        ``nn.init.normal_(p)``, ``p.copy_(x)``) bumped its version counter since the last look."""
        version = self.group.dist_param_version()
        if version != self._main_version:
            self._main_version = version
            self.mark_main_weights_updated()

    def ready_compute_weights(self, async_op: bool = False) -> bool:
        """Make the compute weights current: gather them (a group that gathers) or refresh them
        from updated main weights. Possibly asynchronous (:meth:`wait_for_compute_weights`).
        Returns whether a collective was issued."""
        # Nothing to do (every pre-forward and pre-backward of a ready unit asks): skip the
        # inference-mode context, a measurable per-unit cost on many small units.
        if self.is_gathered if self.group.plan.gathers_weights else not self._stale:
            return False
        # Scratch buffers and views made under inference mode could never be updated in place again.
        with torch.inference_mode(False):
            if self.group.plan.gathers_weights:
                return self._gather(async_op)
            return self._refresh(async_op)

    def _gather(self, async_op: bool) -> bool:
        group = self.group
        if self.is_gathered:
            return False
        self._gathered_generation = self.main_generation
        if group.extension is not None:
            outer = None  # HSDP outer optim: the inner shard's FP8 bytes are rebuilt first
            if self._stale and \
                    group.plan.refresh is Refresh.EXTENSION_OWN_SLOT_THEN_OUTER_GATHER:
                outer = group.extension.refresh_inner_shard(async_op)
            self._stale = False
            self._pending = group.extension.gather_scratch(async_op, after=outer)
            self._now(WeightState.GATHERING)
            return True
        if self._post_forward_generation is not None:
            if self._post_forward_generation == self.main_generation:
                return self._gather_from_post_forward_slice(async_op)
            self.drop_post_forward_slice()
        refresh: Pending | None = None
        cast_at_gather = group.plan.refresh is Refresh.CAST_AT_GATHER
        if self._stale:
            # The cast, then the plan's refresh steps (HSDP outer optim: the outer all-gather
            # that rebuilds the inner shard), which the inner gather waits for where it launches.
            # Nothing to rebuild when the gather below casts the main shard itself.
            if not cast_at_gather:
                refresh = refresh_weights(group.plan, group.main_weight, group.model_weight,
                                          group.issuer, async_op)
            self._stale = False
        output = group.allocator.allocate(
            group.temporary_key("unsharded_model_weight"), group.layout.total_numel,
            group.dtypes.model, group.device,
        )
        # Views stay valid across storage freeing; a trace-pool scratch buffer may move between
        # iterations (see [Note: trace-planned pool]), then they follow it.
        if not self._views_bound or output is not self._bound_to:
            self._bind_compute_views(output)
        if group.host_offload is not None:  # [Note: host offload] in _offload.py
            self._pending = group.host_offload.copy_in_and_gather(
                output, group.main_weight, group.plan.main_weight_span[0], group.issuer,
                async_op,
            )
        elif cast_at_gather:
            self._pending = cast_and_gather_weights(
                output, group.main_weight, group.plan.main_weight_span[0], group.issuer,
                async_op,
            )
        else:
            self._pending = gather_weights(
                output, group.model_weight, group.issuer, async_op, after=refresh,
            )
        self._now(WeightState.GATHERING)
        return True

    def _gather_from_post_forward_slice(self, async_op: bool) -> bool:
        """The gather within the group of ``n`` (see [Note: resharding to a smaller group]):
        every member's slice into the unsharded buffer; the slice is freed when it is done."""
        group = self.group
        output = group.allocator.allocate(
            group.temporary_key("unsharded_model_weight"), group.layout.total_numel,
            group.dtypes.model, group.device,
        )
        if not self._views_bound or output is not self._bound_to:
            self._bind_compute_views(output)
        key = group.temporary_key("post_forward_model_weight")
        kept = group.allocator.get(key)
        assert kept is not None
        self._post_forward_generation = None
        self._pending = gather_weights(
            output, kept, group.issuer, async_op, axis="post_forward",
            complete=lambda: group.allocator.free(key),
        )
        self._now(WeightState.GATHERING)
        return True

    def _refresh(self, async_op: bool) -> bool:
        group = self.group
        if not self._stale:
            return False
        # Stale again while a refresh is in flight (a step after ``unshard(async_op=True)``):
        # that one finishes first, its handle is never dropped unwaited.
        self.wait_for_compute_weights()
        if group.extension is not None and not group.plan.keeps_model_weight:
            self._stale = False
            self._pending = group.extension.refresh_persistent(async_op)
            self._now(WeightState.REFRESHING)
            return True
        bucket = self.refresh_bucket
        if bucket is not None:  # issuing it makes this group fresh (take_refresh)
            return bucket.coalescer.issue_through(bucket, async_op)
        self._stale = False
        self._pending = refresh_weights(
            group.plan, group.main_weight, group.model_weight, group.issuer, async_op,
        )
        if self._pending is None:
            return False
        self._now(WeightState.REFRESHING)
        return True

    def take_refresh(self, pending: Finishable) -> None:
        """This group's refresh was issued as part of a bucket; ``pending`` completes it."""
        self.wait_for_compute_weights()
        self._stale = False
        self._pending = pending
        self._now(WeightState.REFRESHING)

    def _now(self, state: WeightState) -> None:
        """A gather or refresh was issued: its handle is ``_pending``."""
        # Issued from rest only: nothing in flight is ever overwritten unwaited.
        assert self.state is (
            WeightState.SHARDED if state is WeightState.GATHERING else WeightState.REPLICATED
        ), (self.state, state)
        self.state = state

    def wait_for_compute_weights(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            # Settled before finishing: a wait that raises leaves them gathered (freed by the
            # recovery) rather than in flight forever.
            self.state = _IN_FLIGHT.get(self.state, self.state)
            pending.finish()

    @traced("mfsdp::free")
    def free_gathered_weights(self) -> bool:
        """Free the gathered weights of a group that gathers; returns whether it did. Waits for
        an in-flight gather or refresh first (one launched for a unit that control flow then
        skipped must finish before its buffer is reused or overwritten)."""
        self.wait_for_compute_weights()
        if not self.is_gathered:
            return False
        if self.group.extension is not None:
            self.group.extension.free_scratch()
        else:
            self.group.allocator.free(self.group.temporary_key("unsharded_model_weight"))
        self.state = WeightState.SHARDED
        return True

    @property
    def is_gathered(self) -> bool:
        """A group that gathers holds its gathered weights (or their gather is in flight)."""
        return self.state in _GATHERED_STATES

    @property
    def holds_weight_work(self) -> bool:
        """Gathered weights or an in-flight gather or refresh: what
        :meth:`free_gathered_weights` acts on (a cheap check for the many hooks that ask)."""
        return self.state is not WeightState.SHARDED \
            and self.state is not WeightState.REPLICATED
