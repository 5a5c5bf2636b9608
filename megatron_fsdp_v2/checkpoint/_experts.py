"""Expert parallelism in checkpoints: the experts' global names in the state dicts handed to DCP
and back, the check that the ranks' global names fit together, and which unit layouts a
checkpoint accepts. The registration and the detection of torch's lossy path are
``_runtime/_expert_names.py``'s (see [Note: expert names in checkpoints] there). No collectives:
the claims are gathered with the save's or load's path agreement
(``_process_group.check_same_path``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from .. import _registry
from .._runtime._expert_names import ExpertContainer, expert_containers, unit_ranks

__all__ = ["ExpertNames", "check_claims", "global_rank", "narrow_unit_error"]

# One rank's claim: (container path, global name, ranks of the unit that holds the expert).
Claim = tuple[str, str, tuple[int, ...]]


class ExpertNames:
    """The registered experts of one model on this rank, and the renaming of state-dict keys
    between their local names (``<container>.<local>.``, the model's) and global ones
    (``<container>.<global>.``, the checkpoint's)."""

    def __init__(self, model: nn.Module) -> None:
        self.containers = expert_containers(model)
        self._by_path = {c.path: c for c in self.containers}
        self._to_local = {c.path: dict(zip(c.global_names, c.local_names))
                          for c in self.containers}
        self._to_global = {c.path: dict(zip(c.local_names, c.global_names))
                           for c in self.containers}

    def __bool__(self) -> bool:
        return bool(self.containers)

    def _split(self, key: str) -> tuple[ExpertContainer, str, str] | None:
        """``(container, child name, rest)`` of a key under a registered container."""
        parts = key.split(".")
        for i in range(len(parts) - 1):
            container = self._by_path.get(".".join(parts[:i]))
            if container is not None:
                return container, parts[i], ".".join(parts[i + 1:])
        return None

    def _join(self, container: ExpertContainer, child: str, rest: str) -> str:
        return container.prefix(child) + rest

    def to_global(self, key: str) -> str:
        """A model key (or fqn) with its expert's local name replaced by the global one."""
        found = self._split(key)
        if found is None:
            return key
        container, child, rest = found
        return self._join(container, self._to_global[container.path].get(child, child), rest)

    def to_local(self, key: str) -> str | None:
        """A checkpoint key with the expert's global name replaced by this rank's local one;
        ``None`` for an expert another rank holds."""
        found = self._split(key)
        if found is None:
            return key
        container, child, rest = found
        local = self._to_local[container.path].get(child)
        return None if local is None else self._join(container, local, rest)

    def all_local(self, key: str) -> list[str]:
        """Every local expert's key of the same part as ``key`` (an expert's key under any
        global name), for optimizer param-group membership; ``[key]`` for other keys."""
        found = self._split(key)
        if found is None:
            return [key]
        container, _, rest = found
        return [self._join(container, local, rest) for local in container.local_names]

    def container_of(self, key: str) -> str | None:
        """The path of the registered container ``key`` lies under, else ``None``."""
        found = self._split(key)
        return None if found is None else found[0].path

    def leads(self) -> bool:
        """Whether this rank sends its experts into a full state dict: it is the lowest rank of
        the unit holding some of its experts (one copy of every expert), or they are not
        managed by any unit."""
        me = global_rank()
        return any(not ranks or min(ranks) == me for _, _, ranks in self.claims())

    # ------------------------------------------------------------------ whole state dicts

    def model_to_global(self, msd: dict[str, Any]) -> dict[str, Any]:
        return {self.to_global(k): v for k, v in msd.items()} if self else msd

    def model_to_local(self, msd: dict[str, Any]) -> dict[str, Any]:
        """Keys of other ranks' experts are left out (a full or another layout's dict)."""
        if not self:
            return msd
        out = {}
        for key, value in msd.items():
            local = self.to_local(key)
            if local is not None:
                out[local] = value
        return out

    def optim_to_global(self, osd: dict[str, Any]) -> dict[str, Any]:
        return self._optim(osd, self.to_global, lambda k: [self.to_global(k)]) if self else osd

    def optim_to_local(self, osd: dict[str, Any]) -> dict[str, Any]:
        """State keys of other ranks' experts are left out; an expert named in a param group
        (under any global name: the group came from whichever rank DCP kept it of) stands for
        every local expert's same part, so each optimizer group is matched by its experts."""
        return self._optim(osd, self.to_local, self.all_local) if self else osd

    def _optim(self, osd: dict[str, Any], rename: Any, members: Any) -> dict[str, Any]:
        """``osd`` (nested ``{"state": {fqn: ...}, "param_groups": [...]}``, or flattened
        ``state.<fqn>.<name>`` / ``param_groups.<fqn>.<key>``) with fqns renamed."""
        out: dict[str, Any] = {}
        for key, value in osd.items():
            if key == "state" and isinstance(value, dict):
                state = {}
                for fqn, entries in value.items():
                    new = rename(fqn) if isinstance(fqn, str) else fqn
                    if new is not None:
                        state[new] = entries
                out[key] = state
            elif key == "param_groups" and isinstance(value, list):
                out[key] = [self._param_group(g, members) for g in value]
            elif "." in key and key.split(".", 1)[0] in ("state", "param_groups"):
                head, fqn = key.split(".", 1)
                new = rename(fqn)
                if new is not None:
                    out[f"{head}.{new}"] = value
            else:
                out[key] = value
        return out

    @staticmethod
    def _param_group(group: Any, members: Any) -> Any:
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            return group
        params: list[Any] = []
        for fqn in group["params"]:
            for new in (members(fqn) if isinstance(fqn, str) else [fqn]):
                if new not in params:
                    params.append(new)
        return {**group, "params": params}

    @staticmethod
    def held_elsewhere(held: set[tuple[str, str]], top: str) -> Callable[[str], bool] | None:
        """Whether a checkpoint key ``<top>.<container>.<global name>.*`` is an expert some
        rank holds (``held``: every rank's (container, global name)); ``None`` without any."""
        if not held:
            return None
        paths = {path for path, _ in held}

        def expected(key: str) -> bool:
            parts = key.split(".")
            if parts[0] != top:
                return False
            for i in range(1, len(parts) - 1):
                path = ".".join(parts[1:i])
                if path in paths and (path, parts[i]) in held:
                    return True
            return False

        return expected

    # ------------------------------------------------------------------ cross-rank check

    def claims(self) -> list[Claim]:
        """This rank's experts: (container, global name, ranks of the unit holding it); the
        ranks are ``()`` for experts no unit manages (nothing to check)."""
        out: list[Claim] = []
        for c in self.containers:
            ranks: frozenset[int] = frozenset()
            for p in c.module.parameters():
                record = _registry.record_of(p)
                if record is not None:
                    ranks |= unit_ranks(record.group)
            out.extend((c.path, name, tuple(sorted(ranks))) for name in c.global_names)
        return out


def check_claims(found: list[tuple[int, list[Claim]]]) -> str | None:
    """The first inconsistency in every rank's ``(global rank, claims)``: each global expert
    must be held by exactly the ranks of one unit (its expert-data-parallel replicas and
    shards), every one of which names it; two EP ranks naming one global index would write
    two experts under one name."""
    holders: dict[tuple[str, str], tuple[int, ...]] = {}
    claimed: dict[tuple[str, str], set[int]] = {}
    for rank, claims in found:
        for path, name, ranks in claims:
            if not ranks:
                continue
            where = f"experts '{path}'" if path else "experts"
            first = holders.setdefault((path, name), ranks)
            if first != ranks:
                return (f"global expert index {name} of {where} is registered (register_experts) "
                        f"on ranks {list(first)} and on ranks {list(ranks)}, units holding "
                        "different experts: give every EP rank's experts their own global "
                        "indices (e.g. range(ep_rank * local, (ep_rank + 1) * local))")
            claimed.setdefault((path, name), set()).add(rank)
    for (path, name), ranks in holders.items():
        missing = sorted(set(ranks) - claimed[(path, name)])
        if missing and all(any(r == m for r, _ in found) for m in missing):
            where = f"experts '{path}'" if path else "experts"
            return (f"ranks {list(ranks)} hold one unit of {where}, but global expert index "
                    f"{name} is registered on some of them only (not on ranks {missing}): "
                    "every rank of an expert's unit must register it under the same global index")
    return None


def narrow_unit_error(model: nn.Module, narrow: dict[int, tuple[frozenset[int], str]],
                      wider: frozenset[int]) -> str | None:
    """Units whose ranks are a part of the model's (``narrow``: id(group) -> (ranks, unit
    name)) are accepted when every parameter of theirs is a registered expert; else the error
    naming the first other parameter and the fix."""
    if not narrow:
        return None
    experts = {id(p) for c in expert_containers(model) for p in c.module.parameters()}
    for name, param in model.named_parameters():
        record = _registry.record_of(param)
        if record is None or id(record.group) not in narrow or id(param) in experts:
            continue
        ranks, unit = narrow[id(record.group)]
        return (
            f"'{name}' belongs to unit '{unit}' on ranks {sorted(ranks)}, a part of the model's "
            f"ranks {sorted(wider)}: the other ranks hold different modules under its name "
            "(expert parallelism), which a checkpoint must store under global names. Declare "
            "this rank's experts with megatron_fsdp_v2.checkpoint.register_experts(<the module "
            "holding them>, global_indices=<their global indices>) on every rank before the "
            "checkpoint call (units on a part of the ranks may hold registered experts only)")
    return None


def global_rank() -> int:
    """This process's rank in the default group (0 outside ``torch.distributed``)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
