"""The user entry point, ``fully_shard``: one readable sequence of steps. Argument validation is in
``_wrap_options.py`` (over the checks of ``_wrap_checks.py``), the wiring of one call in
``_wiring.py``, and the methods a wrapped module gains in ``_fsdp_module.py``
(``FSDPModule``); buffers live in ``_runtime/_flat_param_group.py`` and hooks in
``_runtime/_state.py``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .. import _torch_patches
from .._comm._comm_groups import DEFAULT_TIMEOUT
from .._runtime._memory import MemoryReport, memory_report
from ..api import MixedPrecisionPolicy, ShardingStrategy
from ._fsdp_module import FSDPModule, UnshardHandle
from ._module_lists import resolve_modules_argument
from ._wiring import (
    add_whole_mesh_group,
    broadcast_buffers,
    build_groups,
    install_unit,
    make_process_groups,
)
from ._wrap_options import check_same_unit_everywhere, inspect_unit, parse_options

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "MemoryReport", "memory_report"]


def fully_shard(
    module: nn.Module | list[nn.Module],
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
    dp_mesh_dims: Any | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
) -> FSDPModule:
    """Shard ``module``'s parameters, gradients and/or optimizer state over a data-parallel mesh.

    Wrap children first (e.g. each transformer block), then the root, as with PyTorch FSDP2's
    ``fully_shard``. Each call makes one *unit*: the module's parameters minus those of wrapped
    submodules, grouped by (device, dtype, requires_grad) into row-aligned flat buffers.
    ``module`` is changed in place (its class becomes ``FSDP<Class>``, a subclass of
    :class:`FSDPModule`, itself a ``torch.distributed.fsdp.FSDPModule``, and the original
    class) and returned. Build the optimizer afterwards:
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
        offload_policy: FSDP2's argument: ``None`` or ``OffloadPolicy()`` (no offload), or
            ``CPUOffloadPolicy(pin_memory=...)`` with ``sharding_strategy=
            "optim_grads_params"`` on a CPU mesh, where every buffer already is host memory
            (accepted, no copy made). Other strategies, and CUDA meshes (host copies around
            the collectives not implemented), raise ``NotImplementedError``.
        ignored_params: parameters left as plain, unmanaged ``nn.Parameter`` s.
        gradient_scaling_factor: ``None`` averages gradients over the mesh (DDP/FSDP2); a number
            sums them and multiplies by it (Megatron-FSDP). FSDP2's
            ``set_gradient_divide_factor(f)`` later sets ``1/f`` for one unit.
        max_padding_ratio: split a group into several flat groups when row alignment would pad it
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
        enable_trace_pool: serve scratch buffers (ZeRO-3's gathered weights, reduce-scatter
            inputs, communication workspaces) from one persistent arena per device, planned
            from the lifetimes recorded in the first iteration, instead of allocating and
            freeing them each time: every scratch buffer keeps its address across iterations (what
            CUDA graphs need), for an arena as large as the planned peak held between steps. A
            changed trace (new shapes or control flow) is served outside the arena and planned
            at the next iteration; see README "Trace-planned pool" and
            :meth:`FSDPModule.release_memory_pool`. Same numbers as ``False`` (the default).
            Every unit of a tree must pass the same value (``ValueError`` at the first forward).
        collective_impl: ``"native"`` (default) issues each collective above as itself
            (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``).
            ``"auto"`` issues, per backend, buffer size and group size, an equivalent measured
            faster on that backend, with no extra memory and bitwise the same results: on gloo
            a reduce-scatter of a buffer of 1 MiB or more as an in-place all-reduce of its
            input scratch buffer, an all-gather of 4 MiB or more as one broadcast per rank into
            place; on NCCL (and other backends) the native ones.
            Applies to this unit's groups (each unit follows its own setting).
            :meth:`FSDPModule.collective_stats` reports what ran. See design.md "Collective
            selection".
        reduce_bucket_size_mb: ``None`` (the default): one delayed gradient collective per
            parameter group per window. A size in MiB (DDP's ``bucket_cap_mb``): ``no_shard``
            and ``optim`` coalesce the delayed all-reduces / reduce-scatters of consecutive
            groups, in backward order, into one collective per bucket of at most this size
            (plus the remainder at the end of backward), through a scratch buffer of that
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
            most this size (gathered bytes), through scratch buffers (at most two alive);
            bitwise the same weights. Worth it for many small units. ``no_shard`` and
            ``optim_grads_params`` are unaffected. Every unit of a model must pass the same
            value (``ValueError`` at the first forward); a 2-D (HSDP) mesh raises
            ``NotImplementedError``. See README "Many small units".
        dp_mesh_dims: FSDP2's argument: a ``torch.distributed.fsdp.DataParallelMeshDims``
            naming the data-parallel dims of ``mesh``, one SPMD mesh of all parallelisms
            (torchtitan's default). ``shard`` dims (several are flattened into one) are the
            mesh sharded over; with ``replicate`` dims too, the 2-D HSDP mesh (replicate,
            shard). The mesh's other dims must have size 1 for now (``NotImplementedError``
            otherwise); ``replicate`` alone raises ``NotImplementedError`` naming the
            ``no_shard`` equivalent. Parameters may be plain tensors.
        shard_placement_fn: FSDP2's argument, called once per parameter of the unit: ``None``
            or ``Shard(0)`` are accepted (every parameter is sharded by rows); another
            placement raises ``NotImplementedError`` naming the parameter.

    Coming from FSDP2: ``reshard_after_forward``, FSDP2's ``MixedPrecisionPolicy`` (with
    ``output_dtype``) and ``offload_policy`` (see above) are accepted; FSDP2's methods
    ``set_reshard_after_forward``, ``set_reshard_after_backward``,
    ``set_modules_to_forward_prefetch``, ``set_modules_to_backward_prefetch`` and
    ``set_requires_gradient_sync`` are on :class:`FSDPModule`; after the first call,
    ``torch.nn.utils.clip_grad_norm_`` on these parameters runs
    ``megatron_fsdp_v2.clip_grad_norm_``. ``fully_shard([m1, m2])`` makes one unit of several
    modules, as FSDP2 (returns the list; each module becomes ``FSDP<Class>``): one parameter
    group, gathered before whichever member runs first, reduced after the backward of every
    call of every member (see [Note: several modules as one unit]).

    Invalid arguments raise ``TypeError``/``ValueError`` before any collective, leaving
    ``module`` untouched. An invalid parameter found on some ranks only (with ``check_ranks``)
    is shared in the cross-rank check, so every rank raises the same error promptly.
    """
    _torch_patches.check_torch_version()  # before anything changes (see design.md)
    arg_module = module
    # A list of modules is one unit over an internal holder of them (see [Note: several
    # modules as one unit] in _module_lists.py).
    module, members = resolve_modules_argument(module)
    options = parse_options(
        module, mesh=mesh, sharding_strategy=sharding_strategy,
        reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
        offload_policy=offload_policy, gradient_scaling_factor=gradient_scaling_factor,
        max_padding_ratio=max_padding_ratio, check_ranks=check_ranks, overlap=overlap,
        timeout=timeout, sync_module_states=sync_module_states,
        outer_dp_sharding_strategy=outer_dp_sharding_strategy, param_init_fn=param_init_fn,
        enable_trace_pool=enable_trace_pool, collective_impl=collective_impl,
        reduce_bucket_size_mb=reduce_bucket_size_mb,
        refresh_bucket_size_mb=refresh_bucket_size_mb, dp_mesh_dims=dp_mesh_dims,
    )
    unit = inspect_unit(module, options, ignored_params, shard_placement_fn)
    process_groups = make_process_groups(options, unit)
    check_same_unit_everywhere(module, options, unit, process_groups.checked_axes(options))
    process_groups = add_whole_mesh_group(options, process_groups)  # after: see its docstring
    flat_groups, allocator = build_groups(module, options, unit, process_groups)
    if options.sync_module_states:
        broadcast_buffers(module, process_groups)
    install_unit(module, options, unit, flat_groups, allocator, members)  # the first change
    return arg_module  # type: ignore[return-value]
