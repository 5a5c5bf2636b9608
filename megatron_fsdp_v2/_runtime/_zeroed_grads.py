"""What the library knows about the optimizer-facing gradients without reading their values,
and the one read left for parameters a rank did not use (see [Note: gradients known without a
host read]).

[Note: gradients known without a host read]
Reading a tensor's value on the host (``bool(t.any())``, ``.item()``) costs, on CUDA, a
synchronization: the CPU waits for the GPU and can no longer queue work ahead of it. The
steady-state step reads no value, for every strategy, however the gradients were cleared:

* ``zero_grad()`` (``set_to_none=True``): :meth:`GroupGrads.sweep` sees ``.grad is None`` on
  the host and forgets the gradients (frees the storage, unless [Note: main_grad kept on CPU]
  in ``_grads.py`` keeps it); nothing to read.
* ``zero_grad(set_to_none=False)``, or any other in-place write of the installed gradients
  (``p.grad.zero_()`` in a loop, clipping, an add through ``to_local()`` or a DTensor op): the
  library does not ask what they hold. On the reduce-each path the next window's reductions
  add onto them; on the accumulate path the window sets them aside before its first write and
  adds them back after its one collective, or, under ``no_shard``, adds onto them, which the
  all-reduce's ``1/D`` gives back unchanged ([Note: HSDP window carry] in ``_grads.py``). All
  are right for any values, zeros included, so nothing is read, nothing has to be detected,
  and ``torch.optim.Optimizer.zero_grad`` is not wrapped (torch has no hook there). The
  decision depends on the gradient state machine only, which every rank runs alike, so the
  ranks issue the same collectives without agreeing on anything first.
  ``FSDPModule.zero_grad`` zeroes ``main_grad`` itself and needs no carry.

* The one read left: a parameter that received no gradient on this rank in the window and had
  none installed gets ``.grad=None`` only if its reduced gradient is exactly zero (no rank used
  it, see [Note: gradients the optimizer sees] in ``_grad_views.py``). Whether other ranks used it
  reaches this rank only through the reduced values, so no host-side bookkeeping can decide it:
  :func:`reduced_nonzero` reads all such parameters of a group at once (one read per group and
  window, not one per parameter). DDP pays the same with ``find_unused_parameters=True`` (it
  copies its all-reduced usage bitmap to the host every step); FSDP2 instead requires every rank
  to use the same parameters. A model whose trained parameters all receive gradients on every
  rank reads nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["reduced_nonzero"]


def reduced_nonzero(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Whether each tensor holds a nonzero element: one host read for all of them."""
    if not tensors:
        return []
    return [bool(v) for v in torch.stack([t.any() for t in tensors]).tolist()]
