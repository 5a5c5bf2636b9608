"""FSDP2's ``FSDPModule`` surface on our modules: :class:`FSDP2Surface` subclasses
``torch.distributed.fsdp.FSDPModule`` (so ``isinstance(m, FSDPModule)`` holds for every module our
``fully_shard`` wrapped) and overrides *every* method torch's class defines, each with FSDP2's
meaning over our unit states, or refusing with a ``NotImplementedError`` that names the
alternative. ``REFUSED`` lists the refused ones and why; the rest of the mixin is in
``_fsdp_module.py``.

[Note: FSDP2's methods on flat buffers]
torch's methods reach FSDP2's internals (``_get_fsdp_state()._fsdp_param_groups``), which our
modules do not have; inheriting one unchanged would fail deep inside torch (or, worse, set an
attribute nothing reads). So each is overridden here or in ``_fsdp_module.py``, and
``tests/distributed/test_fsdp2_surface.py`` enumerates ``vars(torch FSDPModule)`` so that a
method a newer torch adds fails the test until it is classified. What maps onto a flat-buffer
design:

* gradient scaling: every reduction here is a ``SUM`` of gradients multiplied *before* the
  collective by the group's ``grad_pre_scale`` (fused into the staging copy), so
  ``set_gradient_divide_factor(f)`` sets it to ``1/f`` for the unit's groups (the total over the
  whole data-parallel mesh, HSDP included, divided by ``f``, as FSDP2), and
  ``set_force_sum_reduction_for_comms`` is what we always do (no ``AVG``/``PREMUL_SUM``, which
  gloo lacks). Reduction buckets key on the scale, so units with different factors never
  share a coalesced collective (see [Note: reduction buckets] in ``_runtime/_coalesce.py``).
* ``set_requires_all_reduce(False)`` on an HSDP unit keeps the window open for the outer axis:
  the backward is not the last of its window (see ``UnitState.is_last_backward``).
* ``reset_iter_state`` is the tree's ``recover()`` (see ``_runtime/_context.py``).
* ``set_manual_backward_finalization`` / ``finalize_backward`` (torch 2.15's; ours on every
  supported torch): see [Note: manual backward finalization] in ``_runtime/_finalize.py``.
* refused: what replaces FSDP2's per-collective buffers and streams (custom collectives,
  symmetric or process-group memory, input-buffer caps, a second reduce-scatter group,
  post-optimizer events, kept unsharded storage of ZeRO-3 units), and torch's private state
  accessors (``_get_fsdp_state()`` answers only ``_comm_ctx``: :class:`FSDP2StateView`).
* ``set_all_reduce_hook``: the hook runs on each group's reduced shard at the end of its
  window (see [Note: the all-reduce hook] in ``_runtime/_all_reduce_hook.py``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp._fully_shard import _fully_shard as _torch_fully_shard

from .. import _registry
from .._runtime import _finalize
from .._runtime._context import FSDPContext
from .._runtime._issuer import Deferred
from .._runtime._state import FSDPState

__all__ = ["FSDP2StateView", "FSDP2Surface", "GradientReductionHandle", "REFUSED"]

# Each refused method of torch's FSDPModule: why a flat-buffer design has no equivalent, and
# what to use instead. The messages of the NotImplementedError raised are built from it.
REFUSED: dict[str, str] = {
    "set_custom_all_gather": (
        "a unit's weights are gathered from one flat buffer by the library's own collective, "
        "not per FSDP2 param group; choose its implementation with fully_shard("
        "collective_impl='native'|'auto') instead"
    ),
    "set_custom_reduce_scatter": (
        "gradients are reduced from one flat buffer (and coalesced across units with "
        "reduce_bucket_size_mb) by the library's own collective; choose its implementation with "
        "fully_shard(collective_impl=...), and its scale with set_gradient_divide_factor"
    ),
    "set_post_optim_event": (
        "the library's gathers already wait on the stream the optimizer step ran on; record "
        "the step on the current stream (nothing else is needed)"
    ),
    "set_symm_mem_for_comm": (
        "the staging buffers are the library's flat buffers and scratch allocator, not "
        "per-collective allocations; use fully_shard(enable_trace_pool=True) to pre-plan them"
    ),
    "set_allocate_memory_from_process_group_for_comm": (
        "the staging buffers are the library's flat buffers and scratch allocator, not "
        "per-collective allocations; use fully_shard(enable_trace_pool=True) to pre-plan them"
    ),
    "set_reduce_scatter_max_input_buffers": (
        "in-flight reduction buffers are bounded by the library's drain of older reductions and "
        "by reduction buckets; size those with fully_shard(reduce_bucket_size_mb=...)"
    ),
    "set_separate_reduce_scatter_group": (
        "every collective of a unit is launched from one issuer on the unit's process groups "
        "(see GroupIssuer); overlap comes from fully_shard(overlap=True)"
    ),
    "set_unshard_in_backward": (
        "a ZeRO-3 unit's backward always gathers its weights (False is not supported there; True "
        "is the default and accepted); wrap such a unit with sharding_strategy='optim_grads' so "
        "its weights stay replicated and its backward gathers nothing"
    ),
    "_set_unshard_async_op": (
        "FSDP2's private switch; prefetch explicitly with unshard(async_op=True) or "
        "set_modules_to_forward_prefetch"
    ),
    "set_keep_unsharded_storage": (
        "a ZeRO-3 unit gathers its weights into the library's scratch buffers, freed after use "
        "(True is accepted for units whose weights stay replicated); use "
        "fully_shard(enable_trace_pool=True), which plans the gathered weights at fixed "
        "addresses across steps (what CUDA graph capture needs), or "
        "sharding_strategy='optim_grads', whose weights stay replicated"
    ),
}

# What reaching into FSDP2's state through ``_get_fsdp_state()`` raises (see
# :class:`FSDP2StateView`).
NO_FSDP2_STATE = (
    "this module was wrapped by megatron_fsdp_v2.fully_shard and has no FSDP2 state; use "
    "its FSDPModule methods (torch helpers that reach FSDP2's internals, e.g. "
    "register_fsdp_forward_method or share_comm_ctx, do not apply)"
)


def refuse(method: str) -> NotImplementedError:
    """The error a refused method raises: what it is, why, and the alternative."""
    return NotImplementedError(
        f"FSDPModule.{method} is not supported by megatron_fsdp_v2.fully_shard: {REFUSED[method]}"
    )


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


class FSDP2Surface(TorchFSDPModule):
    """The part of :class:`~._fsdp_module.FSDPModule` that overrides torch's ``FSDPModule``
    methods not otherwise implemented there (see [Note: FSDP2's methods on flat buffers])."""

    # The original class's place in ``FSDP<Orig>.__mro__``: [FSDP<Orig>, FSDPModule,
    # FSDP2Surface, torch's FSDPModule, Orig, ...] (torch's own is 2).
    _orig_cls_mro_index: int = 4

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """FSDP2's meaning: constructing ``FSDP<Orig>`` (``nn.Sequential`` slicing does
        ``type(self)(...)``) builds a plain, unwrapped ``Orig``."""
        orig_cls = cls.__mro__[cls._orig_cls_mro_index]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        if _torch_fully_shard._enable_fsdp_module_new_init:
            self.__init__(*args, **kwargs)
        return self

    def _own_state(self) -> FSDPState:
        state = _registry.state_of(self)  # type: ignore[arg-type]
        assert state is not None, f"{type(self).__name__} has no fully_shard state"
        return state

    def _root_ctx(self, method: str) -> FSDPContext | None:
        """The tree's context (None before the root's first forward), for a method FSDP2
        allows on the root only: ``RuntimeError`` on a unit below the root."""
        state = self._own_state()
        ctx = state.ctx
        if ctx is not None and ctx.root is not state:
            raise RuntimeError(
                f"{method} must be called on the root fully_shard module, not on "
                f"{type(self).__name__} (a unit below the root)"
            )
        return ctx

    def _states_of(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._own_state()]
        assert isinstance(self, nn.Module)
        return [s for m in self.modules() if (s := _registry.state_of(m)) is not None]

    # ------------------------------------------------------------------ gradient scaling

    def set_gradient_divide_factor(self, factor: float) -> None:
        """FSDP2's method: this unit's gradients (not those of units below it) are summed over
        every rank of its data-parallel mesh (both axes with HSDP) and divided by ``factor``,
        instead of averaged. E.g. ``1.0`` sums; experts on an expert-data-parallel sub-mesh use
        the world size. Applied as a multiplication by ``1/factor`` before the ``SUM``
        collective (see [Note: FSDP2's methods on flat buffers]); overrides ``fully_shard``'s
        ``gradient_scaling_factor`` for this unit. Call it between steps: changing it while
        a unit holds gradients of an unfinished accumulation window raises ``RuntimeError``."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"factor must be a number, got {type(factor).__name__}")
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"factor must be a positive finite number, got {factor}")
        scale = 1.0 / float(factor)
        groups = self._own_state().groups
        for group in groups:
            if group.grad_pre_scale != scale and group.grads.pending_install:
                raise RuntimeError(
                    f"set_gradient_divide_factor({factor}) on {type(self).__name__} in the "
                    "middle of an accumulation window (its gradients were staged with the old "
                    "factor and are not reduced yet): call it before the first micro-batch "
                    "of a step, e.g. once after fully_shard"
                )
        for group in groups:
            group.grad_pre_scale = scale

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's deprecated name of :meth:`set_gradient_divide_factor` (warns the same)."""
        warnings.warn(
            "Use `set_gradient_divide_factor` instead", DeprecationWarning, stacklevel=2
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """FSDP2's method: use only ``SUM`` reductions, scaling separately. The library always
        does (gradients are multiplied by the unit's factor before a ``SUM``; see [Note:
        FSDP2's methods on flat buffers]), so either value gives the same collectives; the
        value is kept for reading back as ``force_sum_reduction_for_comms``."""
        self._own_state().force_sum_reduction_for_comms = _check_bool("enable", enable)

    # ------------------------------------------------------------------ synchronization

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """FSDP2's method: ``False`` skips the HSDP outer reduction of the next backwards (the
        gradients keep accumulating until a backward with ``True`` reduces the whole window
        over both axes). Unlike FSDP2, the inner reduction of an ``no_shard``/``optim`` unit is
        deferred too and the gradients are not exposed in between (the window is simply not
        over); the gradients after the window's last backward are the same. No effect on a
        1-D mesh (as in FSDP2)."""
        value = _check_bool("requires_all_reduce", requires_all_reduce)
        for state in self._states_of(recurse):
            state.requires_all_reduce = value

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """FSDP2's method (include zero gradients of parameters unused on this rank in the
        reduction). Always so here: a unit's gradients are reduced as one flat buffer, whose
        unused parameters' rows are zeros, so ranks never issue different collectives. The
        value is accepted (and ignored) either way."""
        _check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        self._states_of(recurse)

    # ------------------------------------------------------------------ manual finalization

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """FSDP2's method (torch 2.15; available here on every supported torch): ``True`` makes
        no backward end an accumulation window, whatever :meth:`set_requires_gradient_sync`
        says; :meth:`finalize_backward` ends it, once per step, with the settings in force
        when it is called (see [Note: manual backward finalization] in
        ``_runtime/_finalize.py``). torch 2.15's pipeline stages end each step this way. Call
        it on the root unit, outside a backward. ``RuntimeError`` (changing nothing) on a unit
        below the root, inside a backward, or when turning it off while backwards wait for
        their :meth:`finalize_backward`."""
        value = _check_bool("enabled", enabled)
        state = self._own_state()
        ctx = self._root_ctx("set_manual_backward_finalization")
        if value == state.manual_backward_finalization:
            return
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode during backward"
            )
        if ctx is not None and ctx.awaits_finalization:
            raise RuntimeError(
                "set_manual_backward_finalization(False) after a backward that ran under manual "
                "finalization: call finalize_backward() first (or reset_iter_state() to drop "
                "the step's gradients)"
            )
        state.manual_backward_finalization = value

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """FSDP2's method (torch 2.15; available here on every supported torch): end the
        backward iteration after the backwards of a step under
        :meth:`set_manual_backward_finalization`: reduce what is accumulated, wait for the
        reductions, run HSDP's outer reduction, install the gradients, free gathered weights
        and register the sharded parameters, as the final callback of a backward marked last
        would, with the current :meth:`set_requires_gradient_sync` /
        :meth:`set_requires_all_reduce` / :meth:`set_reshard_after_backward` settings.
        ``async_op=True`` launches the collectives and returns a handle whose ``wait()``
        finishes; wait before reading the gradients (the next forward waits anyway). A no-op
        before the root's first forward. ``RuntimeError`` (before any collective) on a unit
        below the root, without manual finalization, inside a backward, or while an earlier
        handle was not waited on."""
        async_op = _check_bool("async_op", async_op)
        state = self._own_state()
        ctx = self._root_ctx("finalize_backward")
        if ctx is None:
            return GradientReductionHandle(None, None) if async_op else None
        if ctx.finalization is not None:
            raise RuntimeError(
                "The previous gradient reduction must be waited on before finalizing backward "
                "again: call wait() on the handle finalize_backward(async_op=True) returned"
            )
        if not (state.manual_backward_finalization or ctx.awaits_finalization):
            raise RuntimeError(
                "finalize_backward requires manual backward finalization. Call "
                "set_manual_backward_finalization(True) before forward"
            )
        if ctx.final_callback_queued or torch._C._current_graph_task_id() != -1:
            raise RuntimeError("finalize_backward must be called after backward completes")
        ctx.awaits_finalization = False
        finalization = _finalize.finalize(list(ctx.states), async_op=async_op)
        if not async_op:
            finalization.finish()
            return None
        ctx.finalization = finalization
        return GradientReductionHandle(ctx, finalization)

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """FSDP2's method (torch 2.15): keep the unsharded parameters' storage across reshard
        and unshard, for CUDA graphs. ``False`` (the default) is accepted; so is ``True`` for
        units whose weights stay replicated (``no_shard``/``optim``/``optim_grads``: their
        compute weights are never freed). ZeRO-3 units gather into scratch buffers:
        ``True`` is refused there (``fully_shard(enable_trace_pool=True)`` gives gathered
        weights fixed addresses across steps)."""
        if not _check_bool("keep", keep):
            return
        if any(g.strategy.shards_model_weights for s in self._states_of(recurse) for g in s.groups):
            raise refuse("set_keep_unsharded_storage")

    def reset_iter_state(self) -> None:
        """FSDP2's method: after an exception aborted a forward or backward, wait for the
        collectives in flight, free gathered weights, reset the hook state and (after a failed
        backward) discard the window's gradients; call on the root. The library also does this
        by itself at the root's next forward (see ``FSDPContext.recover``)."""
        ctx = self._root_ctx("reset_iter_state()")
        if ctx is None:
            return  # no forward ran yet: nothing to reset
        ctx.recover()

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream: torch.cuda.Stream | None = None) -> None:
        """FSDP2's method: ``hook(reduced)`` runs on each of this unit's groups' reduced
        gradient shard (flat, in the gradient dtype; edit it in place), after the reduce-scatter
        (or all-reduce) on a 1-D mesh, where the hook may implement a replica all-reduce itself,
        and after the outer reduction under HSDP; then the gradients are installed. Once per
        group and accumulation window, on the window's sum (FSDP2: per reduce-scatter; the same
        for a linear hook); see [Note: the all-reduce hook]. ``stream``: a CUDA stream to run
        it on, not with an HSDP mesh (``ValueError``, as FSDP2). Not recursive (as FSDP2);
        set it between steps (``RuntimeError`` inside an accumulation window)."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        groups = self._own_state().groups
        if any(g.host_offload is not None for g in groups):
            raise NotImplementedError(
                f"set_all_reduce_hook on {type(self).__name__} with offload_policy="
                "CPUOffloadPolicy(): its reduced gradients are in host memory, where a hook's "
                "collective (a replica all-reduce) cannot run on an accelerator backend. Leave "
                "offload_policy unset for this unit, or reduce across replicas with an HSDP mesh"
            )
        if stream is not None:
            if any(g.mesh.ndim > 1 for g in groups):
                raise ValueError(
                    "set_all_reduce_hook: stream cannot be set when using native HSDP (a 2-D "
                    "mesh), as in FSDP2: the hook runs after the outer all-reduce, in order"
                )
            if not isinstance(stream, torch.cuda.Stream) or any(
                g.device.type != "cuda" for g in groups
            ):
                raise ValueError(
                    f"set_all_reduce_hook: stream must be a torch.cuda.Stream of a unit on "
                    f"CUDA, got {type(stream).__name__} for a unit on "
                    f"{groups[0].device.type if groups else 'no device'}; pass stream=None"
                )
        if any(g.grads.pending_install for g in groups):
            raise RuntimeError(
                f"set_all_reduce_hook on {type(self).__name__} in the middle of an accumulation "
                "window (part of its gradients are reduced already): call it between steps, "
                "e.g. once after fully_shard"
            )
        for group in groups:
            group.grads.all_reduce_hook = hook
            group.grads.all_reduce_hook_stream = stream

    # ------------------------------------------------------------------ refused

    def set_custom_all_gather(self, comm: Any) -> None:
        raise refuse("set_custom_all_gather")

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        raise refuse("set_custom_reduce_scatter")

    def set_post_optim_event(self, event: Any) -> None:
        raise refuse("set_post_optim_event")

    def set_symm_mem_for_comm(self, backend: Any = "NCCL") -> None:
        raise refuse("set_symm_mem_for_comm")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        raise refuse("set_allocate_memory_from_process_group_for_comm")

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        raise refuse("set_reduce_scatter_max_input_buffers")

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        raise refuse("set_separate_reduce_scatter_group")

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """FSDP2's method. ``True`` (the default) is accepted; so is ``False`` for a unit whose
        weights stay replicated (``no_shard``/``optim``/``optim_grads``: its backward gathers
        nothing anyway). A ZeRO-3 unit's backward always gathers: ``False`` is refused there."""
        if _check_bool("unshard_in_backward", unshard_in_backward):
            return
        if any(g.strategy.shards_model_weights for g in self._own_state().groups):
            raise refuse("set_unshard_in_backward")

    def _set_unshard_async_op(self, async_op: bool) -> None:
        raise refuse("_set_unshard_async_op")

    def _get_fsdp_state(self) -> Any:  # an FSDP2StateView
        """FSDP2's private accessor: a :class:`FSDP2StateView` with the one attribute torch's
        pipelining reads, refusing every other."""
        return FSDP2StateView(self._own_state())


class FSDP2StateView:
    """What ``_get_fsdp_state()`` returns on our units. torch 2.15's pipeline schedules read
    ``_comm_ctx`` of each stage's state, with ``defer_reduce_grad_wait=True``, to check that
    no two stages share FSDP2's communication context (``share_comm_ctx``), so that one
    stage's reduction in flight never waits behind another's; ours never share one (each
    unit's collectives are its own), so it is the unit's state, distinct per unit. Any other
    attribute raises ``NotImplementedError`` naming the alternative."""

    __slots__ = ("_comm_ctx",)

    def __init__(self, state: FSDPState) -> None:
        self._comm_ctx = state

    def __getattr__(self, name: str) -> Any:
        raise NotImplementedError(
            f"FSDPModule._get_fsdp_state().{name} is not supported by "
            f"megatron_fsdp_v2.fully_shard: {NO_FSDP2_STATE}"
        )


# torch 2.15 declares the handle type (its pipeline stages annotate ours with it); before, none.
_TorchGradientReductionHandle: type = getattr(
    torch.distributed.fsdp, "GradientReductionHandle", object
)


class GradientReductionHandle(_TorchGradientReductionHandle):
    """What :meth:`FSDP2Surface.finalize_backward` returns with ``async_op=True``: its
    :meth:`wait` finishes the finalization (waits for the window ends, installs the
    gradients, reshards)."""

    def __init__(self, ctx: FSDPContext | None, finalization: Deferred | None) -> None:
        self._ctx = ctx
        self._finalization = finalization

    def wait(self) -> None:
        """Finish the finalization; later calls do nothing. ``RuntimeError`` if
        ``reset_iter_state()`` (or the recovery after a failed step) dropped it first, as in
        FSDP2."""
        ctx, finalization = self._ctx, self._finalization
        self._ctx = self._finalization = None
        if ctx is None or finalization is None:
            return
        if ctx.finalization is not finalization:
            if finalization.holds_temporary:  # dropped unfinished by recovery
                raise RuntimeError(
                    "this gradient reduction handle was invalidated by reset_iter_state() (or "
                    "the recovery after a failed step): its gradients were discarded"
                )
            return  # finished already: by an optimizer step, zero_grad or the next forward
        finalization.finish()  # clears ctx.finalization
