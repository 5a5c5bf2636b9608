"""The ``FSDPModule`` mixin: the methods every module passed to ``fully_shard`` gains (its class
becomes ``FSDP<Class>``), and the ``UnshardHandle`` its ``unshard(async_op=True)`` returns. Each
method finds the unit states in ``_registry`` and delegates to them; nothing here touches a
buffer or issues a collective itself."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle

from .. import _registry
from .._comm._collective_impl import CollectiveCount, GroupCollectives, merge_counts
from .._init import _conversions, _materialize
from .._runtime._context import TrainingState
from .._runtime._state import FSDPState
from . import _pipelining
from ._fsdp2_surface import FSDP2Surface

__all__ = ["FSDPModule", "UnshardHandle", "fsdp_class"]


class UnshardHandle(TorchUnshardHandle):
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` blocks until gathered."""

    def __init__(self, state: FSDPState | None) -> None:
        self._state = state

    def wait(self) -> None:
        if self._state is not None:
            self._state.wait_for_unshard()
            self._state.register_compute_params()  # FSDP2's: unsharded until reshard()
            self._state = None


class FSDPModule(FSDP2Surface):
    """Mixin added to the class of every module passed to :func:`fully_shard`. A subclass of
    ``torch.distributed.fsdp.FSDPModule`` (scripts written for FSDP2 find our units by
    ``isinstance``); every method of torch's class is overridden here or in
    :class:`~._fsdp2_surface.FSDP2Surface` (see [Note: FSDP2's methods on flat buffers])."""

    def _mfsdp_states(self) -> list[FSDPState]:
        """States of this unit and every unit below it."""
        assert isinstance(self, nn.Module)
        state = _registry.state_of(self)
        ctx = state.ctx if state is not None else None
        if ctx is not None and ctx.root is state:
            # The tree the root's lazy init found (nothing can be wrapped below a root after
            # it: its parameters are managed already). Saves a module walk with a registry
            # look-up per module on every set_is_last_backward call (0.3 ms on 64 units).
            return list(ctx.states)
        return [s for _, s in _registry.unit_states(self)]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather (ZeRO-3) or refresh (ZeRO-1/2) this unit's compute weights ahead of use and,
        as FSDP2, register them on the module until :meth:`reshard` or the end of the next
        forward: ``module.weight`` is then the unsharded parameter (a plain tensor, or the TP
        DTensor of a tensor-parallel one) and submodules may be called directly. The
        optimizer's DTensor parameters are unchanged. With ``async_op=True`` returns a handle
        whose ``wait()`` does the registering; the next forward waits on it anyway."""
        # A zero-bubble pipeline schedule's step: see [Note: pipeline schedules over
        # fully_shard units].
        _pipelining.note_split_backward(self, sys._getframe(1))  # type: ignore[arg-type]
        state = _registry.state_of(self)  # type: ignore[arg-type]
        assert state is not None
        # A meta-built unit gets its values first, as at the first forward or state_dict().
        _materialize.materialize(self)  # type: ignore[arg-type]
        state.unshard(async_op=async_op)
        if async_op:
            return UnshardHandle(state)
        state.wait_for_unshard()
        state.register_compute_params()
        return None

    def reshard(self) -> None:
        """Free this unit's gathered weights (ZeRO-3; replicated strategies keep theirs) and
        register the sharded DTensor parameters again (FSDP2's ``reshard``)."""
        # A zero-bubble schedule over a stage whose root is not a unit: see [Note: pipeline
        # schedules over fully_shard units].
        _pipelining.refuse_split_backward_over_blocks(sys._getframe(1))
        state = _registry.state_of(self)  # type: ignore[arg-type]
        assert state is not None
        state.reshard()
        state.register_dist_params()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Mark whether the next backward ends the gradient-accumulation window (the last
        micro-batch before ``optimizer.step()``). Default ``True``: every backward is last, so an
        unmarked loop is correct, just with more collectives for ``no_shard``/``optim``.

        Non-last backwards skip the delayed reduction of ``no_shard``/``optim`` and do not expose
        gradients to the optimizer; ``optim_grads``/``optim_grads_params`` still reduce-scatter
        every micro-batch (that is what keeps their gradients sharded)."""
        for state in self._mfsdp_states():
            state.is_last_backward = bool(is_last_backward)

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """FSDP2's name for :meth:`set_is_last_backward`: ``False`` defers synchronization to a
        later backward. ``recurse=False`` applies to this unit only. ``True`` also turns
        :meth:`set_requires_all_reduce` (HSDP's outer reduction) back on, as in FSDP2 (``False``
        needs not: the window stays open anyway)."""
        states = self._mfsdp_states() if recurse else [_registry.state_of(self)]  # type: ignore[arg-type]
        for state in states:
            if state is not None:
                state.is_last_backward = bool(requires_gradient_sync)
                if requires_gradient_sync:
                    state.requires_all_reduce = True

    def _unit_states(self, recurse: bool) -> list[FSDPState]:
        if recurse:
            return self._mfsdp_states()
        state = _registry.state_of(self)  # type: ignore[arg-type]
        return [state] if state is not None else []

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """FSDP2's method: whether ZeRO-3 units free their gathered weights after forward
        (``False``: keep them until the unit's backward, which then gathers nothing). Units of
        other strategies never reshard and ignore it. See ``fully_shard``'s argument."""
        if not isinstance(reshard_after_forward, bool):
            # FSDP2's rule: the group size of an int is fixed at wrap time (its groups).
            raise ValueError(
                f"reshard_after_forward should be a bool, got {reshard_after_forward!r}: "
                "resharding to a smaller group (an int) is chosen in fully_shard("
                "reshard_after_forward=<int>), where its process groups are created"
            )
        for state in self._unit_states(recurse):
            state.reshard_after_forward = reshard_after_forward
            for group in state.groups:  # a bool replaces fully_shard's int, as in FSDP2
                group.weights.stop_post_forward_resharding()

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """FSDP2's method: whether ZeRO-3 units free their gathered weights after backward.
        ``False`` keeps them from a backward that is not the last of its window (see
        :meth:`set_requires_gradient_sync`) to the next forward, which then gathers nothing:
        gradient accumulation with fewer all-gathers, for the memory of the gathered weights.
        The last backward of a window frees them anyway (the optimizer step makes them
        stale), and kept weights are gathered again if the main weights changed meanwhile."""
        if not isinstance(reshard_after_backward, bool):
            raise TypeError(
                "reshard_after_backward must be a bool, got "
                f"{type(reshard_after_backward).__name__}"
            )
        for state in self._unit_states(recurse):
            state.reshard_after_backward = reshard_after_backward

    def _prefetch_states(self, modules: Any, what: str) -> list[FSDPState]:
        if isinstance(modules, nn.Module) or not isinstance(modules, (list, tuple)):
            raise TypeError(f"{what} expects a list of fully_shard modules, got "
                            f"{type(modules).__name__}")
        states = []
        for module in modules:
            state = _registry.state_of(module) if isinstance(module, nn.Module) else None
            if state is None:
                raise TypeError(
                    f"{what}: {type(module).__name__} is not a fully_shard module; list modules "
                    "returned by megatron_fsdp_v2.fully_shard"
                )
            states.append(state)
        return states

    def set_modules_to_forward_prefetch(self, modules: list[TorchFSDPModule]) -> None:
        """FSDP2's method: at this unit's pre-forward, start the all-gathers of ``modules``
        (instead of the next unit in the recorded forward order). Their own forwards then find
        the weights gathered. An empty list prefetches nothing. Applies with ``overlap=True``
        (``overlap=False`` prefetches nothing); ZeRO-1/2 units have nothing to prefetch."""
        states = self._prefetch_states(modules, "set_modules_to_forward_prefetch")
        state = _registry.state_of(self)  # type: ignore[arg-type]
        assert state is not None
        state.forward_prefetch = states

    def set_modules_to_backward_prefetch(self, modules: list[TorchFSDPModule]) -> None:
        """FSDP2's method: at this unit's pre-backward, start the all-gathers of ``modules``
        (instead of the previous unit in the recorded forward order), for those whose
        backward has not run yet. Same conditions as
        :meth:`set_modules_to_forward_prefetch`."""
        states = self._prefetch_states(modules, "set_modules_to_backward_prefetch")
        state = _registry.state_of(self)  # type: ignore[arg-type]
        assert state is not None
        state.backward_prefetch = states

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside are not the last of the iteration; on exit the flag is ``True``."""
        self.set_is_last_backward(False)
        try:
            yield
        finally:
            self.set_is_last_backward(True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the optimizer-facing gradients of this unit and those below it.
        ``set_to_none=True`` also frees the gradient buffers."""
        for state in self._mfsdp_states():
            for group in state.groups:
                group.grads.zero_grad(set_to_none)
        # Parameters not managed by any unit (ignored_params) follow nn.Module semantics.
        assert isinstance(self, nn.Module)
        for param in self.parameters():
            if _registry.record_of(param) is None and param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()

    def mark_main_weights_updated(self) -> None:
        """Tell the units that their optimizer-facing parameters were changed in a way the
        library cannot see (writes through ``p.to_local()`` or ``p.data`` in the middle of an
        accumulation window), so compute weights are refreshed before the next forward.
        Optimizer steps, ``load_state_dict`` and in-place ops on the parameters themselves are
        detected; see [Note: replicated-buffer refresh]."""
        for state in self._mfsdp_states():
            for group in state.groups:
                group.mark_main_weights_updated()

    def release_memory_pool(self) -> None:
        """Free the trace pool's arena (``fully_shard(..., enable_trace_pool=True)``; upstream
        Megatron-FSDP's name) and forget its trace, between steps. The next forward records the
        trace again and the one after plans a new arena, at new addresses (CUDA graphs captured
        on the old ones must be captured again); training continues with the same numbers.
        Applies to the whole tree of this unit's root; a no-op without the trace pool or before
        the first forward.

        Raises ``RuntimeError`` (changing nothing) between a forward and its backward, or while
        scratch buffers are in use (inside an accumulation window that keeps scratch buffers across
        micro-batches, gathered weights kept with ``reshard_after_backward=False``)."""
        state = _registry.state_of(self)  # type: ignore[arg-type]
        assert state is not None
        ctx = state.ctx
        if ctx is None:
            return
        busy = [s.fqn for s in ctx.states
                if s.training_state is not TrainingState.IDLE or s.needs_post_backward]
        if busy or ctx.final_callback_queued:
            raise RuntimeError(
                "release_memory_pool() was called in the middle of a step (units "
                f"{busy} ran forward and their backward has not finished): call it after the "
                "backward (e.g. after optimizer.step()), before the next forward"
            )
        ctx.allocator.release()
        for group in ctx.groups:
            group.drop_gathered_views()  # the arena is freed once nothing views it

    def collective_stats(self, reset: bool = False) -> dict[tuple[str, str], CollectiveCount]:
        """The collectives this unit and the units below it issued for their flat groups
        (gathers, refreshes, gradient reductions) since wrapping or the last reset, on this
        rank: ``{(logical, issued): CollectiveCount(calls, ops, bytes)}``. ``logical`` is what
        the schedule names (``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``),
        ``issued`` what ran for it (the same under ``collective_impl="native"``; under
        ``"auto"`` e.g. ``("reduce_scatter", "all_reduce")`` or ``("all_gather",
        "broadcast")``, with ``ops`` the broadcasts issued). Collectives outside the step's
        schedule (wrap-time broadcasts, clipping's norm all-reduce, checkpoints) are not
        counted. A collective of the tree's reduction or refresh buckets covers groups of
        several units: the root reports it. ``reset=True`` clears the counts after reading
        them."""
        accounts = [group.collectives for state in self._mfsdp_states() for group in state.groups]
        counts = merge_counts([a.counts for a in accounts + self._tree_bucket_accounts()])
        if reset:
            self.reset_collective_stats()
        return counts

    def reset_collective_stats(self) -> None:
        """Clear the counts :meth:`collective_stats` reports, for this unit and those below."""
        for state in self._mfsdp_states():
            for group in state.groups:
                group.collectives.reset()
        for account in self._tree_bucket_accounts():
            account.reset()

    def _tree_bucket_accounts(self) -> list[GroupCollectives]:
        """On the root: what its tree's buckets issued (their own issuer accounts)."""
        state = _registry.state_of(self)  # type: ignore[arg-type]
        if state is None or state.ctx is None or state.ctx.root is not state:
            return []
        return state.ctx.bucket_accounts

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise TypeError(
            f"copy.deepcopy of a fully_shard module ({type(self).__name__}) is not supported: "
            "its parameters view flat buffers shared with a process group. Build a fresh model "
            "and load the weights, e.g. megatron_fsdp_v2.checkpoint.get_full_state_dict(model) "
            "on every rank, then new_model.load_state_dict(sd) on rank 0 (or deep-copy the "
            "model before calling fully_shard)"
        )

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``.to()``, ``.float()``, ``.bfloat16()``, ``.cuda()``, ``.to_empty()``... after wrapping
        (see [Note: conversions after wrapping] in ``_conversions.py``).

        Managed parameters keep their flat buffers: a conversion that returns them unchanged (a
        ``.to`` to the device and dtype they already have) or returns new values of the same
        dtype, device and layout (``.to_empty(device=<their device>)``) is applied through the
        buffers (values copied into this rank's main weights, compute weights refreshed before
        the next forward; ``to_empty`` also cancels a pending meta-device initialization: the
        caller initializes). Any other change (dtype, device) raises ``NotImplementedError``
        before anything changes. Buffers and ignored parameters convert as usual."""
        assert isinstance(self, nn.Module)
        # The original class's _apply, past torch's FSDPModule._apply (FSDP2's, which would
        # reach FSDP2 state this module does not have).
        module_apply = functools.partial(
            super(TorchFSDPModule, self)._apply, fn, recurse
        )
        if _conversions.applying():  # a unit above handles this subtree's parameters
            return module_apply()
        return _conversions.apply_to_units(self, self._unit_states(recurse), fn, module_apply)


def fsdp_class(cls: type) -> type:
    """``FSDP<Class>``: ``cls`` with :class:`FSDPModule` mixed in (one per class)."""
    if cls not in _registry.fsdp_classes:
        _registry.fsdp_classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _registry.fsdp_classes[cls]
