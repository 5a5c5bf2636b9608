"""Patch: an ``aten._foreach_norm.Scalar`` handler in DTensor's op table (torch 2.14 has none of
its own) that gives an infinity norm over an empty local shard the value 0
(``_dtensor/_empty_shard_norms.py``), as torchao's ``precompute_float8_dynamic_scale_for_fsdp``
needs on uneven rows."""

from __future__ import annotations

from typing import Any

import torch

from ._op_handlers import call_default, make_handler
from ._patch import Patch, PatchTarget, Plan
from ._targets import op_table

__all__ = ["PATCH", "install", "is_installed", "uninstall"]


def _plan() -> Plan:
    from .._dtensor._empty_shard_norms import stand_in_empty_shards

    table, op = op_table(), torch.ops.aten._foreach_norm.Scalar
    if op in table:  # torch's own handler: not replaced
        return []

    def empty_shard_norms(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        replaced = stand_in_empty_shards(args, kwargs)
        if replaced is None:
            return NotImplemented
        return call_default(op_call, *replaced)

    return [(PatchTarget(table, op), make_handler(empty_shard_norms))]


PATCH = Patch(
    "_foreach_norm",
    "the infinity norm of an empty local shard raises on that rank only, where the max over the "
    "ranks needs 0 (torchao's float8 scale precompute over uneven rows)",
    _plan,
)
install, uninstall, is_installed = PATCH.install, PATCH.uninstall, PATCH.is_installed
