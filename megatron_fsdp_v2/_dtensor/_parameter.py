"""A DTensor made the optimizer-facing ``nn.Parameter`` without a trip through DTensor dispatch.

``nn.Parameter(dtensor)`` detaches its argument (torch's path for tensor subclasses), and a
DTensor's ``detach`` runs sharding propagation: for the library's placements, whose row ranges
make nearly every parameter a cache miss, the slow path (about half of ``fully_shard``'s CPU time
on the test suite's small models, measured with py-spy). A DTensor the library has just built
over its local rows has no autograd history and nobody else holds it, so the detach buys
nothing: :func:`as_parameter` sets ``requires_grad`` and torch's parameter flag on it directly,
which is what ``nn.Parameter`` does after its detach, and falls back to ``nn.Parameter`` itself
when this torch does not recognise the result as a parameter.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import DTensor


def as_parameter(fresh: DTensor, requires_grad: bool) -> nn.Parameter:
    """``nn.Parameter(fresh, requires_grad)`` for a DTensor just built from local rows that do
    not require grad (``DTensor.from_local``); ``fresh`` itself becomes the parameter."""
    if fresh.grad_fn is not None or fresh.requires_grad:
        raise ValueError("as_parameter takes a fresh DTensor without autograd history")
    fresh.requires_grad_(requires_grad)
    # torch's own flag for parameters that are tensor subclasses (nn.Parameter.__new__ sets it
    # on the detached subclass; isinstance(x, nn.Parameter) reads it).
    fresh._is_param = True
    if isinstance(fresh, nn.Parameter):
        return fresh
    return nn.Parameter(fresh.detach(), requires_grad=requires_grad)  # another torch's protocol
