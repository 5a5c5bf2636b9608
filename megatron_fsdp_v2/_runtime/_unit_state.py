"""The training state of one unit (``UnitState``, the base of ``FSDPState``): its groups and
options, where it is in the step, and the primitives its hooks are built from (unshard,
reshard, keeping gathered weights, preparing gradients). Decides nothing about *when* they run:
that is the hooks' part, in ``_state.py``."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from .._buffers._allocator import ScratchAllocator
from .._buffers._plan import GradPath
from .._profiling import traced
from ..api import MixedPrecisionPolicy
from ._context import FSDPContext, TrainingState
from ._flat_param_group import FlatParamGroup
from ._registered_params import RegisteredParams

if TYPE_CHECKING:
    from ._state import FSDPState

__all__ = ["UnitState", "in_backward"]


def in_backward() -> bool:
    """True inside the autograd engine (e.g. an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


class UnitState:
    """Training state of one unit, without its hooks (see ``FSDPState``). One concept in two
    files: every field of a unit is created here, and ``FSDPState`` (``_state.py``), the hooks
    that decide when the primitives below run, adds none (checked by
    ``tests/unit/test_runtime_boundaries.py``)."""

    def __init__(
        self, module: nn.Module, groups: list[FlatParamGroup], mp_policy: MixedPrecisionPolicy,
        allocator: ScratchAllocator, members: list[nn.Module] | None = None,
    ) -> None:
        self._module_ref = weakref.ref(module)
        # The modules carrying the unit's hooks: ``module`` itself, or the members of a unit
        # wrapped from a list (see [Note: several modules as one unit] in
        # _frontend/_module_lists.py), whose holder only this state keeps alive.
        self.members: list[nn.Module] = members if members is not None else [module]
        self._holder = module if members is not None else None
        self.groups = groups
        self.mp_policy = mp_policy
        self.allocator = allocator
        self.ctx: FSDPContext | None = None
        self.training_state = TrainingState.IDLE
        # set_is_last_backward's flag; see the ``is_last_backward`` property.
        self.marked_last_backward = True
        # FSDP2's set_requires_all_reduce: False keeps an HSDP unit's window open.
        self.requires_all_reduce = True
        # FSDP2's set_manual_backward_finalization, read on the root: no backward ends a
        # window, finalize_backward() does (see [Note: manual backward finalization]).
        self.manual_backward_finalization = False
        # FSDP2's set_force_sum_reduction_for_comms: kept for reading back only (every
        # reduction here is a SUM of pre-scaled gradients; see [Note: FSDP2's methods on flat
        # buffers] in _frontend/_fsdp2_surface.py).
        self.force_sum_reduction_for_comms = False
        self.pending_post_backward = 0  # forward calls whose post-backward has not run yet
        self.needs_post_backward = False
        self.backward_done = False  # post-backward ran in the current backward
        # [Note: retained graphs] A graph kept with ``retain_graph=True`` runs its backward
        # hooks again in a later backward: ``registered_calls`` (post-backward registrations of
        # the forwards that built the graph) re-arms the post-backward then. It restarts at the
        # first forward after the graph's backward.
        self.registered_calls = 0
        self._graph_backwarded = False
        self._backward_task: int | None = None
        # [Note: pipeline schedules over fully_shard units] (_frontend/_pipelining.py): a
        # zero-bubble schedule's step is running (set at its UNSHARD, cleared at the step's
        # end): the compute parameters stay registered, and the post-backward of an
        # input-gradient pass is deferred to the step's end (``deferred_post_backward``).
        self.split_backward_step = False
        self.deferred_post_backward = False
        # The autograd graph task in which this unit's backward hooks last ran: the units a
        # backward over part of the graph finishes (see [Note: backward over part of the
        # graph] in _context.py).
        self.backward_task: int | None = None
        # The root's forward pass (``FSDPContext.forward_pass``) this unit last ran in.
        self.forward_pass = -1
        self.overlap = True  # prefetch gathers and run reductions in the background
        self.enable_trace_pool = False  # see [Note: trace-planned pool]; all units agree
        # fully_shard's reduce_bucket_size_mb (see [Note: reduction buckets] in _coalesce.py).
        self.reduce_bucket_size_mb: float | None = None
        # fully_shard's refresh_bucket_size_mb (see [Note: refresh buckets]).
        self.refresh_bucket_size_mb: float | None = None
        # [Note: keeping gathered weights] ZeRO-3 units free their gathered weights after
        # forward and after backward. ``reshard_after_forward=False`` keeps them from a forward
        # (with grad) to its backward; ``reshard_after_backward=False`` keeps them from a
        # backward that is not the last of its window to the next forward. The last backward
        # always frees them: the optimizer step that follows would leave them stale. Kept
        # weights record the main weights' version counters (``_kept_version``) and are
        # dropped at the next pre-forward if those changed, so a forward never sees stale
        # weights (also after a forward that no backward followed).
        self.reshard_after_forward = True
        self.reshard_after_backward = True
        self._kept_version: int | None = None
        # Explicit prefetch targets (FSDP2's set_modules_to_{forward,backward}_prefetch);
        # None: the neighbor in the recorded forward order (see [Note: prefetch order]).
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        self.fqn = type(module).__name__
        self.owns_nested_units = False  # set by the root's lazy init
        # Which parameter objects the unit's modules hold, and checks that nobody else put
        # another one there (see _registered_params.py).
        self.registered_params = RegisteredParams(self, module)
        self._cast_dtype = mp_policy.param_dtype if mp_policy.cast_forward_inputs else None
        self._output_dtype = mp_policy.output_dtype

    @property
    def module(self) -> nn.Module:
        module = self._module_ref()
        assert module is not None
        return module

    def forget_graph(self) -> None:
        """No backward may run again over the graphs built so far (see [Note: retained graphs])."""
        self.registered_calls = 0
        self._graph_backwarded = False
        self._backward_task = None

    def reset_to_idle(self) -> None:
        """Between steps: DTensor parameters registered, no backward bookkeeping pending."""
        self.register_dist_params()
        self.training_state = TrainingState.IDLE
        self.pending_post_backward = 0
        self.needs_post_backward = False
        self.backward_done = False

    def register_dist_params(self) -> None:
        if self.split_backward_step:  # a weight pass to come differentiates the compute ones
            return
        self.registered_params.register_dist_params()

    def register_compute_params(self) -> None:
        self.registered_params.register_compute_params()
        for group in self.groups:
            group.note_views_exposed()  # see [Note: trace-planned pool]

    @property
    def is_last_backward(self) -> bool:
        """Whether the next backward ends the unit's accumulation window: marked so by
        ``set_is_last_backward`` and, for an HSDP unit (one with an outer reduction), not held
        open by ``set_requires_all_reduce(False)``; never inside a backward under the root's
        manual finalization (see [Note: manual backward finalization] in ``_finalize.py``)."""
        ctx = self.ctx
        if ctx is not None and ctx.root.manual_backward_finalization and in_backward():
            return False
        if self.requires_all_reduce or not any(g.plan.window_steps for g in self.groups):
            return self.marked_last_backward
        return False

    @is_last_backward.setter
    def is_last_backward(self, value: bool) -> None:
        self.marked_last_backward = value

    @property
    def is_root(self) -> bool:
        return self.ctx is not None and self.ctx.root is self

    @traced("mfsdp::unshard")
    def unshard(self, async_op: bool = False) -> bool:
        """Start making compute weights available; True if a collective was issued."""
        issued = False
        for group in self.groups:
            issued |= group.ready_compute_weights(async_op)
        return issued

    def wait_for_unshard(self) -> None:
        for group in self.groups:
            group.wait_for_compute_weights()

    def reshard(self, after_forward: bool = False) -> bool:
        """Free the gathered weights; ``after_forward``: a unit's own post-forward, where a
        group with ``reshard_after_forward=<int>`` keeps its slice for the smaller group
        (see [Note: resharding to a smaller group] in ``_compute_weights.py``)."""
        freed = False
        for group in self.groups:
            if group.holds_weight_work:
                freed |= (group.reshard_after_forward() if after_forward
                          else group.free_gathered_weights())
        self._kept_version = None
        return freed

    def _main_version(self) -> int:
        return sum(g.dist_param_version() for g in self.groups)

    def keep_gathered(self) -> None:
        """Keep the gathered weights past a hook that would free them (see [Note: keeping
        gathered weights])."""
        if any(g.is_gathered for g in self.groups):
            self._kept_version = self._main_version()

    @property
    def keeps_gathered_weights(self) -> bool:
        """Whether gathered weights are kept past the hook that would have freed them."""
        return self._kept_version is not None

    def drop_stale_kept_weights(self) -> None:
        """Before a forward: free kept weights if the main weights changed since they were
        kept (after a backward; or after a forward that no backward followed), and weights
        gathered (kept, or by ``unshard()``) before the main weights last changed (see [Note:
        gathered weights never older than the main weights] in ``_compute_weights.py``)."""
        for group in self.groups:
            group.drop_stale_gathered()
        if self._kept_version is None:
            return
        if self._kept_version != self._main_version() or any(
            g.needs_refresh for g in self.groups
        ):
            self.reshard()
        self._kept_version = None

    def _keeps_weights_for_backward(self) -> bool:
        """``reshard_after_forward=False`` and a backward will come for this unit."""
        return not self.reshard_after_forward and self.needs_post_backward

    def prepare_gradients(self) -> None:
        """Before this unit's parameters receive gradients: let autograd write them into the
        flat buffers (see [Note: gradients in place] in ``_grad_staging.py``, which says why a
        unit with units nested below it does so only on the accumulate path)."""
        for group in self.groups:
            accumulates = group.plan.grad_path is GradPath.ACCUMULATE_THEN_REDUCE
            if self.owns_nested_units and not accumulates:
                continue
            group.prepare_gradients()
