"""Finding the targets of a patch: the modules that hold a torch function under its name (a module
that imported it by name holds its own reference, which a patch of the defining module alone
would miss), and the entries of DTensor's op table."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from ._patch import PatchTarget

__all__ = ["modules_holding", "op_table"]


def modules_holding(module_names: Iterable[str], name: str, original: Any) -> list[PatchTarget]:
    """``module.<name>`` of each named module whose attribute is ``original`` itself (a module
    missing from this torch is skipped; one holding something else is not ours to replace)."""
    targets = []
    for module_name in module_names:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if vars(module).get(name) is original:
            targets.append(PatchTarget(module, name))
    return targets


def op_table() -> dict[Any, Any]:
    """DTensor's table of custom op handlers, consulted before sharding propagation."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher._custom_op_handlers
