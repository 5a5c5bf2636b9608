"""Per-unit hook owner (``FSDPState``) and the state its root shares with the whole tree
(``FSDPContext``). Decides *when* parameter groups unshard, reshard and reduce; never touches
buffer contents itself.

[Note: hook schedule]
For a unit ``U`` (a module passed to ``fully_shard``):

* forward pre-hook: on the root, lazy init and the gradient sweep; then ``U`` unshards its groups
  (ZeRO-3 gather, or the ZeRO-1/2 refresh when stale), registers its compute parameters on the
  module, and routes its tensor inputs through ``_RegisterPostBackward`` so that ``U``'s
  post-backward runs once the gradients of its inputs (hence of its parameters) are computed.
* forward post-hook: registers the DTensor parameters again, reshards ZeRO-3 groups, and hooks
  the outputs so the first gradient flowing into them runs ``U``'s pre-backward.
* pre-backward: queues the root's final callback (once per backward) and re-gathers ZeRO-3 weights.
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
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .. import _registry
from .._buffers._allocator import BucketAllocator
from .._buffers._plan import GradPath
from .._init._materialize import materialize
from .._profiling import traced
from ..api import MixedPrecisionPolicy
from ._compile import eager_hook
from ._context import FSDPContext, TrainingState
from ._flat_param_group import FlatParamGroup
from ._slots import ParamSlots

__all__ = ["FSDPState"]


def _in_backward() -> bool:
    """True inside the autograd engine (e.g. an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


def _require_same(named: list[tuple[str, FSDPState]], root: FSDPState, option: str,
                  why: str) -> None:
    """Raise ``ValueError`` (at the root's lazy init, before any collective) unless every unit
    of the tree passed the same ``fully_shard`` ``option``."""
    wanted = getattr(root, option)
    differing = [f"'{name or '<root>'}' ({getattr(s, option)})" for name, s in named
                 if getattr(s, option) != wanted]
    if differing:
        raise ValueError(
            f"fully_shard({option}=...) must be the same for every unit of a model, i.e. the "
            f"same for every fully_shard call ({why}): the root has {wanted}, units "
            f"{', '.join(differing)} differ; pass the same value to every fully_shard call of "
            "this model"
        )


class _RegisterPostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward is the unit's post-backward hook."""

    @staticmethod
    def forward(ctx: Any, state: FSDPState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state.post_backward()
        return (None, *grads)


class FSDPState:
    """Hooks and training state of one unit."""

    def __init__(
        self, module: nn.Module, groups: list[FlatParamGroup], mp_policy: MixedPrecisionPolicy,
        allocator: BucketAllocator,
    ) -> None:
        self._module_ref = weakref.ref(module)
        self.groups = groups
        self.mp_policy = mp_policy
        self.allocator = allocator
        self.ctx: FSDPContext | None = None
        self.training_state = TrainingState.IDLE
        self.is_last_backward = True
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
        # Which objects sit in the module's parameter slots, and checks that nobody else put
        # another one there (see _slots.py).
        self.slots = ParamSlots(self, module)
        self._cast_dtype = mp_policy.param_dtype if mp_policy.cast_forward_inputs else None
        self._output_dtype = mp_policy.output_dtype
        # Never traced by torch.compile: see [Note: hooks outside compiled regions].
        module.register_forward_pre_hook(
            eager_hook(self._pre_forward), prepend=True, with_kwargs=True
        )
        module.register_forward_hook(eager_hook(self._post_forward))
        # See FSDPContext.recover: recover at once when the root's forward raises, and before
        # a state dict is read or written after a failure the forward hook could not see.
        module.register_forward_hook(eager_hook(self._forward_raised), always_call=True)
        module.register_state_dict_pre_hook(self._recover_if_failed)
        module.register_load_state_dict_pre_hook(self._recover_if_failed)

    def _forward_raised(self, module: nn.Module, args: Any, output: Any) -> None:
        """``always_call`` forward hook; after a successful forward nothing is left to do. Never
        raises (torch would only warn): an unrecoverable state is raised by the next forward,
        after the forward's own error has propagated."""
        ctx = self.ctx
        if (
            ctx is not None and ctx.root is self and not _in_backward()
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
        self.slots.register_dist_params()

    def register_compute_params(self) -> None:
        self.slots.register_compute_params()
        for group in self.groups:
            group.note_views_exposed()  # see [Note: trace-planned pool]

    # ------------------------------------------------------------------ lazy init

    def _lazy_init(self) -> None:
        """First forward: this unit is the root of every unit below it."""
        named = [
            (name, s) for name, m in self.module.named_modules()
            if (s := _registry.state_of(m)) is not None
        ]
        states = [s for _, s in named]
        # One allocator and one reduction coalescer serve the whole tree.
        _require_same(named, self, "enable_trace_pool", "one allocator serves them all")
        _require_same(named, self, "reduce_bucket_size_mb", "the buckets span units")
        _require_same(named, self, "refresh_bucket_size_mb", "the buckets span units")
        ctx = FSDPContext(self, states)
        # [Note: gradients in place] a unit with units below it arms on the accumulate path only
        # (prepare_gradients): every proper prefix of a unit's name that names a unit is a parent.
        names = {name for name, _ in named}
        parents = {""} if len(named) > 1 else set()
        for name, _ in named:
            parts = name.split(".")
            parents.update(p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in names)
        for name, state in named:
            state.fqn = name or "<root>"
            state.owns_nested_units = name in parents
            state.ctx = ctx
            # One allocator for the tree, so the temporary-bucket peak is the tree's peak.
            ctx.allocator.adopt(state.allocator)
            state.allocator = ctx.allocator
            for index, group in enumerate(state.groups):
                group.allocator = ctx.allocator
                group.grads.coalescer = ctx.coalescer
                group.name = f"unit '{state.fqn}' group {index}"
        # A model built on the meta device gets its values now, in whole-tree module order.
        materialize(self.module)

    @property
    def is_root(self) -> bool:
        return self.ctx is not None and self.ctx.root is self

    # ------------------------------------------------------------------ forward

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

    def reshard(self) -> bool:
        freed = False
        for group in self.groups:
            if group.holds_weight_work:
                freed |= group.free_gathered_weights()
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
        kept (after a backward; or after a forward that no backward followed)."""
        if self._kept_version is None:
            return
        if self._kept_version != self._main_version() or any(
            g.needs_refresh for g in self.groups
        ):
            self.reshard()
        self._kept_version = None

    def _prefetch_targets(self, step: int) -> list[FSDPState]:
        """Units to prefetch: the explicit list, else the neighbor in the forward order."""
        ctx = self.ctx
        assert ctx is not None
        explicit = self.forward_prefetch if step > 0 else self.backward_prefetch
        if explicit is None:
            neighbor = ctx.neighbor(self, step)
            return [] if neighbor is None else [neighbor]
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
        if _in_backward():  # activation-checkpoint recompute
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
                return self._register_post_backward(args, kwargs)
            return None
        if self.ctx is None:
            self._lazy_init()
        assert self.ctx is not None
        ctx = self.ctx
        if self.is_root:
            for state in ctx.states:  # before anything changes
                state.slots.check()
            self._root_pre_forward()
        elif ctx.root.training_state is not TrainingState.FORWARD:
            self.slots.check()  # called directly, not from the root's forward
        for group in self.groups:
            group.sync_requires_grad()
        if self._graph_backwarded:
            self.forget_graph()
        ctx.record_forward(self)
        self.training_state = TrainingState.FORWARD
        self.drop_stale_kept_weights()
        if self.unshard():
            ctx.log("unshard", self)
        self.wait_for_unshard()
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
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def _root_pre_forward(self) -> None:
        assert self.ctx is not None
        if self.ctx.step_failed:
            # The last forward or backward raised before finishing (see FSDPContext.recover).
            self.ctx.recover()
        if self.ctx.allocator.begin_iteration():  # see [Note: trace-planned pool]
            for group in self.ctx.groups:
                group.drop_gathered_views()  # of the replaced arena, so it can be freed
        for group in self.ctx.groups:
            group.grads.sweep()
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
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not kwargs and all(isinstance(t, torch.Tensor) for t in args):
            # The common call (tensors only): the same as below without the pytree round trip.
            positions = [i for i, t in enumerate(args) if t.requires_grad]
            if not positions:
                return args, kwargs
            outputs = _RegisterPostBackward.apply(self, *(args[i] for i in positions))
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
        outputs = _RegisterPostBackward.apply(self, *(flat[i] for i in positions))
        for i, out in zip(positions, outputs):
            flat[i] = out
        self.pending_post_backward += 1
        self.registered_calls += 1
        return tree_unflatten(flat, spec)

    def _keeps_weights_for_backward(self) -> bool:
        """``reshard_after_forward=False`` and a backward will come for this unit."""
        return not self.reshard_after_forward and self.needs_post_backward

    def _cast_output(self, output: Any) -> Any:
        dtype = self._output_dtype
        if dtype is None:
            return output
        return tree_map(
            lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
            output,
        )

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        self.register_dist_params()
        output = self._cast_output(output)
        if _in_backward():
            return output
        ctx = self.ctx
        assert ctx is not None
        if torch.is_grad_enabled() and self._keeps_weights_for_backward():
            self.keep_gathered()  # for the backward (reshard_after_forward=False)
        elif self.reshard():
            ctx.log("reshard", self)
        self.training_state = TrainingState.IDLE
        if self.is_root:
            ctx.recording_order = False
            if ctx.refresh_coalescer is not None:  # no refresh bucket outlives the forward
                ctx.refresh_coalescer.settle()
            for state in ctx.states:  # prefetched but never run (skipped by control flow)
                if not state._keeps_weights_for_backward() and state.reshard():
                    ctx.log("reshard", state)
        if torch.is_grad_enabled():
            hook = self._pre_backward
            if ctx.allocator.moves_buckets:  # see [Note: trace-planned pool]
                hook = functools.partial(self._checked_pre_backward, self._views_stamp())
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

    def _checked_pre_backward(self, stamp: tuple[int, ...], grad: torch.Tensor) -> None:
        """``_pre_backward`` of a graph built when the compute views had ``stamp``: raise,
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
        self._pre_backward(grad)

    def _pre_backward(self, grad: torch.Tensor) -> None:
        ctx = self.ctx
        assert ctx is not None
        task = torch._C._current_graph_task_id()
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

    def prepare_gradients(self) -> None:
        """Before this unit's parameters receive gradients: let autograd write them into the
        flat buffers (see [Note: gradients in place] in ``_grad_staging.py``, which says why a unit
        with units nested below it does so only on the accumulate path)."""
        for group in self.groups:
            accumulates = group.plan.grad_path is GradPath.ACCUMULATE_THEN_REDUCE
            if self.owns_nested_units and not accumulates:
                continue
            group.grads.prepare_backward()

    def post_backward(self) -> None:
        """Called by ``_RegisterPostBackward``: runs once every forward call has its gradients."""
        self.pending_post_backward -= 1
        if self.pending_post_backward <= 0 and self.needs_post_backward:
            self.run_post_backward()

    @traced("mfsdp::post_backward")
    def run_post_backward(self) -> None:
        self.needs_post_backward = False
        self.pending_post_backward = 0
        self._graph_backwarded = True
        self.register_dist_params()
        ctx = self.ctx
        assert ctx is not None
        if self.reshard_after_backward or self.is_last_backward:
            if self.reshard():
                ctx.log("reshard", self)
        else:
            self.keep_gathered()
        # Finish older reductions *before* staging new ones: they overlapped this unit's
        # backward, and their buckets are freed before this unit's are allocated.
        ctx.drain_reductions(ctx.max_inflight_reductions - 1)
        reduced = False
        for group in self.groups:
            reduced |= group.grads.reduce(self.is_last_backward, async_op=ctx.overlap)
        if reduced:
            ctx.log("reduce", self)
            # Only reductions that hold a temporary bucket are drained early. One in place into
            # a persistent buffer (the accumulate path's ``main_grad`` in its own dtype) costs
            # no memory in flight: it runs on until the final callback, as DDP's bucket
            # all-reduces do, instead of stalling the next unit's backward (measured: ``optim``
            # on 4 gloo ranks waited 144 ms per step in backward before).
            # A window's end is listed too: its outer reduction is launched when the next
            # drain has finished the inner one (see [Note: outer reductions in backward]).
            if ctx.overlap and any(
                g.grads.reduction_holds_temporary
                or (self.is_last_backward and g.grads.awaits_window_steps) for g in self.groups
            ):
                ctx.reducing.append(self)
        self.backward_done = True
        self.training_state = TrainingState.IDLE
