"""Keeping the library's forward hooks out of ``torch.compile`` graphs.

[Note: hooks outside compiled regions]
``block.compile()`` compiles the module's ``_call_impl``, so the module's forward hooks are traced
along with its ``forward``; ``torch.compile(block)`` on a block already wrapped does the same
through the ``OptimizedModule``. The hooks must not be traced: they issue collectives, swap the
objects in ``module._parameters`` (``_registered_params.py``), rebind the compute parameters'
``.data`` to views of a gathered scratch buffer at the first ZeRO-3 gather (AOTAutograd rejects
that: "set_ on a graph input") and free or re-grow scratch-buffer storage (``_allocator.py``). Every
forward hook the library registers is therefore wrapped with :func:`eager_hook`: dynamo breaks the
graph at the call and runs the hook eagerly, so a compiled block becomes one graph for the user code
between its hooks (its ``forward``). That graph always sees the same compute parameter objects
(plain tensors viewing the unsharded weights; ZeRO-3 refills their storage in place), so it is
compiled once, not once per step. ``fullgraph=True`` therefore needs the hooks outside the compiled
callable: ``torch.compile(block)`` *before* ``fully_shard(...)``, which puts them on the
``OptimizedModule``.

Backward hooks (``_RegisterPostBackward``, the pre-backward multi-grad hook, the final callback)
run in the autograd engine, outside the compiled graphs, as long as compiled autograd is off
(it is not supported).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar, cast

import torch

__all__ = ["eager_hook"]

_P = ParamSpec("_P")
_R = TypeVar("_R")

_REASON = (
    "megatron_fsdp_v2 forward hook: it gathers/frees weights and swaps parameters, so it always "
    "runs eagerly. For fullgraph=True, compile the module with torch.compile(module) before "
    "fully_shard(module), which keeps the hooks outside the compiled function"
)


def eager_hook(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` as a hook ``torch.compile`` never traces (a graph break where it is called)."""
    # Imports dynamo on first use: by then ``fully_shard`` (DTensor) has imported it anyway.
    return cast(Callable[_P, _R], torch.compiler.disable(fn, recursive=True, reason=_REASON))
