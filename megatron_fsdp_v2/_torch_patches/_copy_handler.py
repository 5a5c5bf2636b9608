"""Patch: an ``aten.copy_`` handler in DTensor's op table (torch 2.14 has none of its own), with
``_dtensor/_copy_rows.py``'s row-aware copy between equal placements of different rows."""

from __future__ import annotations

import torch

from ._op_handlers import make_handler
from ._patch import Patch, PatchTarget, Plan
from ._targets import op_table

__all__ = ["PATCH", "install", "is_installed", "uninstall"]


def _plan() -> Plan:
    from .._dtensor._copy_rows import copy_rows

    table, op = op_table(), torch.ops.aten.copy_.default
    if op in table:  # torch's own handler: not replaced
        return []
    return [(PatchTarget(table, op), make_handler(copy_rows))]


PATCH = Patch(
    "copy_",
    "DTensor copies local tensor to local tensor when placements match, though one of ours and "
    "a torch.chunk DTensor hold different rows",
    _plan,
)
install, uninstall, is_installed = PATCH.install, PATCH.uninstall, PATCH.is_installed
