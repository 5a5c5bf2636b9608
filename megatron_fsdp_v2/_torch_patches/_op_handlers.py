"""Handlers in DTensor's op table (``copy_``, the in-place random ops): the library's logic
decides, and ``NotImplemented`` from it means "DTensor's own path".

[Note: falling back to DTensor's own handling of an op]
DTensor's dispatch entry point is in C++ (``dispatchDTensorOp``; see the comment where
``OpDispatcher.dispatch`` used to be, torch/distributed/tensor/_dispatch.py, torch #167051). On
every call it looks the op up in ``_custom_op_handlers`` first, and torch has no Python entry to
its default handling of one op (sharding propagation, local call, output wrapping) that skips
the table. So a handler that wants DTensor's own behaviour for an input that is not ours can
only re-dispatch the op with its own entry taken out of the table, and must put the entry back
afterwards (also when the op raises), or the next call would skip the library's handling. This
happens only on that fallback path (DTensors on meshes ``fully_shard`` did not register, or a
``copy_`` between equal layouts), not on every call; a handler installed once without it would
recurse into itself. It stays here, with the rest of the patch mechanics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._slots import op_table

__all__ = ["Logic", "call_default", "make_handler"]

# The library's handling of one op: the result, or ``NotImplemented`` for DTensor's own path.
Logic = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]


def make_handler(logic: Logic) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]:
    """An op-table handler running ``logic``, with DTensor's own path as the fallback."""

    def handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = logic(op_call, args, kwargs)
        if result is not NotImplemented:
            return result
        return call_default(op_call, args, kwargs)

    handler.__qualname__ = handler.__name__ = f"megatron_fsdp_v2_{logic.__name__}"
    return handler


def call_default(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """DTensor's own handling of ``op_call`` on ``args`` (see [Note: falling back to DTensor's
    own handling of an op])."""
    table = op_table()
    mine = table.pop(op_call)
    try:
        return op_call(*args, **kwargs)
    finally:
        table[op_call] = mine
