"""The user entry point: ``fully_shard`` and the ``FSDPModule`` mixin. Validation and wiring only;
buffers live in ``_flat_param_group.py`` and hooks in ``_state.py``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .. import _registry, _torch_patches
from .._buffers._allocator import BucketAllocator
from .._buffers._layout import build_layout, split_for_padding
from .._comm._collective_impl import CollectiveCount, merge_counts, parse_collective_impl
from .._comm._collectives import broadcast_from_first
from .._comm._comm_groups import DEFAULT_TIMEOUT, comm_group, mesh_comm_group
from .._dtensor import _state_dict
from .._dtensor._uneven_meshes import register_mesh
from .._init import _materialize
from .._runtime._coalesce import validate_bucket_size
from .._runtime._context import TrainingState
from .._runtime._flat_param_group import FlatParamGroup, mesh_device
from .._runtime._memory import MemoryReport, memory_report
from .._runtime._optimizer_hooks import note_wrap
from .._runtime._slots import owned_modules
from .._runtime._state import FSDPState
from ..api import MixedPrecisionPolicy, ShardingStrategy
from . import _fsdp2_compat
from ._mesh import parse_outer_strategy, validate_mesh
from ._wrap_checks import (
    check_mesh_agrees,
    check_module,
    check_param_init_fn,
    collect_managed_params,
    raise_on_every_rank,
    unit_signature,
    validate_options,
    warn_if_padded,
)

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "MemoryReport", "memory_report"]


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` blocks until gathered."""

    def __init__(self, state: FSDPState | None) -> None:
        self._state = state

    def wait(self) -> None:
        if self._state is not None:
            self._state.wait_for_unshard()
            self._state = None


class FSDPModule:
    """Mixin added to the class of every module passed to :func:`fully_shard`."""

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
        return [s for m in self.modules() if (s := _registry.state_of(m)) is not None]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather (ZeRO-3) or refresh (ZeRO-1/2) this unit's compute weights ahead of use.
        With ``async_op=True`` returns a handle; the next forward waits on it anyway."""
        state = _registry.state_of(self)  # type: ignore[arg-type]
        assert state is not None
        state.unshard(async_op=async_op)
        if async_op:
            return UnshardHandle(state)
        state.wait_for_unshard()
        return None

    def reshard(self) -> None:
        """Free this unit's gathered weights (ZeRO-3; no-op for replicated strategies)."""
        state = _registry.state_of(self)  # type: ignore[arg-type]
        assert state is not None
        state.reshard()

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
        later backward. ``recurse=False`` applies to this unit only."""
        states = self._mfsdp_states() if recurse else [_registry.state_of(self)]  # type: ignore[arg-type]
        for state in states:
            if state is not None:
                state.is_last_backward = bool(requires_gradient_sync)

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
            _fsdp2_compat.parse_reshard_after_forward(
                reshard_after_forward, ShardingStrategy.OPTIM_GRADS_PARAMS
            )
        for state in self._unit_states(recurse):
            state.reshard_after_forward = reshard_after_forward

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

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """FSDP2's method: at this unit's pre-forward, start the all-gathers of ``modules``
        (instead of the next unit in the recorded forward order). Their own forwards then find
        the weights gathered. An empty list prefetches nothing. Applies with ``overlap=True``
        (``overlap=False`` prefetches nothing); ZeRO-1/2 units have nothing to prefetch."""
        states = self._prefetch_states(modules, "set_modules_to_forward_prefetch")
        state = _registry.state_of(self)  # type: ignore[arg-type]
        assert state is not None
        state.forward_prefetch = states

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
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
        temporary buckets are in use (inside an accumulation window that keeps buckets across
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
        """The collectives this unit and the units below it issued for their parameter groups
        (gathers, refreshes, gradient reductions) since wrapping or the last reset, on this
        rank: ``{(logical, issued): CollectiveCount(calls, ops, bytes)}``. ``logical`` is what
        the schedule names (``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``),
        ``issued`` what ran for it (the same under ``collective_impl="native"``; under
        ``"auto"`` e.g. ``("reduce_scatter", "all_reduce")`` or ``("all_gather",
        "broadcast")``, with ``ops`` the broadcasts issued). Collectives outside the step's
        schedule (wrap-time broadcasts, clipping's norm all-reduce, checkpoints) are not
        counted. ``reset=True`` clears the counts after reading them."""
        groups = [group for state in self._mfsdp_states() for group in state.groups]
        counts = merge_counts([group.collectives.counts for group in groups])
        if reset:
            self.reset_collective_stats()
        return counts

    def reset_collective_stats(self) -> None:
        """Clear the counts :meth:`collective_stats` reports, for this unit and those below."""
        for state in self._mfsdp_states():
            for group in state.groups:
                group.collectives.reset()

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
        (see [Note: conversions after wrapping] in ``_materialize.py``).

        Managed parameters keep their flat buffers: a conversion that returns them unchanged (a
        ``.to`` to the device and dtype they already have) or returns new values of the same
        dtype, device and layout (``.to_empty(device=<their device>)``) is applied through the
        buffers (values copied into this rank's main weights, compute weights refreshed before
        the next forward; ``to_empty`` also cancels a pending meta-device initialization: the
        caller initializes). Any other change (dtype, device) raises ``NotImplementedError``
        before anything changes. Buffers and ignored parameters convert as usual."""
        assert isinstance(self, nn.Module)
        if _materialize.applying():  # a unit above handles this subtree's parameters
            return super()._apply(fn, recurse)  # type: ignore[misc]
        if recurse:
            states = self._mfsdp_states()
        else:
            own = _registry.state_of(self)
            states = [own] if own is not None else []
        to_copy: list[tuple[FlatParamGroup, int]] = []
        for state in states:
            for group in state.groups:
                for index, (fqn, dist_param) in enumerate(zip(group.fqns, group.dist_params)):
                    verdict = _materialize.classify(fn, dist_param)
                    if verdict is None:
                        raise NotImplementedError(
                            f"{type(self).__name__}: converting or moving parameters after "
                            f"fully_shard is not supported (parameter '{fqn}' would change "
                            f"dtype or device from {dist_param.dtype} on {group.device}); "
                            "nothing was changed. Call .to(device/dtype), .bfloat16(), "
                            ".double() before fully_shard (to_empty(device=...) after it only "
                            f"to {group.device}), and use MixedPrecisionPolicy(param_dtype=...) "
                            "for compute in another dtype"
                        )
                    if verdict == "copy":
                        to_copy.append((group, index))
        # Every parameter can take the conversion: only now does anything change.
        for group, index in to_copy:
            _materialize.copy_converted(fn, group, index)
            group.mark_main_weights_updated()
        if to_copy:
            for state in states:
                _materialize.mark_initialized_by_user(state.module)
        # Managed parameters stay as they are: hide them from nn.Module._apply, then put them
        # back in their slots' original order (parameters() order is the optimizer's).
        hidden: list[tuple[dict[str, Any], list[str], dict[str, Any]]] = []
        for state in states:
            for parameters, mapping in state.slots.dist_registration:
                order = list(parameters)
                popped = {name: parameters.pop(name) for name in mapping if name in parameters}
                if popped:
                    hidden.append((parameters, order, popped))
        try:
            with _materialize.applying_conversion():
                return super()._apply(fn, recurse)  # type: ignore[misc]
        finally:
            for parameters, order, popped in reversed(hidden):
                rest = dict(parameters)
                parameters.clear()
                for name in order:
                    parameters[name] = popped[name] if name in popped else rest.pop(name)
                parameters.update(rest)


def _fsdp_class(cls: type) -> type:
    if cls not in _registry.fsdp_classes:
        _registry.fsdp_classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _registry.fsdp_classes[cls]


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    sharding_strategy: ShardingStrategy | str | int = "optim_grads_params",
    reshard_after_forward: bool | None = None,
    mp_policy: MixedPrecisionPolicy | Any | None = None,
    offload_policy: Any | None = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
    gradient_scaling_factor: float | None = None,
    max_padding_ratio: float = 0.01,
    check_ranks: bool = True,
    overlap: bool = True,
    timeout: timedelta | float | None = DEFAULT_TIMEOUT,
    sync_module_states: bool = True,
    outer_dp_sharding_strategy: ShardingStrategy | str | int = "no_shard",
    param_init_fn: Callable[[nn.Module], None] | None = None,
    enable_trace_pool: bool = False,
    collective_impl: str = "native",
    reduce_bucket_size_mb: float | None = None,
    refresh_bucket_size_mb: float | None = None,
) -> FSDPModule:
    """Shard ``module``'s parameters, gradients and/or optimizer state over a data-parallel mesh.

    Wrap children first (e.g. each transformer block), then the root, as with PyTorch FSDP2's
    ``fully_shard``. Each call makes one *unit*: the module's parameters minus those of wrapped
    submodules, grouped by (device, dtype, requires_grad) into row-aligned flat buffers.
    ``module`` is changed in place (its class becomes ``FSDP<Class>``, a subclass of
    :class:`FSDPModule` and the original class) and returned. Build the optimizer afterwards:
    ``module.parameters()`` are then DTensor parameters (``Shard(0)``, uneven; ``Replicate()``
    for ``no_shard``) viewing persistent flat buffers, and their gradients are DTensors too.

    Args:
        mesh: 1-D ``DeviceMesh``; default: the whole world on ``cuda`` when the default group
            has a CUDA backend of its own (NCCL, however named: ``"nccl"``, ``"cuda:nccl"``,
            ``"cpu:gloo,cuda:nccl"``, no backend on a GPU machine), else ``cpu`` (gloo).
            Or a 2-D mesh with dimension names for HSDP, e.g. ``init_device_mesh("cuda", (R, S),
            mesh_dim_names=("replicate", "shard"))`` (other names are taken by position): dim 0
            is the outer (replicate) axis, dim 1 the inner (shard) axis.
        sharding_strategy: ``"no_shard"`` (0), ``"optim"`` (1), ``"optim_grads"`` (2) or
            ``"optim_grads_params"`` (3), over the mesh (the inner axis of a 2-D mesh). Per
            parameter group and iteration of N micro-batches (marked with
            ``set_is_last_backward``/``no_sync``) they issue 1 all-reduce; 1 all-gather + 1
            reduce-scatter; 1 all-gather + N reduce-scatters; 2N all-gathers + N
            reduce-scatters.
        reshard_after_forward: FSDP2's argument. ``None`` or ``True``: the strategy's
            schedule. ``False`` (``optim_grads_params`` only; other strategies never reshard,
            so it changes nothing there): keep this unit's gathered weights from its forward
            to its backward, which then gathers nothing: N all-gathers + N reduce-scatters per
            window of N micro-batches instead of 2N + N, for the memory of the gathered
            weights between forward and backward. Forwards without grad mode still free them.
            ``True`` with another strategy raises ``ValueError``; an ``int`` (FSDP2: reshard
            to a smaller group) ``NotImplementedError``. See also
            :meth:`FSDPModule.set_reshard_after_forward`.
        mp_policy: dtypes of compute weights, main weights, grads and reduction, and of the
            unit's outputs: a :class:`MixedPrecisionPolicy`, or FSDP2's
            ``torch.distributed.fsdp.MixedPrecisionPolicy`` (converted with
            ``MixedPrecisionPolicy.from_fsdp2``: FSDP2 reduces in ``param_dtype`` when
            ``reduce_dtype`` is unset).
        offload_policy: FSDP2's argument; only ``None`` or ``OffloadPolicy()`` (no offload).
            ``CPUOffloadPolicy`` raises ``NotImplementedError``: CPU offload is not supported.
        ignored_params: parameters left as plain, unmanaged ``nn.Parameter`` s.
        gradient_scaling_factor: ``None`` averages gradients over the mesh (DDP/FSDP2); a number
            sums them and multiplies by it (Megatron-FSDP).
        max_padding_ratio: split a group into several buckets when row alignment would pad it
            by more than this fraction.
        check_ranks: verify with one small all-gather that every rank wraps the same module
            with the same arguments.
        overlap: prefetch all-gathers (next unit in forward, previous in backward, in the
            order recorded in the first forward), launch every ZeRO-1/2 refresh at the start
            of forward, and run gradient reductions in the background. ``False`` runs every
            collective synchronously (same numbers, for debugging). The root's value applies
            to the whole tree.
        timeout: limit of each of the library's collectives (``timedelta`` or seconds; default
            5 minutes): if a rank fails and leaves the others waiting in a collective, they raise
            after this long instead of hanging. They run on the mesh's group when it has this
            timeout already, else on a group over the mesh's ranks created with it (one per
            distinct value; split from the mesh's group when the default group is bound to a
            device). ``None``: the mesh's own group and its timeout.
        sync_module_states: start every rank from the mesh's first rank's parameters and
            buffers (one broadcast per parameter group, and one per buffer; per mesh axis on a
            2-D mesh), as DDP does at construction; this applies to every strategy, ZeRO-3
            included. ``False`` keeps each rank's own values: only safe when every rank built
            identical weights (same seed), else replicas silently train different models.
        outer_dp_sharding_strategy: the strategy along the outer axis of a 2-D (HSDP) mesh.
            ``"no_shard"`` (the default): every replica keeps the inner schedule and all-reduces
            the reduced gradient shard over the outer axis once per accumulation window;
            gradients are averaged over all R x S ranks. ``"optim"`` (inner
            ``"optim_grads_params"`` only, else ``ValueError``): main weights, gradients and
            optimizer state are sharded over all R x S ranks (DTensors ``(Shard(0), Shard(0))``);
            each window ends with one outer reduce-scatter of the inner-reduced shard, and
            after the step one outer all-gather rebuilds the inner shard before the inner
            gathers. With a 1-D mesh only ``"no_shard"`` is accepted.
        param_init_fn: for a module built under ``torch.device("meta")``: ``fn(module)``
            initializes ``module``'s own parameters and buffers in place (FSDP1's name),
            called instead of ``module.reset_parameters()`` on every module holding a meta
            parameter or buffer when the model is materialized (first forward, or the first
            state-dict or checkpoint call), in module order of the whole tree, each rank keeping
            its own rows only; see README "Large models". Without it, every such module needs
            ``reset_parameters()``. Every rank must use the same seed (nothing is broadcast).
        enable_trace_pool: serve temporary buckets (ZeRO-3's gathered weights, reduce-scatter
            inputs, communication workspaces) from one persistent arena per device, planned
            from the lifetimes recorded in the first iteration, instead of allocating and
            freeing them each time: every bucket keeps its address across iterations (what CUDA
            graphs need), for an arena as large as the planned peak held between steps. A
            changed trace (new shapes or control flow) is served outside the arena and planned
            at the next iteration; see README "Trace-planned pool" and
            :meth:`FSDPModule.release_memory_pool`. Same numbers as ``False`` (the default).
            Every unit of a tree must pass the same value (``ValueError`` at the first forward).
        collective_impl: ``"native"`` (default) issues each collective above as itself
            (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``).
            ``"auto"`` issues, per backend, buffer size and group size, an equivalent measured
            faster on that backend, with no extra memory and bitwise the same results: on gloo
            a reduce-scatter of a buffer of 1 MiB or more as an in-place all-reduce of its
            input bucket, an all-gather of 4 MiB or more as one broadcast per rank into
            place; on NCCL (and other backends) the native ones.
            Applies to this unit's groups (each unit follows its own setting).
            :meth:`FSDPModule.collective_stats` reports what ran. See design.md "Collective
            selection".
        reduce_bucket_size_mb: ``None`` (the default): one delayed gradient collective per
            parameter group per window. A size in MiB (DDP's ``bucket_cap_mb``): ``no_shard``
            and ``optim`` coalesce the delayed all-reduces / reduce-scatters of consecutive
            groups, in backward order, into one collective per bucket of at most this size
            (plus the remainder at the end of backward), through a temporary bucket of that
            size; bitwise the same gradients (``no_shard`` on 3+ gloo ranks: up to the
            summation order, as DDP's buckets). Worth it for many small units, whose
            per-collective launch cost dominates. ``optim_grads``/``optim_grads_params`` are
            unaffected; ``overlap=False`` runs every reduction at once, uncoalesced. Every unit
            of a model must pass the same value (``ValueError`` at the first forward); a 2-D
            (HSDP) mesh raises ``NotImplementedError``. See README "Many small units".
        refresh_bucket_size_mb: ``None`` (the default): one all-gather per parameter group
            rebuilds the replicated compute weights after each optimizer step (``optim``,
            ``optim_grads``). A size in MiB (DeepSpeed's ``allgather_bucket_size``): those
            all-gathers of consecutive groups, in forward order, run as one per bucket of at
            most this size (gathered bytes), through temporary buckets (at most two alive);
            bitwise the same weights. Worth it for many small units. ``no_shard`` and
            ``optim_grads_params`` are unaffected. Every unit of a model must pass the same
            value (``ValueError`` at the first forward); a 2-D (HSDP) mesh raises
            ``NotImplementedError``. See README "Many small units".

    Coming from FSDP2: ``reshard_after_forward``, FSDP2's ``MixedPrecisionPolicy`` (with
    ``output_dtype``) and ``offload_policy=OffloadPolicy()`` are accepted; FSDP2's methods
    ``set_reshard_after_forward``, ``set_reshard_after_backward``,
    ``set_modules_to_forward_prefetch``, ``set_modules_to_backward_prefetch`` and
    ``set_requires_gradient_sync`` are on :class:`FSDPModule`; after the first call,
    ``torch.nn.utils.clip_grad_norm_`` on these parameters runs
    ``megatron_fsdp_v2.clip_grad_norm_``. ``fully_shard([m1, m2])`` (several modules as one
    unit) raises ``NotImplementedError``: wrap a module containing them.

    Invalid arguments raise ``TypeError``/``ValueError`` before any collective, leaving
    ``module`` untouched. An invalid parameter found on some ranks only (with ``check_ranks``)
    is shared in the cross-rank check, so every rank raises the same error promptly.
    """
    _torch_patches.check_torch_version()  # before anything changes (see design.md)
    _fsdp2_compat.check_modules_argument(module)
    check_module(module)
    if isinstance(module, FSDPModule) or _registry.state_of(module) is not None:
        raise ValueError(
            f"{type(module).__name__} is already wrapped by fully_shard; wrap each module once "
            "(children first, then the root)"
        )
    strategy = ShardingStrategy.parse(sharding_strategy)
    outer_strategy = parse_outer_strategy(outer_dp_sharding_strategy)
    mp_policy = _fsdp2_compat.convert_mp_policy(mp_policy)
    _fsdp2_compat.check_offload_policy(offload_policy)
    reshard = _fsdp2_compat.parse_reshard_after_forward(reshard_after_forward, strategy)
    timeout = validate_options(gradient_scaling_factor, max_padding_ratio, timeout)
    if not isinstance(enable_trace_pool, bool):
        raise TypeError(
            f"enable_trace_pool must be a bool, got {type(enable_trace_pool).__name__}"
        )
    check_param_init_fn(param_init_fn)
    collective_impl = parse_collective_impl(collective_impl)
    reduce_bucket_size_mb = validate_bucket_size(reduce_bucket_size_mb)
    refresh_bucket_size_mb = validate_bucket_size(refresh_bucket_size_mb,
                                                  "refresh_bucket_size_mb")
    axes = validate_mesh(mesh, outer_strategy, strategy)
    if reduce_bucket_size_mb is not None and axes.outer is not None:
        raise NotImplementedError(
            "reduce_bucket_size_mb with a 2-D (HSDP) mesh is not supported: the window's outer "
            "reductions are per group. Pass reduce_bucket_size_mb=None, or use a 1-D mesh"
        )
    if refresh_bucket_size_mb is not None and axes.outer is not None:
        raise NotImplementedError(
            "refresh_bucket_size_mb with a 2-D (HSDP) mesh is not supported: the refresh runs "
            "over both axes per group. Pass refresh_bucket_size_mb=None, or use a 1-D mesh"
        )
    mesh = axes.mesh
    # Checks of what this rank holds (its parameters) may fail on one rank only. With
    # check_ranks, the failure is shared in the cross-rank check below, so that every rank
    # raises the same error at once instead of the others waiting for the timeout.
    local_error: TypeError | ValueError | None = None
    meta_init = False
    try:
        managed = collect_managed_params(module, mesh, ignored_params)
        meta_init = _materialize.has_meta_state(module)
        dtypes_by_param = [mp_policy.resolve(m.param.dtype) for m in managed]
    except (TypeError, ValueError) as e:
        if not check_ranks or mesh.size() == 1:
            raise
        local_error = e
    replicas = axes.outer.size() if axes.outer is not None else 1
    outer_optim = replicas > 1 and outer_strategy is ShardingStrategy.OPTIM
    # The first collectives: create (once) the timeout groups (inner axis first), then agree
    # across ranks, over each axis (which covers the whole mesh).
    try:
        process_group = comm_group(axes.inner, timeout)
        outer_group = comm_group(axes.outer, timeout, "outer") if axes.outer is not None else None
        # HSDP outer optim: every rank holds a distinct sub-shard, so gradient norms are
        # all-reduced over the whole mesh (one group, not one all-reduce per axis).
        mesh_group = mesh_comm_group(mesh, timeout) if outer_optim else None
    except Exception:
        if local_error is not None:  # e.g. a mesh of another device type, never initialized
            raise local_error from None
        raise
    checked_axes: list[tuple[DeviceMesh, dist.ProcessGroup | None]] = [
        (axes.inner, process_group)
    ]
    if axes.outer is not None:
        checked_axes.append((axes.outer, outer_group))
    if local_error is not None:
        raise_on_every_rank(local_error, checked_axes)
    if check_ranks:
        extra: dict[str, Any] = {}
        if axes.outer is not None:  # 1-D signatures stay as they were
            extra["mesh"] = f"{tuple(mesh.shape)} {mesh.mesh_dim_names}"
            extra["outer_dp_sharding_strategy"] = outer_strategy.value
        if meta_init:  # signatures of models built on a device stay as they were
            extra["meta_init"] = "param_init_fn" if param_init_fn is not None else "reset"
        if not reshard:  # signatures of the default schedule stay as they were
            extra["reshard_after_forward"] = reshard
        if collective_impl != "native":  # ranks must pair the same calls
            extra["collective_impl"] = collective_impl
        if reduce_bucket_size_mb is not None:  # likewise
            extra["reduce_bucket_size_mb"] = reduce_bucket_size_mb
        if refresh_bucket_size_mb is not None:  # likewise
            extra["refresh_bucket_size_mb"] = refresh_bucket_size_mb
        signature = unit_signature(
            module, managed, strategy, mp_policy, gradient_scaling_factor, timeout=timeout,
            max_padding_ratio=max_padding_ratio, overlap=overlap,
            sync_module_states=sync_module_states, **extra,
        )
        check_mesh_agrees(signature, checked_axes)

    # The layout's: shards over the inner axis, or R * S sub-shards with outer optim (inner
    # shard s is sub-shards [s * R, (s + 1) * R); see [Note: buffer plan]).
    world_size = axes.inner.size() * (replicas if outer_optim else 1)
    # Averaging is over every rank of the mesh (R x S on a 2-D mesh).
    pre_scale = (
        float(gradient_scaling_factor) if gradient_scaling_factor is not None
        else 1.0 / mesh.size()
    )
    # Group by (device, dtype, requires_grad), in first-seen order.
    buckets: dict[tuple[Any, ...], list[int]] = {}
    for i, m in enumerate(managed):
        buckets.setdefault((m.param.device, m.param.dtype, m.param.requires_grad), []).append(i)
    allocator = BucketAllocator()
    groups: list[FlatParamGroup] = []
    for members in buckets.values():
        shapes = [managed[i].param.shape for i in members]
        for split in split_for_padding(shapes, world_size, max_padding_ratio):
            indices = [members[j] for j in split]
            layout = build_layout([managed[i].param.shape for i in indices], world_size)
            warn_if_padded(layout, [managed[i].fqn for i in indices], max_padding_ratio)
            groups.append(
                FlatParamGroup(
                    group_id=(id(module), len(groups)),
                    params=[managed[i].param for i in indices],
                    fqns=[managed[i].fqn for i in indices],
                    layout=layout,
                    mesh=mesh,
                    process_group=process_group,
                    outer_process_group=outer_group,
                    mesh_process_group=mesh_group,
                    strategy=strategy,
                    outer_strategy=outer_strategy,
                    dtypes=dtypes_by_param[indices[0]],
                    grad_pre_scale=pre_scale,
                    allocator=allocator,
                    sync_from_rank0=sync_module_states,
                    collective_impl=collective_impl,
                )
            )
    if sync_module_states:
        # Outer axis first, then the inner one: every rank gets mesh rank (0, 0)'s buffers.
        for axis_group in (outer_group, process_group):
            if axis_group is not None and dist.get_world_size(axis_group) > 1:
                _broadcast_buffers(module, axis_group)
    # Every group is built: only now are the module's parameters changed (FlatParamGroup.bind).
    if meta_init:
        _materialize.adopt_meta_unit(module, groups, mesh_device(mesh), param_init_fn)
    owner = f"{type(module).__name__} at 0x{id(module):x}"
    for group in groups:
        group.bind()
        group.owner = owner
        _registry.register_records(group.records)
    state = FSDPState(module, groups, mp_policy, allocator)
    state.overlap = overlap
    state.reduce_bucket_size_mb = reduce_bucket_size_mb
    state.refresh_bucket_size_mb = refresh_bucket_size_mb
    state.reshard_after_forward = reshard
    state.enable_trace_pool = enable_trace_pool
    _registry.set_state(module, state)
    register_mesh(mesh, outer_optim=outer_optim)  # DTensor redistribution of uneven shards
    _torch_patches.install_all()  # once; see _torch_patches/__init__.py for the list
    state.register_dist_params()
    module.register_load_state_dict_post_hook(_mark_loaded)
    # Sharded state dicts: chunk metadata for DCP, full-tensor/shape handling on load.
    module.register_state_dict_post_hook(_state_dict.state_dict_post_hook)
    module.register_load_state_dict_pre_hook(_state_dict.load_state_dict_pre_hook)
    if meta_init:  # values before anything reads or writes them (see _materialize.py)
        module.register_state_dict_pre_hook(_materialize.materialize_hook)
        module.register_load_state_dict_pre_hook(_materialize.materialize_hook)
    module.__class__ = _fsdp_class(type(module))
    note_wrap()  # optimizer step hooks (first wrap); optimizers cached before are checked again
    return module  # type: ignore[return-value]


def _broadcast_buffers(module: nn.Module, process_group: Any) -> None:
    """Buffers of this unit (not of wrapped children, which did their own) from the mesh's
    first rank, as DDP does with module states."""
    for _, submodule in owned_modules(module):
        for buffer in submodule._buffers.values():
            # A meta buffer has no value yet; every rank materializes it alike.
            if buffer is not None and buffer.numel() > 0 and buffer.device.type != "meta":
                broadcast_from_first(buffer, process_group)


def _mark_loaded(module: nn.Module, incompatible_keys: Any) -> None:
    """A checkpoint load wrote the main weights: refresh compute weights before the next use."""
    state = _registry.state_of(module)
    if state is not None:
        for group in state.groups:
            group.mark_main_weights_updated()
