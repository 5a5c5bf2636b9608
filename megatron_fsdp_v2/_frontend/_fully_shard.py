"""The user entry point, ``fully_shard``: one readable sequence of steps. Argument validation is in
``_wrap_options.py`` (over the checks of ``_wrap_checks.py``), the wiring of one call in
``_wiring.py``, and the methods a wrapped module gains in ``_fsdp_module.py``
(``FSDPModule``); buffers live in ``_runtime/_flat_param_group.py`` and hooks in
``_runtime/_state.py``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .. import _torch_patches
from .._runtime._memory import MemoryReport, memory_report
from ..api import MixedPrecisionPolicy, ShardingStrategy
from ._fsdp_module import FSDPModule, UnshardHandle
from ._module_lists import resolve_modules_argument
from ._policies import CommPolicy, FlatOptions, InitPolicy, ShardingPolicy, flat_options
from ._wiring import (
    add_whole_mesh_process_group,
    broadcast_buffers,
    build_groups,
    install_unit,
    make_process_groups,
)
from ._wrap_options import check_same_unit_everywhere, inspect_unit, parse_options

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is 3.11+; the package supports 3.10

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
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    dp_mesh_dims: Any | None = None,
    comm_policy: CommPolicy | None = None,
    sharding_policy: ShardingPolicy | None = None,
    init_policy: InitPolicy | None = None,
    **flat: Unpack[FlatOptions],
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
            flat group and iteration of N micro-batches (marked with
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
        shard_placement_fn: FSDP2's argument, called once per parameter of the unit: ``None``
            or ``Shard(0)`` are accepted (every parameter is sharded by rows); another
            placement raises ``NotImplementedError`` naming the parameter.
        dp_mesh_dims: FSDP2's argument: a ``torch.distributed.fsdp.DataParallelMeshDims``
            naming the data-parallel dims of ``mesh``, one SPMD mesh of all parallelisms
            (torchtitan's default). ``shard`` dims (several are flattened into one) are the
            mesh sharded over; with ``replicate`` dims too, the 2-D HSDP mesh (replicate,
            shard). The mesh's other dims must have size 1 for now (``NotImplementedError``
            otherwise); ``replicate`` alone raises ``NotImplementedError`` naming the
            ``no_shard`` equivalent. Parameters may be plain tensors.
        comm_policy: a :class:`CommPolicy`: how the unit's collectives run (``overlap``,
            ``timeout``, ``collective_impl``, ``reduce_bucket_size_mb``,
            ``refresh_bucket_size_mb``, ``enable_trace_pool``) and what its gradient reduction
            computes (``gradient_scaling_factor``). ``None``: every field's default.
        sharding_policy: a :class:`ShardingPolicy`: the layout beyond ``sharding_strategy``
            (``outer_dp_sharding_strategy`` of a 2-D HSDP mesh, ``max_padding_ratio``).
        init_policy: an :class:`InitPolicy`: how the unit starts (``sync_module_states``,
            ``param_init_fn``) and whether its arguments are checked across ranks
            (``check_ranks``).
        **flat: each field of the three policies is also accepted as a keyword of its own name
            (``fully_shard(m, overlap=False)`` is ``fully_shard(m,
            comm_policy=CommPolicy(overlap=False))``); a field given both as a keyword and
            through its policy raises ``TypeError`` naming both (see [Note: grouped and flat
            options] in ``_policies.py``).

    Coming from FSDP2: ``reshard_after_forward``, FSDP2's ``MixedPrecisionPolicy`` (with
    ``output_dtype``) and ``offload_policy`` (see above) are accepted; FSDP2's methods
    ``set_reshard_after_forward``, ``set_reshard_after_backward``,
    ``set_modules_to_forward_prefetch``, ``set_modules_to_backward_prefetch`` and
    ``set_requires_gradient_sync`` are on :class:`FSDPModule`; after the first call,
    ``torch.nn.utils.clip_grad_norm_`` on these parameters runs
    ``megatron_fsdp_v2.clip_grad_norm_``. ``fully_shard([m1, m2])`` makes one unit of several
    modules, as FSDP2 (returns the list; each module becomes ``FSDP<Class>``): one flat
    group, gathered before whichever member runs first, reduced after the backward of every
    call of every member (see [Note: several modules as one unit]).

    Invalid arguments raise ``TypeError``/``ValueError`` before any collective, leaving
    ``module`` untouched. An invalid parameter found on some ranks only (with ``check_ranks``)
    is shared in the cross-rank check, so every rank raises the same error promptly.
    """
    _torch_patches.check_torch_version()  # before anything changes (see design.md)
    # Grouped options as the flat keywords the rest of the call reads (see [Note: grouped and
    # flat options] in _policies.py); raises before anything changes.
    grouped = flat_options({"comm_policy": comm_policy, "sharding_policy": sharding_policy,
                            "init_policy": init_policy}, dict(flat))
    arg_module = module
    # A list of modules is one unit over an internal holder of them (see [Note: several
    # modules as one unit] in _module_lists.py).
    module, members = resolve_modules_argument(module)
    options = parse_options(
        module, mesh=mesh, sharding_strategy=sharding_strategy,
        reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
        offload_policy=offload_policy, dp_mesh_dims=dp_mesh_dims, **grouped,
    )
    unit = inspect_unit(module, options, ignored_params, shard_placement_fn)
    process_groups = make_process_groups(options, unit)
    check_same_unit_everywhere(module, options, unit, process_groups.checked_axes(options))
    # after the check: see its docstring
    process_groups = add_whole_mesh_process_group(options, process_groups)
    flat_groups, allocator = build_groups(module, options, unit, process_groups)
    if options.sync_module_states:
        broadcast_buffers(module, process_groups)
    install_unit(module, options, unit, flat_groups, allocator, members)  # the first change
    return arg_module  # type: ignore[return-value]
