"""The root's lazy init, at its first forward: the unit becomes the root of every unit below it,
which then share one ``FSDPContext`` (one allocator, one reduction coalescer), and a model built
on the meta device gets its values."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _registry
from .._init._materialize import materialize
from ._context import FSDPContext

if TYPE_CHECKING:
    from ._state import FSDPState

__all__ = ["lazy_init"]


def _require_same(named: list[tuple[str, FSDPState]], root: FSDPState, option: str,
                  why: str) -> None:
    """Raise ``ValueError`` (at the root's lazy init, before any collective) unless every unit
    of the tree passed the same ``fully_shard`` ``option``."""
    wanted = getattr(root, option)
    differing = [f"'{name or '<root>'}' ({getattr(s, option)})" for name, s in named
                 if getattr(s, option) != wanted]
    if differing:
        raise ValueError(
            f"fully_shard({option}=...) must be the same for every unit of a model, i.e. the "
            f"same for every fully_shard call ({why}): the root has {wanted}, units "
            f"{', '.join(differing)} differ; pass the same value to every fully_shard call of "
            "this model"
        )


def lazy_init(root: FSDPState) -> None:
    """First forward of ``root``: it is the root of every unit below it."""
    named = _registry.unit_states(root.module)
    states = [s for _, s in named]
    # One allocator and one reduction coalescer serve the whole tree.
    _require_same(named, root, "enable_trace_pool", "one allocator serves them all")
    _require_same(named, root, "reduce_bucket_size_mb", "the buckets span units")
    _require_same(named, root, "refresh_bucket_size_mb", "the buckets span units")
    ctx = FSDPContext(root, states)
    # [Note: gradients in place] a unit with units below it arms on the accumulate path only
    # (prepare_gradients): every proper prefix of a unit's name that names a unit is a parent.
    names = {name for name, _ in named}
    parents = {""} if len(named) > 1 else set()
    for name, _ in named:
        parts = name.split(".")
        parents.update(p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in names)
    for name, state in named:
        state.fqn = name or "<root>"
        state.owns_nested_units = name in parents
        state.ctx = ctx
        # One allocator for the tree, so the scratch-buffer peak is the tree's peak.
        ctx.allocator.adopt(state.allocator)
        state.allocator = ctx.allocator
        for index, group in enumerate(state.groups):
            group.allocator = ctx.allocator
            group.use_reduction_buckets(ctx.coalescer)
            group.name = f"unit '{state.fqn}' group {index}"
    # A model built on the meta device gets its values now, in whole-tree module order.
    materialize(root.module)
