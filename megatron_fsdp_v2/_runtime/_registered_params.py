"""Which object is registered under each parameter name (``module._parameters[name]``) of the
modules a unit owns: the compute parameters during forward and backward, the optimizer-facing
DTensor parameters otherwise, and checks that nobody else put another one there.

The parameter objects a unit was wrapped with are what its flat buffers hold: a parameter
replaced, tied, added or removed after ``fully_shard`` would be silently put back at the next
registration (or stay unsharded and unsynchronized), so :meth:`RegisteredParams.check` raises
first; a submodule assigned after wrapping is found by :meth:`RegisteredParams.check_tree` (see
[Note: module tree changes after wrapping] in ``_module_tree.py``), and ``p.data = x`` on a
managed parameter by a watch on its storage ([Note: data assignments]).

[Note: data assignments]
``p.data = x`` on an optimizer-facing DTensor parameter swaps the storage and metadata of the
DTensor object, but neither its local shard (which DTensor ops and ``full_tensor()`` read) nor
the flat buffers the unit computes with: torch would train with ``x``, the unit silently keeps
the old values (so does FSDP2). No counter moves (``p._version`` stays), and comparing every
parameter's storage at every forward would be a loop over the parameters on the hot path.
Instead the swap is observed when it happens: at wrap time each parameter's storage gets a
weak reference whose callback runs when that storage is released. torch keeps a storage's Python
object alive as long as the storage, and the parameter is its only holder unless the user keeps
an alias (``p.detach()``, a state dict), so the ``.data`` assignment releases it and the callback
records the parameter; the next forward's ``check`` raises (one list test per unit). A storage
released because the parameter itself died records nothing. With an alias of the old storage
alive (a state dict of the parameters kept around) the assignment goes unnoticed, as before.
A submodule called directly while the DTensor parameters are registered gets a clear error from
a forward pre-hook that exists only then (forward itself pays nothing for it).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from .. import _registry
from ._compile import eager_hook
from ._module_tree import install_module_tree_hook

if TYPE_CHECKING:
    from ._param_record import ParamRecord
    from ._unit_state import UnitState

__all__ = ["RegisteredParams"]

# (a module's ``_parameters`` dict, {parameter name: parameter to put there})
Registration = tuple[dict[str, Any], dict[str, Any]]




class RegisteredParams:
    """The parameter objects registered in one unit's modules (``module._parameters``)."""

    def __init__(self, state: UnitState, module: nn.Module) -> None:
        self._state = state
        faces = {id(r.compute_param): r for g in state.groups for r in g.records}
        # Parameters with all-gather extensions: the module held the wrapped objects; their
        # compute parameters are rebuilt by the gathers (see _subclass_gather.py), so their
        # entries take whatever the record holds when registered.
        rebuilt: set[int] = set()
        for g in state.groups:
            if g.extension is not None:
                for original, r in zip(g.extension.original_ids, g.records):
                    faces[original] = r
                    rebuilt.add(id(r))
        compute: dict[int, Registration] = {}
        dist: dict[int, Registration] = {}
        # A tied parameter appears under every (submodule, name) it is registered at.
        for submodule in module.modules():
            for name, param in submodule._parameters.items():
                record = faces.get(id(param)) if param is not None else None
                if record is None:
                    continue
                entries = submodule._parameters
                compute.setdefault(id(submodule), (entries, {}))[1][name] = record.compute_param
                dist.setdefault(id(submodule), (entries, {}))[1][name] = record.dist_param
        self.compute_registration = list(compute.values())
        # (mapping, name, record) of each entry whose compute parameter is rebuilt.
        self._rebuilt_entries: list[tuple[dict[str, Any], str, ParamRecord]] = []
        for submodule in module.modules():
            for name, param in submodule._parameters.items():
                record = faces.get(id(param)) if param is not None else None
                if record is not None and id(record) in rebuilt:
                    self._rebuilt_entries.append((compute[id(submodule)][1], name, record))
        self.dist_registration = list(dist.values())
        self.compute_registered = False
        # Every parameter entry of the owned modules as wrapping left it (managed parameters as
        # their DTensor parameters), to compare with.
        owned = _registry.owned_modules(module)
        self._expected = [
            (prefix, submodule._parameters,
             {name: faces[id(p)].dist_param if id(p) in faces else p
              for name, p in submodule._parameters.items()})
            for prefix, submodule in owned
        ]
        # The parameter mappings of the modules owned at wrap time, by identity: a module found
        # later with another one was assigned after wrapping (check_tree).
        self._known_mappings = {id(parameters) for _, parameters, _ in self._expected}
        install_module_tree_hook()
        # [Note: data assignments] Names of parameters whose storage was swapped (``p.data =``),
        # and the weak references that notice it.
        self.data_replaced: list[str] = []
        self._storage_watches = [
            _watch_storage(weakref.ref(self), record) for g in state.groups for record in g.records
        ]
        self._idle_hooks: list[tuple[dict[int, Any], int]] = []
        self._outside_unit_hook = eager_hook(self._called_outside_unit)
        for _, submodule in owned:
            has_params = any(p is not None for p in submodule._parameters.values())
            # A member of a unit wrapped from a list is called by the model: its own hooks
            # unshard the unit first.
            if submodule is not module and has_params and not any(
                submodule is member for member in state.members
            ):
                handle = submodule.register_forward_pre_hook(self._outside_unit_hook)
                self._idle_hooks.append((submodule._forward_pre_hooks, handle.id))

    def register_dist_params(self) -> None:
        for parameters, mapping in self.dist_registration:
            parameters.update(mapping)
        if self.compute_registered:
            for hooks, key in self._idle_hooks:
                hooks[key] = self._outside_unit_hook
        self.compute_registered = False

    def register_compute_params(self) -> None:
        for mapping, name, record in self._rebuilt_entries:
            mapping[name] = record.compute_param
        for parameters, mapping in self.compute_registration:
            parameters.update(mapping)
        if not self.compute_registered:
            for hooks, key in self._idle_hooks:
                hooks.pop(key, None)
        self.compute_registered = True

    def check(self) -> None:
        """Raise if a parameter of this unit was replaced, added, removed or (un)tied after
        wrapping, or its ``.data`` assigned (see the module docstring)."""
        if self.data_replaced:
            raise RuntimeError(
                f"parameter '{self.data_replaced[0]}' of the fully_shard unit "
                f"'{self._state.fqn}' had its .data assigned (p.data = ...) after fully_shard "
                f"({len(self.data_replaced)} parameter(s) of this unit): the assignment reaches "
                "neither the parameter's local shard nor the flat buffers the unit computes "
                "with, so it would be silently ignored. Change values in place instead "
                "(torch.no_grad() and p.copy_(...), nn.init.*) or with load_state_dict, and "
                "rebuild and wrap the model again: this parameter object is no longer usable"
            )
        for prefix, parameters, expected in self._expected:
            if len(parameters) == len(expected) and all(
                parameters.get(name) is value or self._is_compute_param(name, parameters)
                for name, value in expected.items()
            ):
                continue
            for name in list(expected) + [n for n in parameters if n not in expected]:
                if name in expected and (
                    parameters.get(name) is expected[name]
                    or self._is_compute_param(name, parameters)
                ):
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                what = (
                    "added" if name not in expected
                    else "removed" if name not in parameters
                    else "replaced (or tied to another parameter)"
                )
                raise RuntimeError(
                    f"parameter '{fqn}' of the fully_shard unit '{self._state.fqn}' was {what} "
                    "after fully_shard; the unit's flat buffers hold the parameters it was "
                    "wrapped with. Set, tie or add parameters before calling fully_shard (for "
                    "tied weights, wrap a common ancestor); to change values, write in place "
                    "(p.copy_(x), nn.init.*) or use load_state_dict"
                )

    def check_tree(self) -> None:
        """Raise if a module this unit owns now, and did not own at wrap time, holds a
        parameter no unit manages: a submodule assigned after wrapping (see [Note: module tree
        changes after wrapping] in ``_module_tree.py``). A walk of the unit's modules: run only
        when a submodule was registered somewhere since the last one."""
        for prefix, submodule in _registry.owned_modules(self._state.module):
            if id(submodule._parameters) in self._known_mappings:
                continue
            for name, param in submodule._parameters.items():
                if param is None or _registry.record_of(param) is not None:
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                raise RuntimeError(
                    f"submodule '{prefix}' ({type(submodule).__name__}) of the fully_shard unit "
                    f"'{self._state.fqn}' was added or replaced after fully_shard: its parameter "
                    f"'{fqn}' is not managed by any unit, so it would be neither sharded nor "
                    "averaged across ranks (each rank would train its own copy). Build the model "
                    "completely (replace or add submodules) before calling fully_shard; to "
                    "change values, write in place (p.copy_(x), nn.init.*) or use load_state_dict"
                )

    def _is_compute_param(self, name: str, parameters: dict[str, Any]) -> bool:
        """Whether ``parameters[name]`` is the compute parameter this unit registered there
        (between forward and backward, or after a forward that raised)."""
        for entries, mapping in self.compute_registration:
            if entries is parameters:
                return name in mapping and mapping[name] is parameters.get(name)
        return False

    def _called_outside_unit(self, submodule: nn.Module, args: Any) -> None:
        if not self.compute_registered:
            raise RuntimeError(
                f"{type(submodule).__name__} is managed by the fully_shard unit "
                f"'{self._state.fqn}' ({type(self._state.module).__name__}) and was called "
                "outside that unit's forward, where its parameters are sharded DTensors. Call "
                "the unit itself, or wrap this submodule with fully_shard (before its parent) so "
                "it is a unit of its own"
            )


def _watch_storage(
    registered: weakref.ref[RegisteredParams], record: ParamRecord
) -> weakref.ref[Any]:
    """A weak reference to the storage of ``record``'s optimizer-facing parameter that records
    the parameter in ``registered.data_replaced`` when the storage is released while the parameter
    is alive and still the record's (see [Note: data assignments])."""
    param_ref = weakref.ref(record.dist_param)

    def released(_: Any) -> None:
        param, watcher = param_ref(), registered()
        if param is not None and watcher is not None and record.dist_param is param:
            watcher.data_replaced.append(record.fqn)

    return weakref.ref(record.dist_param.untyped_storage(), released)
