"""Process-wide bookkeeping of the library, behind typed accessors: which module has which unit
state, which parameter belongs to which record, the library's process groups and default meshes,
the ``FSDP<Class>`` classes, meta-device units waiting for values, the optimizer step hooks and
their caches. Nothing here is created at import time; :func:`reset` forgets everything (tests)
and runs the undo actions registered in :data:`reset_undos` (the patches of torch register
theirs when installed: each keeps the originals it saved, see ``_torch_patches/_patch.py``).
This module imports nothing of the package: the layers above it hand it their state.

Modules and parameters are keyed weakly by identity (``torch.utils.weak.WeakIdKeyDictionary``:
tensors compare elementwise, so a plain ``WeakKeyDictionary`` cannot hold them), never through
attributes set on them, so user objects carry no private strings of ours.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from ._init._materialize import PendingUnit
    from ._runtime._flat_param_group import FlatParamGroup
    from ._runtime._muon import MuonPlan
    from ._runtime._optimizer_local import LocalSwap, ParamPositions
    from ._runtime._param_record import ParamRecord
    from ._runtime._state import FSDPState

__all__ = [
    "group_of", "managed_dist_params", "owned_modules", "record_of", "register_records", "reset",
    "set_state", "state_of", "unit_states",
]

_states: WeakIdKeyDictionary = WeakIdKeyDictionary()  # nn.Module -> FSDPState
# Both the compute parameter and the optimizer-facing (DTensor) parameter map to the record.
_records: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> ParamRecord
# Library process groups with a collective timeout, keyed by (mesh ranks, seconds, backend
# config, mesh axis: "shard", HSDP's "outer", or "mesh"); a value may be the mesh's own group.
process_groups: dict[tuple[tuple[int, ...], float, str, str], Any] = {}
# Default 1-D meshes over the whole world, per device type.
default_meshes: dict[str, Any] = {}
# Side streams for collectives, per device (see _collectives.CommStreams).
comm_streams: dict[Any, Any] = {}
# Meshes of fully_shard units, [mesh, outer_optim, tensor-parallel dims] each: their Shard
# DTensors may be uneven (see [Note: uneven redistribution] in _redistribute.py).
uneven_meshes: list[list[Any]] = []
# FSDP<Class> subclasses, per original class.
fsdp_classes: dict[type, type] = {}
# The handles of the optimizer step hooks, once installed, the per-optimizer cache of the groups
# it updates, and the number of wraps so far (a cached entry older than the last wrap is stale).
optimizer_hook_handles: list[Any] = []
optimizer_cache: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
wrap_generation = [0]
# [Note: module tree changes after wrapping] (_runtime/_module_tree.py): the handle of the global
# module-registration hook, once installed, and how many submodules were registered since.
module_tree_hook_handles: list[Any] = []
module_tree_generation = [0]
# [Note: group names before torch 2.14] (_comm/_process_groups.py): how many group memberships the
# last library group was named with in this process. ``reset`` keeps it: it mirrors torch's
# group table, which outlives the library's state.
group_names_level = [-1]
# _comm/_arrival.py: (call, group ranks) -> how many times this process reached the call on that
# group. ``reset`` keeps it too: the arrival keys in torch's store outlive the library's state,
# and a count started again would meet them.
arrival_counts: dict[tuple[str, tuple[int, ...]], int] = {}
# [Note: local optimizer step] (_optimizer_local.py): the optimizers whose step runs on local
# tensors right now (or whose step raised half-way), those given the state-dict hook that swaps
# back, and where each optimizer holds managed parameters (cached: the hook runs every step).
local_step_swaps: weakref.WeakKeyDictionary[torch.optim.Optimizer, LocalSwap] = (
    weakref.WeakKeyDictionary()
)
local_step_restore_hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
# The optimizers given the state-dict hooks that mark managed states (_optimizer_hooks.py).
optimizer_state_dict_hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
local_step_positions: weakref.WeakKeyDictionary[torch.optim.Optimizer, ParamPositions] = (
    weakref.WeakKeyDictionary()
)
# [Note: expert names in checkpoints] (_runtime/_expert_names.py): register_experts' record,
# container module -> the global name of each child, in child order (None: names are global).
expert_names: WeakIdKeyDictionary = WeakIdKeyDictionary()
# [Note: distributed Muon] (_runtime/_muon.py): each Muon's plan (its managed matrices and their
# owners, cached per parameter set), and the gradients hidden from torch's loop during a step.
muon_plans: weakref.WeakKeyDictionary[torch.optim.Optimizer, MuonPlan] = weakref.WeakKeyDictionary()
muon_hidden_grads: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[Any]] = (
    weakref.WeakKeyDictionary()
)
# _frontend/_pipelining.py: per torch.distributed.pipelining schedule object, whether it splits
# backwards into input and weight passes (read once per schedule, not at every step).
pipeline_schedule_splits: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
# Wrapped modules whose meta parameters or buffers have no values yet (see [Note: meta
# materialization] in _materialize.py).
pending_meta_units: weakref.WeakKeyDictionary[nn.Module, PendingUnit] = weakref.WeakKeyDictionary()
# Depth of FSDPModule._apply calls in progress (see [Note: conversions after wrapping]).
applying_depth = [0]
# [Note: meta buffers] True only inside ``estimate`` (``_estimate.meta_buffers()``): the flat
# buffers of groups built from meta parameters go on the meta device instead of the mesh's, so
# wrapping allocates no storage and ``memory_bytes`` still reads numel * element_size. Read by
# the frontend only (``_wiring.meta_init_device``, ``_param_classes``), which hands the device
# down as an argument (``FlatParamGroup(meta_init_device=...)``, ``adopt_meta_unit``).
meta_buffers = [False]
# What ``reset`` undoes besides forgetting the state above, last registered first: state kept by
# its owner outside the registry. Each installed patch of torch registers its ``uninstall``
# (``_torch_patches/_patch.py``), so the registry needs no import of the layer above it.
reset_undos: list[Callable[[], None]] = []


def unit_states(module: nn.Module) -> list[tuple[str, FSDPState]]:
    """Every unit state in ``module``'s tree, once each (a unit wrapped from a list of modules
    is found under its first member's name), in module order."""
    seen: set[int] = set()
    found = []
    for name, m in module.named_modules():
        state = state_of(m)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            found.append((name, state))
    return found


def state_of(module: nn.Module) -> FSDPState | None:
    """The unit state of ``module``, or None if it was not passed to ``fully_shard``."""
    return _states.get(module)


def set_state(module: nn.Module, state: FSDPState) -> None:
    _states[module] = state


def record_of(param: torch.Tensor) -> ParamRecord | None:
    """The record of a managed parameter (its compute or optimizer-facing object), or None."""
    try:
        return _records.get(param)
    except TypeError:  # not weak-referenceable (e.g. a plain Python number)
        return None


def managed_dist_params(module: nn.Module) -> dict[str, nn.Parameter]:
    """Every name (tied parameters under each of theirs) of a DTensor parameter managed by a
    unit, relative to ``module``. Outside forward/backward, where the DTensors are registered."""
    return {
        name: param
        for name, param in module.named_parameters(remove_duplicate=False)
        if record_of(param) is not None
    }


def group_of(param: torch.Tensor) -> FlatParamGroup | None:
    record = record_of(param)
    return record.group if record is not None else None


def register_records(records: list[ParamRecord]) -> None:
    for record in records:
        _records[record.compute_param] = record
        _records[record.dist_param] = record


def reset() -> None:
    """Forget all of the library's process-wide state (tests) and run :data:`reset_undos` (the
    patches of torch are put back). Installed optimizer hooks are removed; wrapped modules keep
    working only if re-wrapped."""
    _states.clear()
    _records.clear()
    process_groups.clear()
    default_meshes.clear()
    comm_streams.clear()
    fsdp_classes.clear()
    uneven_meshes.clear()
    for handle in optimizer_hook_handles:
        handle.remove()
    optimizer_hook_handles.clear()
    optimizer_cache.clear()
    wrap_generation[0] = 0
    for handle in module_tree_hook_handles:
        handle.remove()
    module_tree_hook_handles.clear()
    module_tree_generation[0] = 0
    local_step_swaps.clear()
    local_step_restore_hooked.clear()
    optimizer_state_dict_hooked.clear()
    local_step_positions.clear()
    muon_plans.clear()
    pipeline_schedule_splits.clear()
    expert_names.clear()
    muon_hidden_grads.clear()
    pending_meta_units.clear()
    applying_depth[0] = 0
    meta_buffers[0] = False
    while reset_undos:
        reset_undos.pop()()


def owned_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module`` and its submodules, minus wrapped children and everything below them. The
    members of a unit wrapped from a list share its state and are its own (see [Note: several
    modules as one unit] in ``_frontend/_module_lists.py``)."""
    owned: list[tuple[str, nn.Module]] = []
    wrapped: list[str] = []
    own_state = state_of(module)
    for prefix, submodule in module.named_modules():
        if any(prefix.startswith(w + ".") for w in wrapped):
            continue
        sub_state = state_of(submodule) if submodule is not module else None
        if sub_state is not None and (own_state is None or sub_state is not own_state):
            wrapped.append(prefix)
            continue
        owned.append((prefix, submodule))
    return owned
