"""``fully_shard``'s wiring steps for one call, after its validation: the unit's process groups,
its flat groups, the broadcast of its buffers, and the installation of the unit (its
parameters bound to the flat buffers, its ``FSDPState``, its hooks and its ``FSDP<Class>``).
Only :func:`install_unit` changes the module; everything before it can still raise and leave the
module untouched."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _registry, _torch_patches
from .._buffers._allocator import ScratchAllocator
from .._buffers._layout import build_layout, split_for_padding
from .._comm._collectives import broadcast_from_first
from .._comm._process_groups import (
    mesh_process_group,
    post_forward_process_group,
    unit_process_group,
    whole_mesh_process_group,
)
from .._dtensor._tp_params import TPFace
from .._dtensor._uneven_meshes import register_mesh
from .._init import _materialize
from .._runtime import _state_dict_hooks
from .._runtime._flat_param_group import FlatParamGroup
from .._runtime._optimizer_hooks import note_wrap
from .._runtime._param_record import mesh_device
from .._runtime._state import FSDPState
from .._runtime._subclass_gather import has_all_gather_extensions
from ._fsdp_module import fsdp_class
from ._pipelining import attach as _pipelining_attach
from ._wrap_checks import warn_if_padded
from ._wrap_options import Axes, LocalUnit, WrapOptions

__all__ = ["UnitProcessGroups", "add_whole_mesh_process_group", "broadcast_buffers", "build_groups",
           "install_unit", "make_process_groups"]


@dataclass(frozen=True)
class UnitProcessGroups:
    """The process groups of one unit, with ``fully_shard``'s timeout (see
    ``_process_groups.py``)."""

    inner: dist.ProcessGroup
    """The inner (shard) axis: the strategy's collectives."""
    outer: dist.ProcessGroup | None
    """HSDP's outer (replicate) axis; ``None`` on a 1-D mesh."""
    mesh: dist.ProcessGroup | None
    """Every rank of the mesh, for gradient norms under HSDP outer ``optim`` (each rank holds a
    distinct sub-shard: one all-reduce, not one per axis); ``None`` otherwise."""

    def checked_axes(self, options: WrapOptions) -> Axes:
        """(1-D mesh, its group) of each mesh axis, inner first: the cross-rank check's axes."""
        axes: Axes = [(options.axes.inner, self.inner)]
        if options.axes.outer is not None:
            axes.append((options.axes.outer, self.outer))
        return axes


def make_process_groups(options: WrapOptions, unit: LocalUnit) -> UnitProcessGroups:
    """Create (once per mesh and timeout) the unit's axis groups, inner axis first: those the
    cross-rank check runs on. When that fails and this rank's own check had failed (e.g. a mesh
    of another device type, never initialized), the check's error is the one raised. The
    whole-mesh group comes after the check (:func:`add_whole_mesh_process_group`)."""
    axes = options.axes
    try:
        inner = unit_process_group(axes.inner, options.timeout)
        outer = (unit_process_group(axes.outer, options.timeout, "outer")
                 if axes.outer is not None else None)
    except Exception:
        if unit.error is not None:
            raise unit.error from None
        raise
    return UnitProcessGroups(inner, outer, None)


def add_whole_mesh_process_group(
    options: WrapOptions, groups: UnitProcessGroups
) -> UnitProcessGroups:
    """``groups`` with the whole-mesh group of HSDP with outer ``optim``. Only after the
    cross-rank check: only ranks asking for outer ``optim`` create it, collectively over the
    mesh, so a rank that asked for ``no_shard`` would leave them waiting in its creation for
    the timeout instead of the check naming the argument they disagree on."""
    if not options.outer_optim:
        return groups
    return dataclasses.replace(groups, mesh=mesh_process_group(options.mesh, options.timeout))


def build_groups(
    module: nn.Module, options: WrapOptions, unit: LocalUnit, groups: UnitProcessGroups
) -> tuple[list[FlatParamGroup], ScratchAllocator]:
    """The unit's flat groups: its parameters grouped by (device, dtype,
    requires_grad) in first-seen order, each split where row alignment would pad it by more than
    ``max_padding_ratio``. Buffers are allocated; the module is not changed yet."""
    managed = unit.managed
    world_size = options.layout_world_size
    post_forward = None
    if options.post_forward_group_size:
        extended = next((m.fqn for m in managed if has_all_gather_extensions(m.param)), None)
        if extended is not None:  # the same on every rank: the same module is wrapped
            raise NotImplementedError(
                f"reshard_after_forward={options.post_forward_group_size} with parameter "
                f"{extended!r}, gathered through all-gather extensions (FP8): resharding their "
                "gathered inputs to a smaller group is not supported. Use reshard_after_forward"
                "=True/False for this unit"
            )
        post_forward = post_forward_process_group(groups.inner, options.post_forward_group_size,
                                                  options.timeout)
    by_kind: dict[tuple[Any, ...], list[int]] = {}
    for i, m in enumerate(managed):
        # Parameters gathered through all-gather extensions (FP8) form groups of their own.
        kind = (m.param.device, m.param.dtype, m.param.requires_grad,
                has_all_gather_extensions(m.param))
        by_kind.setdefault(kind, []).append(i)
    allocator = ScratchAllocator()
    flat_groups: list[FlatParamGroup] = []
    for members in by_kind.values():
        shapes = [managed[i].local.shape for i in members]
        for split in split_for_padding(shapes, world_size, options.max_padding_ratio):
            indices = [members[j] for j in split]
            layout = build_layout([managed[i].local.shape for i in indices], world_size)
            fqns = [managed[i].fqn for i in indices]
            warn_if_padded(layout, fqns, options.max_padding_ratio)
            flat_groups.append(
                FlatParamGroup(
                    group_id=(id(module), len(flat_groups)),
                    params=[managed[i].param for i in indices],
                    tp_faces=[managed[i].tp for i in indices],
                    fqns=fqns,
                    layout=layout,
                    mesh=options.mesh,
                    process_group=groups.inner,
                    outer_process_group=groups.outer,
                    mesh_process_group=groups.mesh,
                    strategy=options.strategy,
                    outer_strategy=options.outer_strategy,
                    dtypes=unit.dtypes[indices[0]],
                    grad_pre_scale=options.grad_pre_scale,
                    allocator=allocator,
                    sync_from_rank0=options.sync_module_states,
                    collective_impl=options.collective_impl,
                    meta_init_device=meta_init_device(options),
                    host_offload=options.host_offload,
                )
            )
            if post_forward is not None:
                flat_groups[-1].weights.use_post_forward_process_group(post_forward)
            flat_groups[-1].tp_norm_process_groups = [
                None if face is None
                else tp_norm_process_group(face, flat_groups[-1], options.timeout)
                for face in flat_groups[-1].tp_faces
            ]
    return flat_groups, allocator


def meta_init_device(options: WrapOptions) -> torch.device:
    """Where the buffers of a unit built on the meta device go: the mesh's device, or the meta
    device itself inside the estimator's ``meta_buffers()`` (storage-free wraps; see [Note:
    meta buffers] in ``_registry``). The entry point reads the estimator's setting here and
    hands the device down as an argument: the groups and materialization never read it."""
    return torch.device("meta") if _registry.meta_buffers[0] else mesh_device(options.mesh)


def tp_norm_process_group(
    face: TPFace, group: FlatParamGroup, timeout: Any
) -> dist.ProcessGroup | None:
    """Where ``clip_grad_norm_`` all-reduces the sum of squares of a tensor-parallel
    parameter's gradients: the ranks across which its optimizer-facing placements shard it
    (dp and TP dims; not HSDP's replicas), or None where only the dp axis shards it (the
    group's own ``norm_process_group``). Created here, at wrap time, by every rank."""
    placements = face.dist_placements(group._placements)
    names = face.dist_mesh.mesh_dim_names
    assert names is not None  # checked by tp_face_of
    sharded = [i for i, p in enumerate(placements)
               if not p.is_replicate() and face.dist_mesh.size(i) > 1]
    if all(i < face.dp_ndim for i in sharded):
        return None
    return whole_mesh_process_group(face.dist_mesh[tuple(names[i] for i in sharded)], timeout)


def broadcast_buffers(module: nn.Module, groups: UnitProcessGroups) -> None:
    """``sync_module_states``: buffers of this unit (not of wrapped children, which did their
    own) from the mesh's first rank, as DDP does with module states. Outer axis first, then the
    inner one: every rank gets mesh rank (0, 0)'s buffers."""
    for axis_process_group in (groups.outer, groups.inner):
        if axis_process_group is None or dist.get_world_size(axis_process_group) <= 1:
            continue
        for _, submodule in _registry.owned_modules(module):
            for buffer in submodule._buffers.values():
                # A meta buffer has no value yet; every rank materializes it alike.
                if buffer is not None and buffer.numel() > 0 and buffer.device.type != "meta":
                    broadcast_from_first(buffer, axis_process_group)


def install_unit(
    module: nn.Module, options: WrapOptions, unit: LocalUnit,
    flat_groups: list[FlatParamGroup], allocator: ScratchAllocator,
    members: list[nn.Module] | None = None,
) -> FSDPState:
    """Make ``module`` a unit: bind its parameters to the groups' buffers, register its state,
    records and hooks, change its class to ``FSDP<Class>``, and install the process-wide hooks
    on the first wrap. Every group is built: only now is the module changed. ``members``: the
    modules of a unit wrapped from a list, which ``module`` (their internal holder) groups; they
    get the state, the hooks and ``FSDP<Class>`` (see [Note: several modules as one unit])."""
    if unit.meta_init:
        _materialize.adopt_meta_unit(
            module, flat_groups, meta_init_device(options), options.param_init_fn, members
        )
    owner = f"{type(module).__name__} at 0x{id(module):x}"
    for group in flat_groups:
        if group.extension is not None:  # what fsdp_pre_all_gather's 5-argument form gets
            group.extension.owners = [module.get_submodule(fqn.rpartition(".")[0])
                                      for fqn in group.fqns]
            group.extension.mp_policy = options.mp_policy
        group.weights.bind()
        group.owner = owner
        _registry.register_records(group.records)
    state = FSDPState(module, flat_groups, options.mp_policy, allocator, members)
    state.overlap = options.overlap
    state.reduce_bucket_size_mb = options.reduce_bucket_size_mb
    state.refresh_bucket_size_mb = options.refresh_bucket_size_mb
    state.reshard_after_forward = options.reshard_after_forward
    state.enable_trace_pool = options.enable_trace_pool
    _registry.set_state(module, state)
    targets = state.members  # ``module`` itself, or the members of a list
    for member in targets:
        _registry.set_state(member, state)
    # DTensor redistribution of uneven shards: the mesh, and the dim-0 sizes of the parameters
    # whose DTensors live on it (which decide which DTensors there may hold our rows).
    register_mesh(options.mesh, outer_optim=options.outer_optim, row_counts=tuple(
        record.item.shape[0] for group in flat_groups for record in group.records
        if record.tp is None  # 0-d parameters are refused at wrap time
    ))
    for face in (f for group in flat_groups for f in group.tp_faces if f is not None):
        register_mesh(face.dist_mesh, outer_optim=options.outer_optim,
                      tp_dims=tuple(range(face.dp_ndim, face.dist_mesh.ndim)),
                      row_counts=tuple(face.shape[:1]))
    _torch_patches.install_all()  # once; see _torch_patches/__init__.py for the list
    state.register_dist_params()
    for target in targets:
        target.register_load_state_dict_post_hook(_mark_loaded)
        # Sharded state dicts: chunk metadata for DCP, full-tensor/shape handling on load.
        target.register_state_dict_post_hook(_state_dict_hooks.state_dict_post_hook)
        target.register_load_state_dict_pre_hook(_state_dict_hooks.load_state_dict_pre_hook)
        if unit.meta_init:  # values before anything reads or writes them (_materialize.py)
            target.register_state_dict_pre_hook(_materialize.materialize_hook)
            target.register_load_state_dict_pre_hook(_materialize.materialize_hook)
        target.__class__ = fsdp_class(type(target))
        _pipelining_attach(target)  # torch's pipeline schedules end a step through it
    note_wrap()  # optimizer step hooks (first wrap); optimizers cached before are checked again
    return state


def _mark_loaded(module: nn.Module, incompatible_keys: Any) -> None:
    """A checkpoint load wrote the main weights: refresh compute weights before the next use."""
    state = _registry.state_of(module)
    if state is not None:
        for group in state.groups:
            group.mark_main_weights_updated()
