"""A clear error for ``torch.autograd.grad`` with respect to fully_shard parameters.

[Note: autograd.grad with respect to parameters]
Forward runs on the compute parameters (views of the gathered model weights), while
``module.parameters()`` returns the optimizer-facing DTensors, which no graph contains. So
``torch.autograd.grad(loss, model.parameters())`` used to raise torch's "One of the differentiated
Tensors appears to not have been used in the graph. Set allow_unused=True", and with
``allow_unused=True`` returned ``None`` for every parameter, silently. Taking the compute
parameters instead would not help either: ``autograd.grad`` never runs ``AccumulateGrad``, so
the post-accumulate-grad hooks that reduce and shard gradients never fire, and the result would
be this rank's unreduced, unsharded gradient (and the unit would wait for a backward that does
not come). The library's gradients exist only through ``.backward()``.

So the first ``fully_shard`` wraps ``torch.autograd.grad`` with :func:`guarded_grad`
(``_torch_patches/_autograd_grad.py``; ``_registry.reset`` restores it):
when ``inputs`` holds a parameter managed by a unit (either object), it raises
``RuntimeError`` naming the parameter and the fix before anything runs; any other call goes to
torch's function unchanged. The decision depends on ``inputs`` only, so every rank (running the
same code) raises alike, and no collective is involved. Gradients with respect to other tensors
(inputs, activations: a gradient penalty) are unaffected. A name bound before the first
``fully_shard`` (``from torch.autograd import grad``) keeps torch's function, and its old
behavior.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.autograd

from .. import _registry

__all__ = ["guarded_grad"]


def _tensors_of(inputs: Any) -> tuple[Any, list[Any]]:
    """``inputs`` as torch will take them (a generator materialized once) and its tensors."""
    if isinstance(inputs, dict):
        return inputs, list(inputs.values())
    if isinstance(inputs, (torch.Tensor, torch.autograd.graph.GradientEdge)):
        return inputs, [inputs]
    inputs = tuple(inputs)
    return inputs, list(inputs)


def guarded_grad(torch_fn: Callable[..., Any], outputs: Any, inputs: Any, *args: Any,
                 **kwargs: Any) -> Any:
    """``torch.autograd.grad`` (``torch_fn``), refused with respect to managed parameters."""
    inputs, values = _tensors_of(inputs)
    managed = [
        f"'{record.fqn}' of {record.group.owner}"
        for record in (_registry.record_of(v) for v in values if isinstance(v, torch.Tensor))
        if record is not None
    ]
    if managed:
        more = f" and {len(managed) - 3} more" if len(managed) > 3 else ""
        raise RuntimeError(
            f"torch.autograd.grad with respect to fully_shard parameters ({', '.join(managed[:3])}"
            f"{more}) "
            "is not supported: the forward ran on compute copies of them, and their gradients "
            "are reduced across ranks and sharded only by loss.backward() (autograd.grad would "
            "return None for them, or raise 'not used in the graph'). Call loss.backward() and "
            "read p.grad (a DTensor holding this rank's rows), or take torch.autograd.grad "
            "with respect to tensors that are not parameters (inputs, activations) only"
        )
    return torch_fn(outputs, inputs, *args, **kwargs)

