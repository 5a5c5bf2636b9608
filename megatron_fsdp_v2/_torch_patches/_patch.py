"""The mechanics every patch of torch shares: find the places in torch that hold the objects to
replace, save the originals, rebind, and put the exact originals back.

A :class:`PatchTarget` is one place: an attribute of a module or class (read from its ``__dict__``,
so a ``staticmethod`` comes back as the same ``staticmethod`` object), or one entry of a dict
(DTensor's op table), possibly absent. A :class:`Patch` is a named set of targets with their
replacements, built by a ``plan`` function from the objects torch holds at install time; installing
applies the plan once, uninstalling restores every target whose value is still the replacement (a
target someone else rebound since keeps their object; torch's own entry of a table is never
touched).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import _registry
from ._version_gate import check_torch_version

__all__ = ["MISSING", "Patch", "PatchTarget"]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()  # a table entry or attribute that did not exist before the patch


@dataclass(frozen=True)
class PatchTarget:
    """One place holding an object: ``owner.<key>`` (module or class), or ``owner[key]``
    (``owner`` a dict)."""

    owner: Any
    key: Any

    def get(self) -> Any:
        if isinstance(self.owner, dict):
            return self.owner.get(self.key, MISSING)
        return vars(self.owner).get(self.key, MISSING)

    def set(self, value: Any) -> None:
        if isinstance(self.owner, dict):
            if value is MISSING:
                self.owner.pop(self.key, None)
            else:
                self.owner[self.key] = value
        elif value is MISSING:
            delattr(self.owner, self.key)
        else:
            setattr(self.owner, self.key, value)


# What a plan returns: each target with the object to put there.
Plan = list[tuple[PatchTarget, Any]]


class Patch:
    """One patch of torch: ``install`` (idempotent, behind the torch-version gate; registers
    ``uninstall`` with ``_registry.reset``), ``uninstall`` (idempotent; the exact original
    objects come back) and ``is_installed``."""

    def __init__(self, name: str, reason: str, plan: Callable[[], Plan]) -> None:
        self.name, self.reason, self._plan = name, reason, plan
        # (target, original, replacement) of each target rebound; None when not installed
        self._applied: list[tuple[PatchTarget, Any, Any]] | None = None

    def __repr__(self) -> str:
        return f"Patch({self.name!r}, installed={self.is_installed()})"

    def is_installed(self) -> bool:
        return self._applied is not None

    def install(self) -> None:
        if self._applied is not None:
            return
        check_torch_version()
        plan = self._plan()  # reads torch's current objects; nothing is changed yet
        applied = [(target, target.get(), replacement) for target, replacement in plan]
        done: list[tuple[PatchTarget, Any, Any]] = []
        try:
            for target, original, replacement in applied:
                target.set(replacement)
                done.append((target, original, replacement))
        except BaseException:
            for target, original, _ in reversed(done):  # all or nothing
                target.set(original)
            raise
        self._applied = applied
        # _registry.reset() puts torch back through this (the registry knows no layer above it).
        if self.uninstall not in _registry.reset_undos:
            _registry.reset_undos.append(self.uninstall)

    def uninstall(self) -> None:
        if self._applied is None:
            return
        for target, original, replacement in reversed(self._applied):
            if target.get() is replacement:
                target.set(original)
        self._applied = None

    def originals(self) -> list[tuple[PatchTarget, Any]]:
        """The targets this patch rebound and what they held before (empty when not installed)."""
        return [(target, original) for target, original, _ in self._applied or []]
