"""Whether any module tree changed since a look: a generation number of submodule registrations.

[Note: module tree changes after wrapping]
A unit manages the parameters its modules held when it was wrapped. A submodule assigned later
(``model.blocks[2] = nn.Linear(...)``, ``model.head = ...``, ``module.add_module``) brings
parameters that no unit shards or reduces: each rank would train its own copy, unsynchronized
(the ranks drift apart), where torch trains one. Such a change must raise at the next forward,
as a replaced parameter does (``RegisteredParams.check``), but walking every unit's modules at every
forward would cost the hot path a loop over the model. torch tells every submodule assignment
to the global module-registration hooks (``register_module_module_registration_hook``, public;
a call, no patch of torch): the hook installed at the first ``fully_shard`` counts them, and the
root's pre-forward walks the module trees (``RegisteredParams.check_tree``) only when the count
moved since its last look: one integer comparison per forward otherwise. Assignments anywhere in the
process count (a reference model built next to the wrapped one): they cost one walk at the next
forward, never an error, since a walk raises only for parameters no unit manages in modules
that were not there at wrap time. A module that only wraps a unit without parameters of its own
(``blocks[i] = torch.compile(blocks[i])``) passes. Deleting a submodule (``del model.blocks[2]``)
is not reported by torch; its parameters simply stop being used, as in torch.
"""

from __future__ import annotations

import torch.nn as nn
from torch.nn.modules.module import register_module_module_registration_hook

from .. import _registry

__all__ = ["install_module_tree_hook", "module_tree_generation"]


def _note_submodule_registered(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    _registry.module_tree_generation[0] += 1


def install_module_tree_hook() -> None:
    """Count submodule registrations from now on (once per process, until ``_registry.reset``)."""
    if not _registry.module_tree_hook_handles:
        _registry.module_tree_hook_handles.append(
            register_module_module_registration_hook(_note_submodule_registered)
        )


def module_tree_generation() -> int:
    """How many submodules were registered anywhere since the hook was installed."""
    return _registry.module_tree_generation[0]
