"""Patch: handlers for the in-place random ops (``nn.init.*``) in DTensor's op table, with
``_dtensor/_random_init.py``'s single-process values on uneven rows (see [Note: random init of
uneven shards] there). Installed once; the fallback to DTensor's own path for other DTensors is
[Note: falling back to DTensor's own handling of an op] in ``_op_handlers.py``."""

from __future__ import annotations

import torch

from ._op_handlers import make_handler
from ._patch import Patch, PatchTarget, Plan
from ._targets import op_table

__all__ = ["PATCH", "RANDOM_INPLACE_OPS", "install", "is_installed", "uninstall"]

_aten = torch.ops.aten
RANDOM_INPLACE_OPS = (
    _aten.normal_.default,
    _aten.uniform_.default,
    _aten.bernoulli_.float,
    _aten.exponential_.default,
    _aten.log_normal_.default,
    _aten.cauchy_.default,
    _aten.geometric_.default,
    _aten.random_.default,
    getattr(_aten.random_, "from"),  # a Python keyword
    _aten.random_.to,
)


def _plan() -> Plan:
    from .._dtensor._random_init import random_op

    table = op_table()
    handler = make_handler(random_op)
    # An op DTensor has a handler of its own for keeps it.
    return [(PatchTarget(table, op), handler) for op in RANDOM_INPLACE_OPS if op not in table]


PATCH = Patch(
    "random_ops",
    "DTensor draws a shard's random values at torch.chunk offsets (or per rank), not at "
    "fully_shard's rows: nn.init on our parameters would differ from single-process values",
    _plan,
)
install, uninstall, is_installed = PATCH.install, PATCH.uninstall, PATCH.is_installed
