"""What a root unit shares with every unit of its tree (``FSDPContext``): the recorded forward
order, in-flight reductions, the final callback of backward, and recovery after a forward or
backward that raised. See [Note: hook schedule] in ``_state.py``."""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from contextlib import ExitStack
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .._buffers._allocator import ScratchAllocator
from .._buffers._trace_pool import TracePoolAllocator
from .._comm._collective_impl import GroupCollectives
from .._comm._deadline import WaitBound, collective_timeout_s, group_error
from .._profiling import traced
from ._coalesce import ReductionCoalescer
from ._flat_param_group import FlatParamGroup
from ._issuer import Deferred
from ._refresh_buckets import RefreshCoalescer

if TYPE_CHECKING:
    from ._state import FSDPState

__all__ = ["FSDPContext", "TrainingState"]


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"


class FSDPContext:
    """What the root shares with every unit of its tree."""

    def __init__(self, root: FSDPState, states: list[FSDPState]) -> None:
        self.root = root
        self.states = states  # pre-order of the module tree: root first
        # One allocator for the tree (its units agree on enable_trace_pool: FSDPState._lazy_init).
        self.allocator: ScratchAllocator = (
            TracePoolAllocator() if root.enable_trace_pool else ScratchAllocator()
        )
        self.final_callback_queued = False
        self.callback_failed = False  # the final callback raised: see recover()
        # [Note: manual backward finalization] (_finalize.py): a backward ran under manual
        # finalization and finalize_backward() has not ended its windows yet; the handle of an
        # asynchronous finalization not waited on yet.
        self.awaits_finalization = False
        self.finalization: Deferred | None = None
        # The submodule-registration count at the last walk of the module trees (-1: none
        # yet; see [Note: module tree changes after wrapping] in _module_tree.py).
        self.checked_tree_generation = -1
        self.unrecoverable: str | None = None  # why recover() failed; raised again on use
        self.overlap = root.overlap
        # [Note: prefetch order] Units in the order their forward ran in the first forward
        # pass (not registration order). Forward prefetches the next unit's gather, backward
        # the previous one's; a unit that is skipped or runs out of order just waits for (or
        # issues) its own gather, and stray prefetches are resharded at the root's post-forward
        # and the final callback.
        self.forward_order: list[FSDPState] = []
        self._order_index: dict[int, int] = {}
        self.recording_order = True
        # Counts the root's forward passes; a unit records the pass it last ran in
        # (``UnitState.forward_pass``), so that a unit called again in the same pass (a shared
        # block) does not prefetch a neighbor that already ran (FSDPState._prefetch_targets).
        self.forward_pass = 0
        # [Note: backward over part of the graph] ``root_graph_pending``: a forward of the
        # root with grad ran and no backward has reached its graph since. ``root_graph_reached``:
        # a hook of a call made inside the root's forward ran in the current backward.
        # A backward that runs while the root's graph is pending and never reaches it (the
        # per-chunk backward of torchtitan's chunked loss, over a head called outside the
        # root's forward) finishes only the units whose hooks ran in it (``UnitState.
        # backward_task``); the others keep their post-backward and gathered weights for the
        # backward that will reach the root's graph, as FSDP2, which queues no final callback
        # for such calls. Finishing every unit there would free the weights they keep for that
        # backward (``reshard_after_forward=False``) and the gathers their neighbors prefetched,
        # and the later backward would gather them all again.
        self.root_graph_pending = False
        self.root_graph_reached = False
        # Groups whose window a backward over part of the graph ended without marking their
        # main weights updated: marked by the next backward that reaches the root's graph, or
        # the root's next pre-forward (``mark_owed_updates``). Marking them at once would
        # refresh a ZeRO-1/2 group in the backward that follows, before any step changed it
        # (torchtitan's head, whose window its last chunk's backward ends).
        self.owed_updates: list[FlatParamGroup] = []
        # Units whose gradient collectives hold memory (scratch buffers, a reduce-scatter's
        # copy in the transport) and may still be in flight, oldest first: at most
        # ``max_inflight_reductions`` units' are alive at once. All-reduces in place into
        # persistent buffers are not listed: they cost no memory in flight and run on until the
        # final callback ([Note: in-place reductions in flight] in ``_state.py``), unless the
        # window ends and HSDP's outer reduction waits for them (see [Note: outer reductions
        # in backward]).
        self.reducing: deque[FSDPState] = deque()
        self.max_inflight_reductions = 1
        # Debug/test event log of (event, unit fqn); None disables logging.
        self.events: list[tuple[str, str]] | None = None
        # The tree's reduction buckets (the root's reduce_bucket_size_mb; see [Note: reduction
        # buckets] in _coalesce.py), None: one delayed collective per group.
        self.coalescer: ReductionCoalescer | None = None
        if root.reduce_bucket_size_mb is not None:
            self.coalescer = ReductionCoalescer(root.reduce_bucket_size_mb, self.allocator)
        # The tree's refresh buckets (the root's refresh_bucket_size_mb; see [Note: refresh
        # buckets] in _refresh_buckets.py), None: one refresh all-gather per group.
        self.refresh_coalescer: RefreshCoalescer | None = None
        if root.refresh_bucket_size_mb is not None:
            self.refresh_coalescer = RefreshCoalescer(
                root.refresh_bucket_size_mb, self.allocator, root.overlap
            )

    def log(self, event: str, state: FSDPState) -> None:
        if self.events is not None:
            self.events.append((event, state.fqn))

    def record_forward(self, state: FSDPState) -> None:
        if self.recording_order and id(state) not in self._order_index:
            self._order_index[id(state)] = len(self.forward_order)
            self.forward_order.append(state)

    def neighbor(self, state: FSDPState, step: int) -> FSDPState | None:
        """The unit ``step`` positions after ``state`` in the recorded forward order."""
        index = self._order_index.get(id(state))
        if index is None or self.recording_order:
            return None
        index += step
        return self.forward_order[index] if 0 <= index < len(self.forward_order) else None

    def drain_reductions(self, keep: int) -> None:
        """Finish the oldest in-flight reductions until at most ``keep`` units have some, and
        launch the outer reduction of each finished unit whose window ends.

        [Note: outer reductions in backward]
        On a 2-D mesh a window ends with the plan's window steps (HSDP's outer all-reduce or
        reduce-scatter of each group's inner-reduced shard, design.md §9). Each is launched
        as soon as its unit's last inner reduction has finished, here, when the next unit's
        post-backward drains it: it then overlaps the rest of backward, as FSDP2 issues its
        HSDP all-reduce right after each reduce-scatter, instead of all of them waiting for
        the final callback. For that, a unit whose window ends is listed in ``reducing`` even
        when its inner reduction holds no scratch buffer (FSDPState.run_post_backward). The
        drain order is backward order, the same on every rank, so every rank launches the
        outer collectives in the same order. An outer reduction that holds a scratch buffer
        (a workspace in the communication dtype, or outer optim's ``window_grad``, which it
        frees) is listed again and finished by the next drain, so at most one unit's are alive
        besides the reduction in flight (the estimator replays this:
        ``estimator/_replay._Replay``); an all-reduce in place runs on until the final callback,
        which waits for all of them and installs.
        Same collectives, same buffers, same arithmetic: only the launch moves earlier."""
        finished: list[FSDPState] = []
        while len(self.reducing) > keep:
            state = self.reducing.popleft()
            for group in state.groups:
                group.finish_reductions(coalesced=False)
            finished.append(state)
        for state in finished:
            if not state.is_last_backward:
                continue
            for group in state.groups:
                group.launch_window_steps(async_op=True)
            if any(g.reduction_holds_temporary for g in state.groups):
                self.reducing.append(state)

    @property
    def groups(self) -> Iterable[FlatParamGroup]:
        for state in self.states:
            yield from state.groups

    @property
    def bucket_accounts(self) -> list[GroupCollectives]:
        """What the tree's reduction and refresh buckets issued (their own issuer accounts)."""
        return [account for buckets in (self.coalescer, self.refresh_coalescer)
                if buckets is not None for account in buckets.issuers.accounts]

    @traced("mfsdp::final_callback")
    def final_callback(self) -> None:
        """End of backward: reduce what no post-backward hook reduced, then finish reductions.
        Every unit, or only those whose hooks ran in this backward when it did not reach the
        root's pending graph (see [Note: backward over part of the graph])."""
        states = self.states
        full = self.root_graph_reached or not self.root_graph_pending
        if full:
            self.root_graph_pending = False
        else:
            task = torch._C._current_graph_task_id()
            states = [state for state in self.states if state.backward_task == task]
        self.root_graph_reached = False
        try:
            for state in reversed(states):
                # Also units that accumulated earlier micro-batches of the window but did not
                # run in this one: the last backward must still reduce what they hold.
                if state.needs_post_backward or (
                    state.is_last_backward
                    and any(g.awaits_last_reduction for g in state.groups)
                ):
                    state.run_post_backward()
            if self.coalescer is not None:
                self.coalescer.flush()  # the last, partly filled reduction bucket
            # Finish what is listed, oldest first, launching outer reductions as windows end
            # (see [Note: outer reductions in backward]); those listed again are waited below.
            self.drain_reductions(0)
            self.reducing.clear()
            for state in states:
                # Weights kept for the next forward stay (see [Note: keeping gathered weights]).
                keep = state.keeps_gathered_weights
                for group in state.groups:
                    if keep:
                        group.wait_for_compute_weights()
                    else:
                        group.free_gathered_weights()
                    group.finish_reductions()
            # The end of the window (GroupGrads.end_window): collectives over the reduced
            # shards (the plan's window steps, HSDP's outer all-reduce; nothing on a 1-D mesh)
            # that drain_reductions did not launch already (overlap=False, a group that reduced
            # earlier in the window but not in this backward), launched for every group first,
            # in the same order on every rank, then waited on and installed.
            ended = [group for state in states if state.is_last_backward for group in state.groups]
            windows = [group.end_window(async_op=self.overlap, marks_updated=full)
                       for group in ended]
            for window in windows:
                window.finish()
            if full:
                self.mark_owed_updates()
            else:
                self.owed_updates += ended
            if self.root.manual_backward_finalization:
                self.awaits_finalization = True  # finalize_backward() ends the windows
        except BaseException:
            self.callback_failed = True  # reductions may be half-waited: recover() next forward
            raise
        finally:
            self.final_callback_queued = False
            for state in states:
                state.reset_to_idle()

    def mark_owed_updates(self) -> None:
        """Mark the main weights updated where a backward over part of the graph ended a window
        without marking them (see ``owed_updates``)."""
        for group in self.owed_updates:
            group.mark_main_weights_updated()
        self.owed_updates.clear()

    @property
    def step_failed(self) -> bool:
        """Whether the last forward or backward raised before finishing (checked at the root's
        next pre-forward): a unit still in forward (its post-forward never ran), a backward whose
        final callback never ran, or a final callback that raised."""
        return (
            self.final_callback_queued or self.callback_failed or self.unrecoverable is not None
            or any(s.training_state is not TrainingState.IDLE for s in self.states)
        )

    def _process_groups(self) -> list[tuple[dist.ProcessGroup, torch.device]]:
        """Every process group the tree's collectives run on, with its device."""
        seen: dict[int, tuple[dist.ProcessGroup, torch.device]] = {}
        for group in self.groups:
            for process_group in group.axis_process_groups.values():
                seen.setdefault(id(process_group), (process_group, group.device))
        return list(seen.values())

    def recover(self) -> None:
        """Return every unit to the state a new step starts from, after a forward or backward
        that raised (an exception or ``KeyboardInterrupt`` in user code or a hook). Requires that
        every rank failed at the same point, so that in-flight collectives match.

        * In-flight gathers and reductions are waited for (they are matched across ranks and
          write into buffers about to be reused) and their results dropped; gathered ZeRO-3
          weights are freed, so the next forward gathers afresh instead of reusing buffers that
          may be half-gathered or stale (e.g. after an optimizer step in between).
        * Hook state is reset: training states, pending post-backward counts, the queued final
          callback, in-flight reduction bookkeeping; DTensor parameters are registered again.
        * After a failed *backward*, every gradient not yet consumed by an optimizer step is
          discarded, as ``zero_grad(set_to_none=True)`` would: the compute parameters' ``.grad``
          of the failed backward, the main gradients (including micro-batches accumulated earlier
          in the window, whose sums cannot be separated from the failed one's) and installed
          ``.grad`` s. A failed *forward* wrote no gradient and leaves gradients untouched.

        Raises ``RuntimeError`` if waiting for an in-flight collective fails (e.g. the ranks
        failed at different points and their collectives no longer match): the process group
        is then unusable and the job must restart; every later forward raises it again. On
        gloo the wait raises after the group's timeout; on CUDA, where waits are event waits
        that never fail, each is polled until it completes, a group reports an error, or the
        largest collective timeout of the tree has passed since recovery began (see [Note:
        recovery deadline] in ``_deadline.py``), and the groups are asked for an error once
        all waits completed.

        Runs at once when an exception leaves the root's forward (an ``always_call`` forward
        hook), else lazily: at the root's next pre-forward, or before ``state_dict()`` /
        ``load_state_dict()`` of any unit (a ``KeyboardInterrupt``, or a failed backward).
        """
        if self.unrecoverable is not None:
            raise RuntimeError(self.unrecoverable)
        if self.coalescer is not None:
            self.coalescer.abandon()  # never issue a bucket the failed backward left open
        # An asynchronous finalize_backward() not waited on is dropped, its gradients with it
        # (FSDP2's reset; its handle's wait() raises): nothing may finish it any more.
        dropped_finalization = self.finalization is not None
        self.finalization = None
        for group in self.groups:
            group.finalization = None
        discard_grads = dropped_finalization or self.final_callback_queued or (
            self.callback_failed
        ) or any(s.training_state is TrainingState.PRE_BACKWARD for s in self.states)
        error: BaseException | None = None
        groups = self._process_groups()
        seconds = max((collective_timeout_s(g, d) for g, d in groups), default=0.0)
        bound = WaitBound.starting_now(seconds, lambda: group_error(groups))
        with ExitStack() as bounded:
            for streams in {group.issuer.streams for group in self.groups}:  # one per device
                bounded.enter_context(streams.bounded_waits(bound))
            if self.refresh_coalescer is not None:
                try:  # refresh buckets in flight are matched across ranks: wait, then drop
                    self.refresh_coalescer.settle()
                except Exception as e:  # noqa: BLE001 - reported below, after the reset
                    error = e
            for state in self.states:
                for group in state.groups:
                    if error is None:
                        try:
                            group.wait_for_compute_weights()
                            group.finish_reductions()
                        except Exception as e:  # noqa: BLE001 - reported below
                            error = e
                    if error is not None:
                        # The group is broken: free no buffer a collective may still write
                        # into (and wait for no further one: each could take the timeout).
                        continue
                    group.free_gathered_weights()
                    group.discard_gradients(unconsumed=discard_grads)
        if error is None and any(d.type == "cuda" for _, d in groups):
            # Event waits complete when NCCL's watchdog aborted the communicator too.
            failed = group_error(groups)
            if failed is not None:
                error = RuntimeError(failed)
        self.reducing.clear()
        self.final_callback_queued = False
        self.callback_failed = False
        self.root_graph_pending = self.root_graph_reached = False
        self.awaits_finalization = False
        self.mark_owed_updates()
        for state in self.states:
            state.reset_to_idle()
            state.forget_graph()
        if error is not None:
            self.unrecoverable = (
                "fully_shard cannot recover from the failed forward/backward: a collective it "
                f"left in flight did not complete ({type(error).__name__}: {error}). The ranks "
                "most likely failed at different points, so their collectives no longer match "
                "and the process group is unusable; restart the job (e.g. from the last "
                "checkpoint)"
            )
            raise RuntimeError(self.unrecoverable) from error
