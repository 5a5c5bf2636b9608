"""Optimizers that cannot step on sharded parameters: refused at their first step, before
anything changes, naming the strategy that works.

[Note: optimizers that read across parameters]
Under every strategy but ``no_shard`` the optimizer sees each parameter as a ``Shard(0)``
DTensor holding this rank's rows (``(Shard(0), Shard(0))`` under HSDP outer ``optim``). An
elementwise update (SGD, Adam, Rprop, ...) needs nothing else: it runs on the local rows (see
[Note: local optimizer step]). An update that reduces over a parameter's elements goes through
DTensor, which redistributes (a norm, a mean: an all-reduce) and gives the same numbers, or
raises. Two of torch's optimizers cannot work on row shards at all:

* ``LBFGS`` flattens every gradient into one vector (``view(-1)`` and ``cat``; DTensor refuses
  to flatten an uneven shard) and runs its line search on dot products of that vector;
* ``Adafactor`` factors the second moment of a matrix into row and column means and updates
  them in place (``lerp_``) with placements that differ from the state's (DTensor refuses).

So they are refused at their first step when any parameter they hold is sharded, with the
strategy that gives them whole parameters (``no_shard``: every rank holds each parameter,
gradients are all-reduced; the same numbers as one process). Nothing has been changed then:
the refusal comes before the gradients of an unfinished window are reduced. Their subclasses
are refused too (same algorithm). FSDP2 fails the same way, deep in DTensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .._buffers._plan import Extent
from ._flat_param_group import FlatParamGroup

__all__ = ["CROSS_PARAMETER_OPTIMIZERS", "sharded_step_refusal"]

CROSS_PARAMETER_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    cls for cls in (getattr(torch.optim, "LBFGS", None), getattr(torch.optim, "Adafactor", None))
    if cls is not None
)

_WHY = {
    "LBFGS": "it flattens every gradient into one vector and searches along it",
    "Adafactor": "it factors each matrix's second moment into row and column means",
}


def sharded_step_refusal(
    optimizer: torch.optim.Optimizer, groups: Iterable[FlatParamGroup]
) -> str | None:
    """The error message for ``optimizer`` stepping on sharded parameters of ``groups``, or
    ``None`` when it may step. Runs when the optimizer's groups are (re)collected, not per
    step."""
    if not isinstance(optimizer, CROSS_PARAMETER_OPTIMIZERS):
        return None
    sharded = [g for g in groups if g.plan.optimizer_placement is not Extent.FULL]
    if not sharded:
        return None
    base = next(c for c in CROSS_PARAMETER_OPTIMIZERS if isinstance(optimizer, c)).__name__
    owner = sharded[0].owner or "a fully_shard unit"
    return (
        f"{type(optimizer).__name__} cannot step on the parameters of {owner}"
        f" (sharding_strategy='{sharded[0].strategy.value}'): each rank holds only some rows of "
        f"each parameter, and {_WHY[base]}. Wrap the model with sharding_strategy='no_shard' "
        "(whole parameters on every rank, the same numbers as one process) to use "
        f"torch.optim.{base}, or use an elementwise optimizer (SGD, Adam, AdamW, Rprop, ...) "
        "with the sharded strategies. Nothing was changed"
    )
