"""Per-unit hook owner (``FSDPState``): decides *when* flat groups unshard, reshard and
reduce; never touches buffer contents itself. Its training state and the primitives the hooks
call are ``UnitState`` (``_unit_state.py``); the root's first forward runs ``lazy_init``
(``_lazy_init.py``), and the state the root shares with the whole tree is ``FSDPContext``
(``_context.py``).

[Note: hook schedule]
For a unit ``U`` (a module passed to ``fully_shard``):

* forward pre-hook: on the root, lazy init and the gradient sweep; then ``U`` unshards its groups
  (ZeRO-3 gather, or the ZeRO-1/2 refresh when stale), registers its compute parameters on the
  module, and routes its tensor inputs through ``_RegisterPostBackward`` so that ``U``'s
  post-backward runs once the gradients of its inputs (hence of its parameters) are computed.
* forward post-hook: registers the DTensor parameters again, reshards ZeRO-3 groups, and hooks
  the outputs so the first gradient flowing into them runs ``U``'s pre-backward.
* pre-backward: queues the root's final callback (once per backward) and re-gathers ZeRO-3 weights.
  A backward that never reaches the graph of the root's forward (a head called outside it, as
  torchtitan's chunked loss does, with a backward per chunk) leaves the other units as they are
  (see [Note: backward over part of the graph] in ``_context.py``).
* post-backward: when every forward call of ``U`` in this pass has finished its backward,
  reshard ZeRO-3 groups, finish the previous unit's reductions (launching its HSDP outer
  reduction when its window ends: [Note: outer reductions in backward] in ``_context.py``) and
  reduce gradients (``GroupGrads.reduce``).
* final callback (end of backward, queued on the autograd engine): runs the post-backward of
  units whose inputs did not require grad (typically the root, fed token ids), waits for every
  in-flight reduction and, on the last micro-batch, installs the optimizer-facing gradients.

Forward hooks that run *during* backward are activation-checkpoint recomputes: they unshard and
register compute parameters but neither reshard nor register backward hooks again, so the
weights gathered for the recompute serve the backward that follows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .._buffers._allocator import ScratchAllocator
from .._profiling import traced
from ..api import MixedPrecisionPolicy
from ._compile import eager_hook
from ._context import TrainingState
from ._flat_param_group import FlatParamGroup
from ._lazy_init import lazy_init
from ._module_tree import module_tree_generation
from ._unit_state import UnitState, in_backward

__all__ = ["FSDPState"]


class _RegisterPostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward is the unit's post-backward hook.
    ``in_root_graph``: the call ran inside the root's forward (see [Note: backward over part of
    the graph] in ``_context.py``)."""

    @staticmethod
    def forward(
        ctx: Any, state: FSDPState, in_root_graph: bool, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        ctx.in_root_graph = in_root_graph
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state.post_backward(ctx.in_root_graph)
        return (None, None, *grads)


class FSDPState(UnitState):
    """Hooks of one unit (see [Note: hook schedule]) over its training state (``UnitState``)."""

    def __init__(
        self, module: nn.Module, groups: list[FlatParamGroup], mp_policy: MixedPrecisionPolicy,
        allocator: ScratchAllocator, members: list[nn.Module] | None = None,
    ) -> None:
        super().__init__(module, groups, mp_policy, allocator, members)
        # On the module, or on each member of a unit wrapped from a list (see [Note: several
        # modules as one unit] in _frontend/_module_lists.py).
        for target in self.members:
            # Never traced by torch.compile: see [Note: hooks outside compiled regions].
            target.register_forward_pre_hook(
                eager_hook(self._pre_forward), prepend=True, with_kwargs=True
            )
            target.register_forward_hook(eager_hook(self._post_forward))
            # See FSDPContext.recover: recover at once when the root's forward raises, and
            # before a state dict is read or written after a failure the forward hook could
            # not see.
            target.register_forward_hook(eager_hook(self._forward_raised), always_call=True)
            target.register_state_dict_pre_hook(self._recover_if_failed)
            target.register_load_state_dict_pre_hook(self._recover_if_failed)

    def _forward_raised(self, module: nn.Module, args: Any, output: Any) -> None:
        """``always_call`` forward hook; after a successful forward nothing is left to do. Never
        raises (torch would only warn): an unrecoverable state is raised by the next forward,
        after the forward's own error has propagated."""
        ctx = self.ctx
        if (
            ctx is not None and ctx.root is self and not in_backward()
            and ctx.unrecoverable is None and ctx.step_failed
        ):
            try:
                ctx.recover()
            except RuntimeError:
                pass

    def _recover_if_failed(self, *args: Any) -> None:
        """State-dict pre-hooks. Never raises: even when the collectives cannot recover, the
        hook state is reset (DTensor parameters registered), so a checkpoint can still be
        written from the main weights; the next forward raises the error."""
        ctx = self.ctx
        if ctx is not None and ctx.unrecoverable is None and ctx.step_failed:
            try:
                ctx.recover()
            except RuntimeError:
                pass

    # ------------------------------------------------------------------ forward

    def _prefetch_targets(self, step: int) -> list[FSDPState]:
        """Units to prefetch: the explicit list, else the neighbor in the forward order. In the
        root's forward, not a neighbor that already ran in it: the order was recorded at the
        first call of each unit, and after a later call of a unit called twice (a shared block)
        the next unit in it has run already; gathering it again would be wasted."""
        ctx = self.ctx
        assert ctx is not None
        explicit = self.forward_prefetch if step > 0 else self.backward_prefetch
        if explicit is None:
            neighbor = ctx.neighbor(self, step)
            if neighbor is None or (
                step > 0 and neighbor.forward_pass == ctx.forward_pass
                and ctx.root.training_state is TrainingState.FORWARD
            ):
                return []
            return [neighbor]
        for target in explicit:
            if target.ctx is not ctx:
                raise ValueError(
                    f"set_modules_to_{'forward' if step > 0 else 'backward'}_prefetch of unit "
                    f"'{self.fqn}': a module in the list is not a unit of the same fully_shard "
                    "tree (wrapped below the same root); list only units of this model"
                )
        return explicit

    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if in_backward():  # activation-checkpoint recompute
            self.unshard()
            self.wait_for_unshard()
            self.register_compute_params()
            if torch.is_grad_enabled():  # the recompute's backward writes gradients
                self.prepare_gradients()
            if torch.is_grad_enabled() and not self.needs_post_backward:
                # Reentrant checkpointing: the original forward ran under no_grad and hooked
                # nothing; this recompute's graph is what the nested backward runs, so hook it
                # for the post-backward (reshard, reduce) now.
                self.needs_post_backward = True
                return self._register_post_backward(args, kwargs, in_root_graph=True)
            return None
        if self.ctx is None:
            lazy_init(self)
        assert self.ctx is not None
        ctx = self.ctx
        if self.is_root:
            # Before anything changes. The module trees are walked only when a submodule was
            # registered since the last walk (see [Note: module tree changes after wrapping]).
            tree_generation = module_tree_generation()
            for state in ctx.states:
                state.registered_params.check()
                if tree_generation != ctx.checked_tree_generation:
                    state.registered_params.check_tree()
            ctx.checked_tree_generation = tree_generation
            self._root_pre_forward()
        elif ctx.root.training_state is not TrainingState.FORWARD:
            self.registered_params.check()  # called directly, not from the root's forward
            if module_tree_generation() != ctx.checked_tree_generation:
                self.registered_params.check_tree()
        for group in self.groups:
            group.sync_requires_grad()
        if self._graph_backwarded:
            self.forget_graph()
        in_root_graph = self._in_root_forward()
        if in_root_graph:
            self.forward_pass = ctx.forward_pass
        ctx.record_forward(self)
        self.training_state = TrainingState.FORWARD
        self.drop_stale_kept_weights()
        if self.unshard():
            ctx.log("unshard", self)
        self.wait_for_unshard()
        if ctx.refresh_coalescer is not None:  # the next refresh buckets, once some completed
            ctx.refresh_coalescer.prefetch()
        if ctx.overlap:
            for following in self._prefetch_targets(+1):
                following.drop_stale_kept_weights()
                if following.unshard(async_op=True):
                    ctx.log("prefetch", following)
        self.register_compute_params()
        if self._cast_dtype is not None:
            dtype = self._cast_dtype
            args, kwargs = tree_map(
                lambda t: (
                    t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                ),
                (args, kwargs),
            )
        if torch.is_grad_enabled():
            self.needs_post_backward = True
            args, kwargs = self._register_post_backward(args, kwargs, in_root_graph)
        return args, kwargs

    def _in_root_forward(self) -> bool:
        """Whether this call runs inside the root's forward (else it is called directly, e.g. a
        head called by the loss: see [Note: backward over part of the graph] in
        ``_context.py``)."""
        assert self.ctx is not None
        return self.is_root or self.ctx.root.training_state is TrainingState.FORWARD

    def _root_pre_forward(self) -> None:
        assert self.ctx is not None
        if self.ctx.step_failed:
            # The last forward or backward raised before finishing (see FSDPContext.recover).
            self.ctx.recover()
        if self.ctx.finalization is not None:
            # finalize_backward(async_op=True)'s handle not waited on yet: FSDP2 asks the
            # caller to wait before more work on the module; waiting here keeps it correct.
            self.ctx.finalization.finish()  # clears ctx.finalization
        self.ctx.forward_pass += 1
        self.ctx.mark_owed_updates()  # before the refreshes below are planned
        if self.ctx.allocator.begin_iteration():  # see [Note: trace-planned pool]
            for group in self.ctx.groups:
                group.drop_gathered_views()  # of the replaced arena, so it can be freed
        for group in self.ctx.groups:
            group.sweep_gradients()
            group.detect_main_weight_edits()
        order = self.ctx.forward_order or self.ctx.states
        buckets = self.ctx.refresh_coalescer
        if buckets is not None:  # see [Note: refresh buckets]
            buckets.plan([g for state in order for g in state.groups if g.needs_refresh])
        if self.ctx.overlap:
            # [Note: replicated-buffer refresh] is in place, so refreshing every unit at once
            # costs no memory: launch all refresh all-gathers now, in forward order, and let
            # each unit wait for its own in its pre-forward, overlapping the earlier units'
            # compute. Refresh buckets: the first two, then one more as each completes.
            for state in order:
                issued = False
                for group in state.groups:
                    if (
                        group.needs_refresh and not group.plan.gathers_weights
                        and (buckets is None or buckets.issues_now(group))
                    ):
                        issued |= group.ready_compute_weights(async_op=True)
                if issued:
                    self.ctx.log("refresh", state)

    def _register_post_backward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], in_root_graph: bool
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not kwargs and all(isinstance(t, torch.Tensor) for t in args):
            # The common call (tensors only): the same as below without the pytree round trip.
            positions = [i for i, t in enumerate(args) if t.requires_grad]
            if not positions:
                return args, kwargs
            outputs = _RegisterPostBackward.apply(
                self, in_root_graph, *(args[i] for i in positions)
            )
            new_args = list(args)
            for i, out in zip(positions, outputs):
                new_args[i] = out
            self.pending_post_backward += 1
            self.registered_calls += 1
            return tuple(new_args), kwargs
        flat, spec = tree_flatten((args, kwargs))
        positions = [
            i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if not positions:
            return args, kwargs
        outputs = _RegisterPostBackward.apply(self, in_root_graph, *(flat[i] for i in positions))
        for i, out in zip(positions, outputs):
            flat[i] = out
        self.pending_post_backward += 1
        self.registered_calls += 1
        return tree_unflatten(flat, spec)

    def _cast_output(self, output: Any) -> Any:
        dtype = self._output_dtype
        if dtype is None:
            return output
        return tree_map(
            lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
            output,
        )

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        # reshard_after_forward=False with a backward to come: the gathered parameters stay
        # registered until the post-backward, as FSDP2 leaves its unsharded ones
        # (module.weight is the full tensor between forward and backward).
        if in_backward() or not (torch.is_grad_enabled() and self._keeps_weights_for_backward()):
            self.register_dist_params()
        output = self._cast_output(output)
        if in_backward():
            return output
        ctx = self.ctx
        assert ctx is not None
        in_root_graph = self._in_root_forward()
        if torch.is_grad_enabled() and (
            self._keeps_weights_for_backward()
            # [Note: calls after the root's forward] A unit called outside the root's forward
            # while its graph awaits backward is part of the loss (torchtitan's chunked loss
            # calls the head once per sequence chunk): keep its weights from the first such
            # call to its backward instead of gathering them again for every call, as FSDP2
            # does for a grouped unit whose call ran only some of its modules.
            or (not in_root_graph and ctx.root_graph_pending and self.needs_post_backward)
        ):
            self.keep_gathered()  # for the backward (and the next such call)
        elif self.reshard(after_forward=True):
            ctx.log("reshard", self)
        self.training_state = TrainingState.IDLE
        if self.is_root:
            ctx.recording_order = False
            if torch.is_grad_enabled():
                ctx.root_graph_pending = True
            if ctx.refresh_coalescer is not None:  # no refresh bucket outlives the forward
                ctx.refresh_coalescer.settle()
            for state in ctx.states:  # prefetched but never run (skipped by control flow)
                if not state._keeps_weights_for_backward() and state.reshard():
                    ctx.log("reshard", state)
        if torch.is_grad_enabled():
            hook = self._pre_backward_in_root_graph if in_root_graph else self._pre_backward
            if ctx.allocator.moves_scratch:  # see [Note: trace-planned pool]
                hook = functools.partial(self._checked_pre_backward, self._views_stamp(), hook)
            if isinstance(output, torch.Tensor):  # the common case, without the pytree walk
                if output.requires_grad:
                    # One tensor: a plain tensor hook fires exactly when the multi-grad hook
                    # ("any") would, for a fraction of its setup cost.
                    output.register_hook(hook)
                return output
            tensors = [
                t for t in tree_flatten(output)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")
        return output

    # ------------------------------------------------------------------ backward

    def _views_stamp(self) -> tuple[int, ...]:
        return tuple(group.views_generation for group in self.groups)

    def _checked_pre_backward(
        self, stamp: tuple[int, ...], hook: Callable[[torch.Tensor], None], grad: torch.Tensor
    ) -> None:
        """``hook`` (a pre-backward) of a graph built when the compute views had ``stamp``: raise,
        before anything changes, if they moved since (a trace-pool replan between this graph's
        forward and a backward over it, kept with ``retain_graph=True``): tensors autograd saved
        would read memory that moved."""
        if stamp != self._views_stamp():
            raise RuntimeError(
                f"backward over a graph of unit '{self.fqn}' built before the trace pool "
                "(enable_trace_pool=True) moved its gathered weights (at the forward of a later "
                "iteration, or after release_memory_pool()): tensors autograd saved would read "
                "memory that moved. Run every backward over a retained graph before the next "
                "forward, or use enable_trace_pool=False"
            )
        hook(grad)

    def _pre_backward_in_root_graph(self, grad: torch.Tensor) -> None:
        """Pre-backward of a call made inside the root's forward: this backward reaches the
        root's graph (see [Note: backward over part of the graph] in ``_context.py``)."""
        assert self.ctx is not None
        self.ctx.root_graph_reached = True
        self._pre_backward(grad)

    def _pre_backward(self, grad: torch.Tensor) -> None:
        ctx = self.ctx
        assert ctx is not None
        task = torch._C._current_graph_task_id()
        self.backward_task = task
        if task != self._backward_task:
            self._backward_task = task
            if self._graph_backwarded:  # another backward over a retained graph
                self.needs_post_backward = True
                self.pending_post_backward = self.registered_calls
                self.backward_done = False
        if not ctx.final_callback_queued:
            ctx.final_callback_queued = True
            Variable._execution_engine.queue_callback(ctx.final_callback)
        self.training_state = TrainingState.PRE_BACKWARD
        if self.unshard():
            ctx.log("unshard", self)
        self.wait_for_unshard()
        if ctx.overlap:
            for preceding in self._prefetch_targets(-1):
                if not preceding.backward_done and preceding.unshard(async_op=True):
                    ctx.log("prefetch", preceding)
        # An activation-checkpoint recompute inside this module's forward (which bypasses the
        # forward hooks) must see compute parameters, not DTensors.
        self.register_compute_params()
        self.prepare_gradients()

    def post_backward(self, in_root_graph: bool) -> None:
        """Called by ``_RegisterPostBackward``: runs once every forward call has its gradients.
        ``in_root_graph``: the call ran inside the root's forward."""
        assert self.ctx is not None
        self.backward_task = torch._C._current_graph_task_id()
        if in_root_graph:
            self.ctx.root_graph_reached = True
        self.pending_post_backward -= 1
        if self.pending_post_backward <= 0 and self.needs_post_backward:
            self.run_post_backward()

    def _backward_writes_gradients(self) -> bool:
        """Whether the running backward accumulates into this unit's compute parameters (not
        a zero-bubble input-gradient pass, ``autograd.grad`` with respect to the stage inputs,
        whose weight gradients a later weight pass computes). Any parameter: one unused in
        this graph is not executed in a full backward either."""
        trained = [r.compute_param for g in self.groups for r in g.records
                   if r.compute_param.requires_grad]
        return not trained or any(
            torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(p).node)
            for p in trained
        )

    def _defer_post_backward(self) -> None:
        """The post-backward of an input-gradient pass (see [Note: pipeline schedules over
        fully_shard units]): the weight pass writes the gradients later, so nothing is reduced
        or freed now; the compute parameters stay registered (``split_backward_step``) and the
        gathered weights kept; the step's end reduces."""
        self.needs_post_backward = False
        self.pending_post_backward = 0
        self._graph_backwarded = True
        self.deferred_post_backward = True
        self.keep_gathered()
        self.backward_done = True
        self.training_state = TrainingState.IDLE

    @traced("mfsdp::post_backward")
    def run_post_backward(self) -> None:
        if self.split_backward_step and in_backward() and not self._backward_writes_gradients():
            self._defer_post_backward()
            return
        self.deferred_post_backward = False  # reduced with this backward's gradients
        self.needs_post_backward = False
        self.pending_post_backward = 0
        self._graph_backwarded = True
        self.register_dist_params()
        ctx = self.ctx
        assert ctx is not None
        # A backward with create_graph=True (grad mode on inside it: a gradient penalty's
        # autograd.grad) built a graph that saved the gathered weights; a later backward through
        # it reads them, so they stay gathered until the next backward without it, or the next
        # forward (which gathers again if a step changed the main weights).
        if (self.reshard_after_backward or self.is_last_backward) and not torch.is_grad_enabled():
            if self.reshard():
                ctx.log("reshard", self)
        else:
            self.keep_gathered()
        # Finish older reductions *before* staging new ones: they overlapped this unit's
        # backward, and their scratch buffers are freed before this unit's are allocated.
        ctx.drain_reductions(ctx.max_inflight_reductions - 1)
        reduced = False
        for group in self.groups:
            reduced |= group.reduce_gradients(self.is_last_backward, async_op=ctx.overlap)
        if reduced:
            ctx.log("reduce", self)
            # [Note: in-place reductions in flight] Reductions that hold memory are finished
            # one unit later (the next post-backward's drain), as FSDP2 finishes its
            # reduce-scatters. An all-reduce in place into a persistent buffer (``no_shard``'s
            # ``main_grad`` in its own dtype) holds none: it runs on until the final callback,
            # as DDP's bucket all-reduces do. A reduce-scatter in place (``optim``'s) holds no
            # buffer of ours, but its transport may: on gloo each one holds a copy of its
            # input while in flight, 96 MiB at the end of ``optim``'s backward on the 29.5M
            # GPT at 4 ranks when all ran on to the final callback (``bench_training.py
            # --peak-breakdown``); drained one unit later, the step time was the same (1.07x
            # ZeRO-1's both ways, ``--systems optim,zero1 --rounds 3``; 1.02x in a run after
            # the change) and the peak RSS above base 1.02x ZeRO-1's instead of 1.13x.
            # A window's end is listed too: its outer reduction is launched when the next
            # drain has finished the inner one (see [Note: outer reductions in backward]).
            if ctx.overlap and any(
                g.reduction_holds_memory
                or (self.is_last_backward and g.awaits_window_steps) for g in self.groups
            ):
                ctx.reducing.append(self)
        self.backward_done = True
        self.training_state = TrainingState.IDLE
