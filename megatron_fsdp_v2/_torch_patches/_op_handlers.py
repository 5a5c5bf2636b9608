"""Handlers in DTensor's op table (``copy_``, the in-place random ops, ``_foreach_norm``): the
library's logic decides, and ``NotImplemented`` from it means "DTensor's own path".

[Note: falling back to DTensor's own handling of an op]
DTensor's dispatch entry point is in C++ (``dispatchDTensorOp``; see the comment where
``OpDispatcher.dispatch`` used to be, torch/distributed/tensor/_dispatch.py, torch #167051). On
every call it looks the op up in ``_custom_op_handlers`` first, so once a handler of ours is in
the table every call of that op reaches it, and re-dispatching the op from inside the handler
would reach it again. torch has no public entry to its default handling of one op. What the
C++ entry point does for an op it has no fast path for is a sequence of calls back into
``OpDispatcher``'s Python steps, and :func:`call_default` makes the same calls itself:
``unwrap_to_op_info`` (the op's local arguments and schema), ``_propagate_op_sharding_
dispatch_slow_path`` (sharding propagation, or a decomposition's result), ``_dispatch_get_
local_results_slow_path`` (redistributing the arguments, then the local op, random ops under
DTensor's RNG tracker) and ``_dispatch_fast_path_python_tail`` or ``OpDispatcher.wrap`` (the
result: ``self`` for an in-place op, new DTensors otherwise). Every one of these exists with
the same parameters on torch 2.11 to 2.15 (the version gate admits no other).

Before, the fallback took its own entry out of the table, re-dispatched the op and put the
entry back: a mutation of torch's table on every such call (every ``copy_`` between DTensors
that are not ours, every ``_foreach_norm`` of a gradient clip), visible to another thread
dispatching the same op meanwhile. Now the table changes only at install and uninstall, and
``tests/unit/test_torch_patches.py`` fails if a call changes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
    """DTensor's own handling of ``op_call`` on ``args``, without its op table (see [Note:
    falling back to DTensor's own handling of an op])."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import OutputSharding
    from torch.utils._python_dispatch import return_and_correct_aliasing

    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    sharding = dispatcher._propagate_op_sharding_dispatch_slow_path(
        op_call, args, kwargs, op_info, True)
    if not isinstance(sharding, OutputSharding):
        return sharding  # decomposed into other ops (inference mode): already the result
    op_info.output_sharding = sharding
    local_results = dispatcher._dispatch_get_local_results_slow_path(op_call, args, op_info)
    mesh = op_info.compute_mesh
    participating = mesh._is_current_rank_part_of_mesh()
    schema = op_info.schema
    assert schema is not None  # unwrap_to_op_info creates it
    in_place, out_variant = schema.is_inplace_op(), schema.is_out_variant_op()
    if in_place or out_variant or op_call._schema.name == "aten::equal":
        return dispatcher._dispatch_fast_path_python_tail(
            op_call, args, kwargs, mesh, sharding, local_results, participating, in_place,
            out_variant)
    result = dispatcher.wrap(local_results, sharding.output_spec)
    if participating and op_call._schema._is_view_op():
        return return_and_correct_aliasing(op_call, args, kwargs, result)
    return result
