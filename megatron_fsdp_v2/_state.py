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
  reshard ZeRO-3 groups and reduce gradients (``ParamGroup.reduce_grads``).
* final callback (end of backward, queued on the autograd engine): runs the post-backward of
  units whose inputs did not require grad (typically the root, fed token ids), waits for every
  in-flight reduction and, on the last micro-batch, installs the optimizer-facing gradients.

Forward hooks that run *during* backward are activation-checkpoint recomputes: they unshard and
register compute parameters but neither reshard nor register backward hooks again, so the
weights gathered for the recompute serve the backward that follows.
"""

from __future__ import annotations

import enum
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ._allocator import BucketAllocator
from ._param_group import ParamGroup
from .api import MixedPrecisionPolicy

__all__ = ["FSDPState", "FSDPContext", "TrainingState", "get_state"]

_STATE_ATTR = "_mfsdp_state"


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"


def get_state(module: nn.Module) -> FSDPState | None:
    return getattr(module, _STATE_ATTR, None)


def _in_backward() -> bool:
    """True inside the autograd engine (e.g. an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


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


class FSDPContext:
    """What the root shares with every unit of its tree."""

    def __init__(self, root: FSDPState, states: list[FSDPState]) -> None:
        self.root = root
        self.states = states  # pre-order of the module tree: root first
        self.allocator = BucketAllocator()
        self.final_callback_queued = False
        self.callback_failed = False  # the final callback raised: see recover()
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
        # Units whose gradient collectives may still be in flight, oldest first. At most
        # ``max_inflight_reductions`` units' reduction buckets are alive at once.
        self.reducing: deque[FSDPState] = deque()
        self.max_inflight_reductions = 1
        # Debug/test event log of (event, unit fqn); None disables logging.
        self.events: list[tuple[str, str]] | None = None

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
        """Finish the oldest in-flight reductions until at most ``keep`` units have some."""
        while len(self.reducing) > keep:
            for group in self.reducing.popleft().groups:
                group.wait_for_reduction()

    @property
    def groups(self) -> Iterable[ParamGroup]:
        for state in self.states:
            yield from state.groups

    def final_callback(self) -> None:
        """End of backward: reduce what no post-backward hook reduced, then finish reductions."""
        try:
            for state in reversed(self.states):
                # Also units that accumulated earlier micro-batches of the window but did not
                # run in this one: the last backward must still reduce what they hold.
                if state.needs_post_backward or (
                    state.is_last_backward and any(g.awaits_last_reduction for g in state.groups)
                ):
                    state.run_post_backward()
            self.reducing.clear()
            for state in self.states:
                for group in state.groups:
                    group.reshard()
                    group.wait_for_reduction()
                if state.is_last_backward:
                    for group in state.groups:
                        group.install_grads()
                        # The optimizer step that usually follows changes the main weights:
                        # refresh once before the next forward whatever updates them (an
                        # optimizer the step hook does not see, writes through to_local()).
                        group.mark_main_weights_updated()
        except BaseException:
            self.callback_failed = True  # reductions may be half-waited: recover() next forward
            raise
        finally:
            self.final_callback_queued = False
            for state in self.states:
                state.reset_to_idle()

    @property
    def step_failed(self) -> bool:
        """Whether the last forward or backward raised before finishing (checked at the root's
        next pre-forward): a unit still in forward (its post-forward never ran), a backward whose
        final callback never ran, or a final callback that raised."""
        return (
            self.final_callback_queued or self.callback_failed or self.unrecoverable is not None
            or any(s.training_state is not TrainingState.IDLE for s in self.states)
        )

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
        is then unusable and the job must restart; every later forward raises it again.

        Runs at once when an exception leaves the root's forward (an ``always_call`` forward
        hook), else lazily: at the root's next pre-forward, or before ``state_dict()`` /
        ``load_state_dict()`` of any unit (a ``KeyboardInterrupt``, or a failed backward).
        """
        if self.unrecoverable is not None:
            raise RuntimeError(self.unrecoverable)
        discard_grads = self.final_callback_queued or self.callback_failed or any(
            s.training_state is TrainingState.PRE_BACKWARD for s in self.states
        )
        error: BaseException | None = None
        for state in self.states:
            for group in state.groups:
                if error is None:
                    try:
                        group.wait_for_unshard()
                        group.wait_for_reduction()
                    except Exception as e:  # noqa: BLE001 - reported below, after the reset
                        error = e
                if error is not None:
                    # The group is broken: free no buffer a collective may still write into
                    # (and wait for no further one: each could take the whole timeout).
                    continue
                group.reshard()
                for param in group.params:
                    param.grad = None
                if discard_grads:
                    group.zero_grad(set_to_none=True)
        self.reducing.clear()
        self.final_callback_queued = False
        self.callback_failed = False
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


class FSDPState:
    """Hooks and training state of one unit."""

    def __init__(
        self, module: nn.Module, groups: list[ParamGroup], mp_policy: MixedPrecisionPolicy,
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
        self.fqn = type(module).__name__
        self._compute_registration, self._dist_registration = self._build_registrations(module)
        self._compute_registered = False
        # Every parameter slot of the modules this unit owns, as wrapping left it (managed
        # parameters as their DTensor parameters): see check_parameter_slots.
        self._slots = self._snapshot_slots(module)
        # A forward pre-hook on each owned submodule with parameters, present only while the
        # DTensor parameters are registered (so forward itself pays nothing for it): calling
        # such a submodule then gets a clear error instead of DTensor's "mixed torch.Tensor and
        # DTensor".
        self._idle_hooks: list[tuple[dict[int, Any], int]] = []
        for prefix, submodule in self._owned_modules(module):
            if submodule is not module and any(p is not None for p in submodule._parameters.values()):
                handle = submodule.register_forward_pre_hook(self._owned_submodule_called)
                self._idle_hooks.append((submodule._forward_pre_hooks, handle.id))
        self._cast_dtype = mp_policy.param_dtype if mp_policy.cast_forward_inputs else None
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward)
        # See FSDPContext.recover: recover at once when the root's forward raises, and before
        # a state dict is read or written after a failure the forward hook could not see.
        module.register_forward_hook(self._forward_raised, always_call=True)
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

    @staticmethod
    def _owned_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
        """``module`` and its submodules, minus wrapped children and everything below them."""
        owned: list[tuple[str, nn.Module]] = []
        wrapped: list[str] = []
        for prefix, submodule in module.named_modules():
            if any(prefix.startswith(w + ".") for w in wrapped):
                continue
            if submodule is not module and get_state(submodule) is not None:
                wrapped.append(prefix)
                continue
            owned.append((prefix, submodule))
        return owned

    def _snapshot_slots(
        self, module: nn.Module
    ) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
        dist_of = {id(p): d for g in self.groups for p, d in zip(g.params, g.dist_params)}
        return [
            (
                prefix,
                submodule._parameters,
                {name: dist_of.get(id(p), p) for name, p in submodule._parameters.items()},
            )
            for prefix, submodule in self._owned_modules(module)
        ]

    def check_parameter_slots(self) -> None:
        """Raise if a parameter of this unit was replaced, added, removed or (un)tied after
        wrapping. The runtime would silently put its own parameter back (or leave a new one
        unsharded and unsynchronized), training another model than the user's."""
        for prefix, parameters, expected in self._slots:
            if len(parameters) == len(expected) and all(
                parameters.get(name) is value or self._is_compute_param(name, parameters)
                for name, value in expected.items()
            ):
                continue
            names = list(expected) + [n for n in parameters if n not in expected]
            for name in names:
                if name in expected and (
                    parameters.get(name) is expected[name] or self._is_compute_param(name, parameters)
                ):
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                what = (
                    "added" if name not in expected
                    else "removed" if name not in parameters
                    else "replaced (or tied to another parameter)"
                )
                raise RuntimeError(
                    f"parameter '{fqn}' of the fully_shard unit '{self.fqn}' was {what} after "
                    "fully_shard; the unit's flat buffers hold the parameters it was wrapped "
                    "with. Set, tie or add parameters before calling fully_shard (for tied "
                    "weights, wrap a common ancestor); to change values, write in place "
                    "(p.copy_(x), nn.init.*) or use load_state_dict"
                )

    def _is_compute_param(self, name: str, parameters: dict[str, Any]) -> bool:
        """Whether ``parameters[name]`` is the compute parameter this unit registered there
        (between forward and backward, or after a forward that raised)."""
        for slots, mapping in self._compute_registration:
            if slots is parameters:
                return mapping.get(name) is parameters.get(name) and name in mapping
        return False

    def _owned_submodule_called(self, submodule: nn.Module, args: Any) -> None:
        if not self._compute_registered:
            raise RuntimeError(
                f"{type(submodule).__name__} is managed by the fully_shard unit "
                f"'{self.fqn}' ({type(self.module).__name__}) and was called outside that "
                "unit's forward, where its parameters are sharded DTensors. Call the unit "
                "itself, or wrap this submodule with fully_shard (before its parent) so it is a "
                "unit of its own"
            )

    @property
    def dist_registration(self) -> list[tuple[dict, dict]]:
        return self._dist_registration

    def forget_graph(self) -> None:
        """No backward may run again over the graphs built so far (see [Note: retained graphs])."""
        self.registered_calls = 0
        self._graph_backwarded = False
        self._backward_task = None

    def _build_registrations(
        self, module: nn.Module
    ) -> tuple[list[tuple[dict, dict]], list[tuple[dict, dict]]]:
        """Per owning submodule, the ``_parameters`` entries that hold compute / DTensor params.
        A tied parameter appears under every (submodule, name) slot it occupies."""
        compute_ids = {id(p): (p, d) for g in self.groups for p, d in zip(g.params, g.dist_params)}
        compute: dict[int, tuple[dict, dict]] = {}
        dist: dict[int, tuple[dict, dict]] = {}
        for submodule in module.modules():
            for name, param in submodule._parameters.items():
                if param is None or id(param) not in compute_ids:
                    continue
                compute_param, dist_param = compute_ids[id(param)]
                key = id(submodule)
                compute.setdefault(key, (submodule._parameters, {}))[1][name] = compute_param
                dist.setdefault(key, (submodule._parameters, {}))[1][name] = dist_param
        return list(compute.values()), list(dist.values())

    def reset_to_idle(self) -> None:
        """Between steps: DTensor parameters registered, no backward bookkeeping pending."""
        self.register_dist_params()
        self.training_state = TrainingState.IDLE
        self.pending_post_backward = 0
        self.needs_post_backward = False
        self.backward_done = False

    def register_dist_params(self) -> None:
        for parameters, mapping in self._dist_registration:
            parameters.update(mapping)
        if self._compute_registered:
            for hooks, key in self._idle_hooks:
                hooks[key] = self._owned_submodule_called
        self._compute_registered = False

    def register_compute_params(self) -> None:
        for parameters, mapping in self._compute_registration:
            parameters.update(mapping)
        if not self._compute_registered:
            for hooks, key in self._idle_hooks:
                hooks.pop(key, None)
        self._compute_registered = True

    # ------------------------------------------------------------------ lazy init

    def _lazy_init(self) -> None:
        """First forward: this unit is the root of every unit below it."""
        named = [(name, s) for name, m in self.module.named_modules() if (s := get_state(m)) is not None]
        states = [s for _, s in named]
        ctx = FSDPContext(self, states)
        for name, state in named:
            state.fqn = name or "<root>"
            state.ctx = ctx
            # One allocator for the tree, so the temporary-bucket peak is the tree's peak.
            ctx.allocator.adopt(state.allocator)
            state.allocator = ctx.allocator
            for index, group in enumerate(state.groups):
                group.allocator = ctx.allocator
                group.name = f"unit '{state.fqn}' group {index}"

    @property
    def is_root(self) -> bool:
        return self.ctx is not None and self.ctx.root is self

    # ------------------------------------------------------------------ forward

    def unshard(self, async_op: bool = False) -> bool:
        """Start making compute weights available; True if a collective was issued."""
        issued = False
        for group in self.groups:
            issued |= group.unshard(async_op)
        return issued

    def wait_for_unshard(self) -> None:
        for group in self.groups:
            group.wait_for_unshard()

    def reshard(self) -> bool:
        freed = False
        for group in self.groups:
            freed |= group.reshard()
        return freed

    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if _in_backward():  # activation-checkpoint recompute
            self.unshard()
            self.wait_for_unshard()
            self.register_compute_params()
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
                state.check_parameter_slots()
            self._root_pre_forward()
        elif ctx.root.training_state is not TrainingState.FORWARD:
            self.check_parameter_slots()  # called directly, not from the root's forward
        for group in self.groups:
            group.sync_requires_grad()
        if self._graph_backwarded:
            self.forget_graph()
        ctx.record_forward(self)
        self.training_state = TrainingState.FORWARD
        if self.unshard():
            ctx.log("unshard", self)
        self.wait_for_unshard()
        if ctx.overlap:
            following = ctx.neighbor(self, +1)
            if following is not None and following.unshard(async_op=True):
                ctx.log("prefetch", following)
        self.register_compute_params()
        if self._cast_dtype is not None:
            dtype = self._cast_dtype
            args, kwargs = tree_map(
                lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
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
        for group in self.ctx.groups:
            group.sweep_cleared_grads()
            group.detect_main_weight_edits()
        if self.ctx.overlap:
            # [Note: replicated-buffer refresh] is in place, so refreshing every unit at once
            # costs no memory: launch all refresh all-gathers now, in forward order, and let
            # each unit wait for its own in its pre-forward, overlapping the earlier units'
            # compute.
            for state in self.ctx.forward_order or self.ctx.states:
                issued = False
                for group in state.groups:
                    if group.needs_refresh and not group.strategy.shards_model_weights:
                        issued |= group.unshard(async_op=True)
                if issued:
                    self.ctx.log("refresh", state)

    def _register_post_backward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
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

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        self.register_dist_params()
        if _in_backward():
            return output
        ctx = self.ctx
        assert ctx is not None
        if self.reshard():
            ctx.log("reshard", self)
        self.training_state = TrainingState.IDLE
        if self.is_root:
            ctx.recording_order = False
            for state in ctx.states:  # prefetched but never run (skipped by control flow)
                if state.reshard():
                    ctx.log("reshard", state)
        if torch.is_grad_enabled():
            tensors = [
                t for t in tree_flatten(output)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, self._pre_backward, mode="any"
                )
        return output

    # ------------------------------------------------------------------ backward

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
            preceding = ctx.neighbor(self, -1)
            if (
                preceding is not None
                and not preceding.backward_done
                and preceding.unshard(async_op=True)
            ):
                ctx.log("prefetch", preceding)
        # An activation-checkpoint recompute inside this module's forward (which bypasses the
        # forward hooks) must see compute parameters, not DTensors.
        self.register_compute_params()

    def post_backward(self) -> None:
        """Called by ``_RegisterPostBackward``: runs once every forward call has its gradients."""
        self.pending_post_backward -= 1
        if self.pending_post_backward <= 0 and self.needs_post_backward:
            self.run_post_backward()

    def run_post_backward(self) -> None:
        self.needs_post_backward = False
        self.pending_post_backward = 0
        self._graph_backwarded = True
        self.register_dist_params()
        ctx = self.ctx
        assert ctx is not None
        if self.reshard():
            ctx.log("reshard", self)
        # Finish older reductions *before* staging new ones: they overlapped this unit's
        # backward, and their buckets are freed before this unit's are allocated.
        ctx.drain_reductions(ctx.max_inflight_reductions - 1)
        reduced = False
        for group in self.groups:
            reduced |= group.reduce_grads(self.is_last_backward, async_op=ctx.overlap)
        if reduced:
            ctx.log("reduce", self)
            if ctx.overlap:
                ctx.reducing.append(self)
        self.backward_done = True
        self.training_state = TrainingState.IDLE
