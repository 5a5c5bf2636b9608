"""The order in which a materialization pass calls the modules' initializers, and the
initializers it refuses to guess about (see [Note: initializers that cover a subtree]).

Pure planning over the module tree: no tensor is allocated and nothing is called here;
``_materialize.py`` executes the plan.

[Note: initializers that cover a subtree]
Ordinary construction runs ``__init__`` top-down, and torch's convention is that a module's
``__init__`` ends by calling its own ``reset_parameters()``. So a *parent* that defines
``reset_parameters`` (a block that re-initializes its linears with a scaled normal, zeroes a
bias, sets its norm to ones) runs it after all of its children were built and initialized by
their own ``reset_parameters``: it overwrites what they drew, and draws after them. A pass that
only called each module's initializer for the module's own parameters would leave the children
with their default init: silently different values from the model built on the device.

So the plan walks the tree in module order, and a module whose ``reset_parameters`` *covers a
subtree* (it is callable, the module's unit has no ``param_init_fn``, and some module strictly
below it holds a parameter or buffer to materialize) is called after its subtree, with every
pending parameter of that subtree present as a full-size tensor holding what the children's own
initializers wrote. The subtree's values are written to the flat buffers only after the
outermost covering module ran. Modules that cover nothing keep the order they always had
(module order, one module's full parameters at a time). Cost: the full parameters of the largest
covered subtree are held at once.

A module below a covering one may have no initializer of its own (a custom norm holding
``weight = ones``): the covering ``reset_parameters`` is expected to set it. Whether it did is
checked through the tensor's version counter (every in-place write bumps it); a parameter left
unwritten raises ``RuntimeError`` naming it.

What cannot be reproduced is refused, not guessed: a module above pending parameters that has
no ``reset_parameters`` but defines another initializer that construction may have applied to
its whole subtree (``_init_weights`` / ``init_weights`` of a Hugging Face ``PreTrainedModel``,
which its ``post_init()`` applies after building; torch's ``_reset_parameters`` convention;
``initialize_weights``) raises ``RuntimeError`` naming the module and the method, before
anything is drawn or written. The user then passes ``param_init_fn`` (which replaces this whole
logic: called on each module that holds pending parameters, in module order), or calls
``model.to_empty(device=...)`` after ``fully_shard`` and initializes the model themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

__all__ = ["InitCall", "SUBTREE_INIT_METHODS", "plan_init_calls", "refuse_unreproducible_inits"]

# Initializers other than ``reset_parameters`` that construction may apply to a whole subtree.
SUBTREE_INIT_METHODS = ("_init_weights", "init_weights", "_reset_parameters", "initialize_weights")


@dataclass(frozen=True)
class InitCall:
    """One initializer call of a materialization pass.

    ``covering``: the module's ``reset_parameters`` covers its subtree (runs after it, sees its
    pending parameters). ``commit``: after this call, the values installed since the last
    commit are written to the flat buffers (False inside a covering module's subtree, whose
    values that module may still overwrite)."""

    name: str
    module: nn.Module
    covering: bool
    commit: bool


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _has_reset(module: nn.Module) -> bool:
    return callable(getattr(module, "reset_parameters", None))


def plan_init_calls(
    root: nn.Module,
    has_pending: Callable[[nn.Module], bool],
    may_cover: Callable[[nn.Module], bool],
) -> list[InitCall]:
    """The initializer calls of one pass over ``root``'s tree, in execution order.

    ``has_pending(m)``: ``m`` holds a parameter or buffer to materialize among its own (not its
    children's).
    ``may_cover(m)``: ``m``'s unit lets its ``reset_parameters`` cover a subtree (it is pending
    and has no ``param_init_fn``). See [Note: initializers that cover a subtree]."""
    calls: list[InitCall] = []
    visited: set[int] = set()

    def visit(name: str, module: nn.Module, in_region: bool) -> bool:
        """Plan ``module``'s subtree; returns whether it holds anything pending."""
        if id(module) in visited:  # a module reachable twice is initialized once, first place
            return False
        visited.add(id(module))
        own = has_pending(module)
        covering = _has_reset(module) and may_cover(module) and _pending_below(module)
        if own and not covering:
            calls.append(InitCall(name, module, covering=False, commit=not in_region))
        below = False
        for child_name, child in module.named_children():
            below |= visit(_join(name, child_name), child, in_region or covering)
        if covering:
            calls.append(InitCall(name, module, covering=True, commit=not in_region))
        return own or below

    def _pending_below(module: nn.Module) -> bool:
        return any(has_pending(m) for m in module.modules() if m is not module)

    visit("", root, False)
    return calls


def refuse_unreproducible_inits(
    root: nn.Module,
    has_pending: Callable[[nn.Module], bool],
    may_cover: Callable[[nn.Module], bool],
) -> None:
    """Raise ``RuntimeError`` for the first module above pending parameters whose subtree
    initializer is not ``reset_parameters`` (see [Note: initializers that cover a subtree]).
    Called before anything is drawn or written."""
    for name, module in root.named_modules():
        if _has_reset(module) or not may_cover(module):
            continue
        method = next(
            (m for m in SUBTREE_INIT_METHODS if callable(getattr(module, m, None))), None
        )
        if method is None or not any(has_pending(m) for m in module.modules()):
            continue
        where = f"'{name}' ({type(module).__name__})" if name else type(module).__name__
        raise RuntimeError(
            f"module {where} was built on the meta device and defines {method}(), which its "
            "construction may have applied to its whole subtree (as a Hugging Face "
            "PreTrainedModel's post_init() does), after its children initialized themselves; "
            "materializing module by module cannot reproduce that, so nothing was "
            "materialized. Build the model on the device, or pass param_init_fn=fn to "
            "fully_shard (fn(module) initializes that module's own parameters and buffers in "
            "place; called in module order; e.g. a Hugging Face model's _init_weights), or call "
            "model.to_empty(device=...) after fully_shard and initialize the model yourself "
            "(or load it with checkpoint.load_full_state_dict). A module that initializes its "
            "subtree with reset_parameters() is reproduced exactly"
        )
