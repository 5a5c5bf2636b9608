"""Which parameters are experts of expert parallelism, under which names a checkpoint stores
them, and which state-dict entries torch's own DCP path would lose. No collectives.

[Note: expert names in checkpoints]
With expert parallelism (``examples/train_moe.py``) each rank holds only its EP rank's experts,
as a unit on the expert-data-parallel sub-mesh, under *local* names: ``experts.0`` is expert 0
on EP rank 0 and expert 2 on EP rank 1. DCP keeps one copy of every (name, offset) across the
ranks that save, so a save under local names writes one EP rank's experts and a load gives
them to every EP rank: a silent loss. A checkpoint must store every expert under a *global*
name. The numbering is the user's (contiguous blocks, round robin, ...), so it is declared, not
guessed: ``checkpoint.register_experts(container, global_indices)`` says that the children of
``container`` (e.g. the ``nn.ModuleList`` of this rank's experts) are experts whose global
indices are ``global_indices``, in child order; ``global_indices=None`` says that the children's
names already are global (an ``nn.ModuleDict`` keyed by global index). ``checkpoint``'s API then
renames ``<container>.<local>.`` to ``<container>.<global>.`` in the state dicts it hands to DCP
and back (``checkpoint/_experts.py``), so a checkpoint names experts as one process holding every
expert would, whatever the EP size.

torch's ``get_state_dict`` keeps the local names. Detecting that cheaply: a unit whose mesh
covers fewer ranks than a unit around it (the experts on ``edp`` inside a block on the world)
holds, on the other ranks of the wider unit, modules of the same name (the model is the same
program on every rank) with other values (no collective keeps them equal: such a unit reduces
its gradients over its own ranks only). That is decided from wrap-time meshes alone, with no
collective. The units' ``state_dict`` hooks then mark the DTensor entries of such units, and of
registered experts whose names are local, so that DCP, and only DCP, raises a ``ValueError``
naming the problem and the fix when it plans the save (``mark_unsupported``; a plain
``state_dict()`` for ``torch.save`` per rank stays usable); the optimizers' hooks do the same
for the experts' states (a parameter whose group covers fewer ranks than another group of the
same optimizer). Experts registered with global names are left alone. ``checkpoint``'s API
builds its state dicts inside :func:`renamed_by_caller`, where registered experts are not
marked, and renames them.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.nn as nn

from .. import _registry

if TYPE_CHECKING:
    from ._flat_param_group import FlatParamGroup

__all__ = [
    "ExpertContainer",
    "expert_containers",
    "lost_on_dcp",
    "lost_on_dcp_params",
    "register",
    "renamed_by_caller",
    "unit_ranks",
]

# True while checkpoint's API builds a state dict that it renames itself.
_renaming: contextvars.ContextVar[bool] = contextvars.ContextVar("mfsdp_expert_renaming",
                                                                  default=False)


def register(container: nn.Module, global_indices: Iterable[int] | None) -> None:
    """Record that ``container``'s children are experts with global indices ``global_indices``
    (in child order; ``None``: their names are global). Validated before anything is stored."""
    if not isinstance(container, nn.Module):
        raise TypeError(f"register_experts expects the nn.Module holding this rank's experts "
                        f"as its children, got {type(container).__name__}")
    names = [name for name, _ in container.named_children()]
    if not names:
        raise ValueError(f"register_experts: {type(container).__name__} has no child modules; "
                         "pass the module whose children are this rank's experts (e.g. the "
                         "nn.ModuleList of them)")
    if global_indices is None:
        _registry.expert_names[container] = None
        return
    if isinstance(global_indices, (str, bytes)):
        raise TypeError("register_experts: global_indices must be integers, one per expert, "
                        f"got {global_indices!r}")
    indices = list(global_indices)
    bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int)]
    if bad:
        raise TypeError(f"register_experts: global_indices must be integers, got {bad[0]!r}")
    if any(i < 0 for i in indices):
        raise ValueError(f"register_experts: global_indices must be non-negative, got "
                         f"{indices}")
    if len(indices) != len(names):
        raise ValueError(f"register_experts: {len(indices)} global indices for {len(names)} "
                         f"experts ({type(container).__name__} children {names}); give one per "
                         "expert, in child order")
    if len(set(indices)) != len(indices):
        raise ValueError(f"register_experts: global_indices {indices} repeat an index; each "
                         "expert needs its own")
    _registry.expert_names[container] = tuple(str(i) for i in indices)


@contextlib.contextmanager
def renamed_by_caller() -> Iterator[None]:
    """State dicts built inside store registered experts under their global names (the caller,
    ``checkpoint``'s API, renames them): the hooks leave registered experts unmarked. Units on
    a part of the ranks that hold unregistered modules are still marked."""
    token = _renaming.set(True)
    try:
        yield
    finally:
        _renaming.reset(token)


@dataclass(frozen=True)
class ExpertContainer:
    """A registered container found in a model: its path (relative to the model), its
    children's local names and their global names, in child order."""

    path: str
    module: nn.Module
    local_names: tuple[str, ...]
    global_names: tuple[str, ...]

    @property
    def renamed(self) -> bool:
        return self.local_names != self.global_names

    def prefix(self, name: str) -> str:
        """The state-dict key prefix of child ``name``."""
        return f"{self.path}.{name}." if self.path else f"{name}."


def expert_containers(model: nn.Module) -> list[ExpertContainer]:
    """Every registered container in ``model``'s tree, in module order."""
    if not _registry.expert_names:
        return []
    found = []
    for path, module in model.named_modules():
        if module not in _registry.expert_names:
            continue
        local = tuple(name for name, _ in module.named_children())
        names = _registry.expert_names[module]
        if names is not None and len(names) != len(local):
            raise ValueError(
                f"experts '{path}' have {len(local)} children but register_experts got "
                f"{len(names)} global indices; register them again after changing the experts")
        found.append(ExpertContainer(path, module, local, names if names is not None else local))
    return found


def unit_ranks(group: FlatParamGroup) -> frozenset[int]:
    """The global ranks of ``group``'s mesh (every dim)."""
    return frozenset(int(r) for r in group.mesh.mesh.flatten().tolist())


def _message(key: str, ranks: frozenset[int], wider: frozenset[int], renamed: bool) -> str:
    why = (f"'{key}' is an expert registered with register_experts under a global index that "
           "differs from its local name" if renamed else
           f"'{key}' belongs to a unit on ranks {sorted(ranks)}, a part of the ranks "
           f"{sorted(wider)} of the units around it, so the other ranks hold different "
           "modules (experts of expert parallelism) under the same name")
    return (
        f"torch.distributed.checkpoint would lose experts: {why}; DCP keeps one copy per name, "
        "so a load would give every rank the same experts. Save and load with "
        "megatron_fsdp_v2.checkpoint.save/load (or its get_state_dict/set_state_dict), which "
        "store each expert under its global name after checkpoint.register_experts(<the module "
        "holding this rank's experts>, global_indices=<their global indices>); or give the "
        "experts global names (e.g. an nn.ModuleDict keyed by global index) and declare them "
        "with checkpoint.register_experts(<that module>)")


def _expert_params(containers: list[ExpertContainer]) -> tuple[set[int], set[int]]:
    """ids of the parameters of registered experts with local names, and with global ones."""
    renamed: set[int] = set()
    named: set[int] = set()
    for c in containers:
        (renamed if c.renamed else named).update(id(p) for p in c.module.parameters())
    return renamed, named


def lost_on_dcp(module: nn.Module) -> dict[str, str]:
    """For the ``state_dict`` hook of unit ``module``: the entries (names relative to it) DCP
    would lose, each with the error to raise. Nothing inside :func:`renamed_by_caller`."""
    state = _registry.state_of(module)
    if state is None:
        return {}
    own = {id(g) for g in state.groups}
    wider = frozenset().union(*(unit_ranks(g) for g in state.groups))
    narrow: dict[int, frozenset[int]] = {}  # id(group) -> its ranks
    for _, sub in module.named_modules():
        sub_state = _registry.state_of(sub)
        if sub_state is None or sub_state is state:
            continue
        for group in sub_state.groups:
            ranks = unit_ranks(group)
            if id(group) not in own and ranks < wider:
                narrow[id(group)] = ranks
    renamed, named = _expert_params(expert_containers(module))
    if _renaming.get():  # the caller stores registered experts under their global names
        renamed, named = set(), named | renamed
    if not narrow and not renamed:
        return {}
    lost = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        record = _registry.record_of(param)
        if record is None or id(param) in named:
            continue
        if id(param) in renamed or id(record.group) in narrow:
            ranks = narrow.get(id(record.group), unit_ranks(record.group))
            lost[name] = _message(name, ranks, wider, id(param) in renamed)
    return lost


def lost_on_dcp_params(params: list[nn.Parameter]) -> dict[int, str]:
    """For an optimizer's ``state_dict`` hook: ids of the managed ``params`` whose states DCP
    would lose (their group covers fewer ranks than another group of the same optimizer, or
    they are registered experts with local names), each with the error to raise."""
    records = [(p, _registry.record_of(p)) for p in params]
    ranks = {id(r.group): unit_ranks(r.group) for _, r in records if r is not None}
    if not ranks:
        return {}
    wider = frozenset().union(*ranks.values())
    narrow = {gid for gid, r in ranks.items() if r < wider}
    renamed_ids: set[int] = set()
    named_ids: set[int] = set()
    for container, names in list(_registry.expert_names.items()):
        local = tuple(name for name, _ in container.named_children())
        renames = names is not None and names != local and not _renaming.get()
        target = renamed_ids if renames else named_ids
        target.update(id(p) for p in container.parameters())
    lost = {}
    for p, record in records:
        if record is None or id(p) in named_ids:
            continue
        if id(p) in renamed_ids or id(record.group) in narrow:
            lost[id(p)] = _message(f"{record.fqn} (the optimizer state's parameter, named "
                                   "within its unit)", ranks[id(record.group)],
                                   wider, id(p) in renamed_ids)
    return lost
