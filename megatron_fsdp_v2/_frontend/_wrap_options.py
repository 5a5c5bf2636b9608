"""``fully_shard``'s validation steps: its arguments checked and normalized into one
:class:`WrapOptions` before any collective, what this rank would wrap (:class:`LocalUnit`: its
managed parameters, or the error a check of them raised), and the cross-rank check that every
rank wraps the same thing. The checks themselves are in ``_wrap_checks.py``, ``_mesh.py`` and
``_fsdp2_compat.py``; this module decides their order, which is the order users see errors in."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .. import _registry
from .._buffers._plan import layout_world_size, shards_outer_optim
from .._comm._collective_impl import parse_collective_impl
from .._init._materialize import ParamInitFn, has_meta_state
from .._runtime._coalesce import validate_bucket_size
from .._runtime._offload import OffloadConfig
from ..api import MixedPrecisionPolicy, ResolvedDtypes, ShardingStrategy
from . import _fsdp2_compat
from ._fsdp_module import FSDPModule
from ._mesh import (
    MeshAxes,
    parse_outer_strategy,
    resolve_dp_mesh,
    spmd_mesh_of,
    validate_mesh,
)
from ._wrap_checks import (
    ManagedParam,
    check_mesh_agrees,
    check_module,
    check_param_init_fn,
    collect_managed_params,
    raise_on_every_rank,
    unit_signature,
    validate_options,
)

__all__ = ["Axes", "LocalUnit", "WrapOptions", "check_same_unit_everywhere", "inspect_unit",
           "parse_options"]

# (1-D mesh, its process group) of each mesh axis, inner first.
Axes = list[tuple[DeviceMesh, "dist.ProcessGroup | None"]]


@dataclass(frozen=True)
class WrapOptions:
    """The arguments of one ``fully_shard`` call, checked, in the types the wiring uses."""

    axes: MeshAxes
    strategy: ShardingStrategy
    outer_strategy: ShardingStrategy
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool
    gradient_scaling_factor: float | None
    max_padding_ratio: float
    check_ranks: bool
    overlap: bool
    timeout: timedelta | None
    sync_module_states: bool
    param_init_fn: ParamInitFn | None
    enable_trace_pool: bool
    collective_impl: str
    reduce_bucket_size_mb: float | None
    refresh_bucket_size_mb: float | None
    # reshard_after_forward=<int>: the size of the groups weights are resharded to after
    # forward (0: none; see [Note: resharding to a smaller group] in _compute_weights.py).
    post_forward_group_size: int = 0
    # CPUOffloadPolicy given (kept for the cross-rank check), and its copying path's settings
    # (None on a CPU mesh, where it changes no buffer; [Note: CPU offload] in _fsdp2_compat.py).
    cpu_offload: bool = False
    host_offload: OffloadConfig | None = None

    @property
    def mesh(self) -> DeviceMesh:
        return self.axes.mesh

    @property
    def replicas(self) -> int:
        """Ranks along the outer (HSDP replicate) axis; 1 on a 1-D mesh."""
        return self.axes.outer.size() if self.axes.outer is not None else 1

    @property
    def outer_optim(self) -> bool:
        """HSDP with outer ``optim``: every rank of the mesh holds its own sub-shard."""
        return shards_outer_optim(self.outer_strategy, self.replicas)

    @property
    def layout_world_size(self) -> int:
        """How many slots (ranks' spans) the flat groups' layouts are built over (the buffer
        plan decides)."""
        return layout_world_size(self.axes.inner.size(), self.outer_strategy, self.replicas)

    @property
    def grad_pre_scale(self) -> float:
        """The factor gradients are scaled by before their reduction: averaging is over every
        rank of the mesh (R x S on a 2-D mesh), unless a scaling factor was given."""
        if self.gradient_scaling_factor is not None:
            return float(self.gradient_scaling_factor)
        return 1.0 / self.mesh.size()


def parse_options(
    module: nn.Module, *, mesh: DeviceMesh | None, sharding_strategy: Any,
    reshard_after_forward: Any, mp_policy: Any, offload_policy: Any,
    gradient_scaling_factor: Any, max_padding_ratio: Any, check_ranks: bool, overlap: bool,
    timeout: Any, sync_module_states: bool, outer_dp_sharding_strategy: Any,
    param_init_fn: Any, enable_trace_pool: Any, collective_impl: Any,
    reduce_bucket_size_mb: Any, refresh_bucket_size_mb: Any, dp_mesh_dims: Any = None,
) -> WrapOptions:
    """Check ``module`` and every argument of ``fully_shard`` (``TypeError``/``ValueError``/
    ``NotImplementedError``), without a collective except what creating the default mesh does.
    Nothing is changed yet."""
    # Before check_module: our units are torch FSDPModules too, and this is the message for them.
    if isinstance(module, nn.Module) and (
        isinstance(module, FSDPModule) or _registry.state_of(module) is not None
    ):
        raise ValueError(
            f"{type(module).__name__} is already wrapped by fully_shard; wrap each module once "
            "(children first, then the root)"
        )
    check_module(module)
    strategy = ShardingStrategy.parse(sharding_strategy)
    outer_strategy = parse_outer_strategy(outer_dp_sharding_strategy)
    mp_policy = _fsdp2_compat.convert_mp_policy(mp_policy)
    cpu_offload = _fsdp2_compat.parse_offload_policy(offload_policy, strategy)
    reshard = _fsdp2_compat.parse_reshard_after_forward(reshard_after_forward, strategy)
    checked_timeout = validate_options(gradient_scaling_factor, max_padding_ratio, timeout)
    if not isinstance(enable_trace_pool, bool):
        raise TypeError(
            f"enable_trace_pool must be a bool, got {type(enable_trace_pool).__name__}"
        )
    check_param_init_fn(param_init_fn)
    collective_impl = parse_collective_impl(collective_impl)
    reduce_bucket_size_mb = validate_bucket_size(reduce_bucket_size_mb)
    refresh_bucket_size_mb = validate_bucket_size(refresh_bucket_size_mb,
                                                  "refresh_bucket_size_mb")
    axes = validate_mesh(resolve_dp_mesh(mesh, dp_mesh_dims, strategy), outer_strategy, strategy)
    axes = dataclasses.replace(axes, spmd=spmd_mesh_of(mesh, dp_mesh_dims))
    reshard, post_forward_group_size = _fsdp2_compat.post_forward_group_size(
        reshard, axes.inner.size(), axes.outer is not None, enable_trace_pool)
    host_offload = (
        _fsdp2_compat.host_offload_config(offload_policy, axes.mesh.device_type,
                                          axes.outer is not None)
        if cpu_offload else None
    )
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
    return WrapOptions(
        axes=axes, strategy=strategy, outer_strategy=outer_strategy, mp_policy=mp_policy,
        reshard_after_forward=reshard, gradient_scaling_factor=gradient_scaling_factor,
        max_padding_ratio=max_padding_ratio, check_ranks=check_ranks, overlap=overlap,
        timeout=checked_timeout, sync_module_states=sync_module_states,
        param_init_fn=param_init_fn, enable_trace_pool=enable_trace_pool,
        collective_impl=collective_impl, reduce_bucket_size_mb=reduce_bucket_size_mb,
        post_forward_group_size=post_forward_group_size,
        refresh_bucket_size_mb=refresh_bucket_size_mb, cpu_offload=cpu_offload,
        host_offload=host_offload,
    )


@dataclass(frozen=True)
class LocalUnit:
    """What this rank would wrap: the managed parameters, in order, with their groups' dtypes,
    and whether the unit holds meta-device state; or ``error``, a check of this rank's
    parameters that failed (then the rest is empty)."""

    managed: list[ManagedParam]
    dtypes: list[ResolvedDtypes]
    meta_init: bool
    error: TypeError | ValueError | None = None


def inspect_unit(
    module: nn.Module, options: WrapOptions, ignored_params: Iterable[nn.Parameter] | None,
    shard_placement_fn: Any = None,
) -> LocalUnit:
    """Collect and check the parameters the unit manages. These checks may fail on one rank
    only: with ``check_ranks`` the failure is kept (``LocalUnit.error``) and shared in the
    cross-rank check, so that every rank raises the same error at once instead of the others
    waiting for the timeout. Without it (or on one rank) it is raised here."""
    try:
        managed = collect_managed_params(module, options.mesh, ignored_params,
                                         spmd=options.axes.spmd)
        _fsdp2_compat.check_shard_placements(shard_placement_fn,
                                             [(m.fqn, m.param) for m in managed])
        meta_init = has_meta_state(module)
        dtypes = [options.mp_policy.resolve(m.param.dtype) for m in managed]
    except (TypeError, ValueError) as e:
        if not options.check_ranks or options.mesh.size() == 1:
            raise
        return LocalUnit([], [], False, e)
    return LocalUnit(managed, dtypes, meta_init)


def check_same_unit_everywhere(
    module: nn.Module, options: WrapOptions, unit: LocalUnit, checked_axes: Axes
) -> None:
    """The first collectives of the call, over each axis of the mesh (which covers all of it):
    raise on every rank the error some rank's :func:`inspect_unit` kept, then, with
    ``check_ranks``, check that every rank wraps the same module with the same arguments."""
    if unit.error is not None:
        raise_on_every_rank(unit.error, checked_axes)
    if not options.check_ranks:
        return
    extra: dict[str, Any] = {}
    if options.axes.outer is not None:  # 1-D signatures stay as they were
        extra["mesh"] = f"{tuple(options.mesh.shape)} {options.mesh.mesh_dim_names}"
        extra["outer_dp_sharding_strategy"] = options.outer_strategy.value
    if unit.meta_init:  # signatures of models built on a device stay as they were
        extra["meta_init"] = "param_init_fn" if options.param_init_fn is not None else "reset"
    if not options.reshard_after_forward:  # signatures of the default schedule stay as they were
        extra["reshard_after_forward"] = options.reshard_after_forward
    if options.post_forward_group_size:  # likewise
        extra["reshard_after_forward"] = options.post_forward_group_size
    if options.collective_impl != "native":  # ranks must pair the same calls
        extra["collective_impl"] = options.collective_impl
    if options.reduce_bucket_size_mb is not None:  # likewise
        extra["reduce_bucket_size_mb"] = options.reduce_bucket_size_mb
    if options.refresh_bucket_size_mb is not None:  # likewise
        extra["refresh_bucket_size_mb"] = options.refresh_bucket_size_mb
    if options.cpu_offload:  # signatures without offload stay as they were
        extra["offload_policy"] = "CPUOffloadPolicy"
    signature = unit_signature(
        module, unit.managed, options.strategy, options.mp_policy,
        options.gradient_scaling_factor, timeout=options.timeout,
        max_padding_ratio=options.max_padding_ratio, overlap=options.overlap,
        sync_module_states=options.sync_module_states, **extra,
    )
    check_mesh_agrees(signature, checked_axes)
