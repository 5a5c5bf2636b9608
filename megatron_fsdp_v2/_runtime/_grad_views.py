"""What the optimizer sees of a flat group's gradients: the DTensor views of ``main_grad``
installed as ``.grad`` after a window, and what the user did to them since (see [Note:
gradients the optimizer sees]). A component of :class:`~._grads.GroupGrads` (``grads.views``),
which decides when to install and frees ``main_grad``.

[Note: gradients the optimizer sees]
Each optimizer-facing parameter gets a DTensor view of its rows of ``main_grad``, built once (so
optimizers keyed on gradient identity see stable objects) and installed after the last
micro-batch of a window. Per parameter, as in single-process torch:

* ``None`` when nothing flowed into it since its gradient was last cleared (AdamW then leaves
  it alone: no weight decay, no momentum step). Locally that is known (a compute ``.grad`` was
  set, or its in-place alias written: [Note: gradients in place]); another rank's use shows
  in the reduced values, so a parameter unused here whose reduced local gradient is exactly
  zero gets ``None``. Also ``None``: a parameter that does not train.
* An empty local shard (no rows of the parameter here, uneven rows or a padding-only rank) is
  not an exception: a parameter that received a gradient on this rank gets a zero-row view
  (free: no storage of its own), as FSDP2 gives every rank a gradient for every parameter.
  So ``[p.grad for p in params if p.grad is not None]`` holds the same parameters on every
  rank that used the same parameters (FSDP2's own requirement), and torch's clipping, or a
  hand-written one, issues the same collectives everywhere (see [Note: clipping collectives]
  in ``_clipping.py``). A parameter this rank did not use and holds no rows of stays ``None``:
  another rank's use cannot show in values this rank does not hold.
* A parameter frozen (``requires_grad_(False)``) in the middle of a window keeps what it
  accumulated before, as torch's ``.grad`` does: its view is installed like a trained one's
  (``_frozen_in_window``; the group still reduces at the window's end even when none of its
  parameters trains any more). A gradient installed before it was frozen stays installed until
  the user clears it.
* Between the step and the next backward, :meth:`GroupGrads.sweep` takes in what the user
  did: all set to ``None`` (``optimizer.zero_grad()``): free the storage. Some set to ``None``
  (an optimizer over part of a unit): zero those, so they start afresh while the others keep
  accumulating. Replaced by another tensor: adopt its values. Written in place
  (``zero_grad(set_to_none=False)``, clipping, any in-place op): nothing to do here; the next
  window adds onto whatever they hold (the accumulate path carries them past its collective:
  [Note: HSDP window carry] in ``_grads.py``). None of this reads a value on the host, nor
  does the ``None`` rule above when every parameter received a gradient here; see [Note:
  gradients known without a host read] in ``_zeroed_grads.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from ._zeroed_grads import reduced_nonzero

if TYPE_CHECKING:
    from ._flat_param_group import FlatParamGroup

__all__ = ["OptimizerGradViews"]


class OptimizerGradViews:
    """The DTensor gradient views of a flat group's optimizer-facing parameters, which of them
    are installed as ``.grad``, and what each parameter received since the last install."""

    def __init__(self, group: FlatParamGroup, main_grad_local: Callable[[], torch.Tensor]) -> None:
        self.group = group  # its records and DTensor placements: read only
        # The owner's optimizer-facing part of ``main_grad``, its storage allocated.
        self._main_grad_local = main_grad_local
        n = len(group.records)
        self._views: list[DTensor] | None = None  # built once, at the first use
        self._installed: list[DTensor | None] = [None] * n  # what each .grad was set to
        self._any_installed = False
        # Parameters that received a gradient on this rank since the last install.
        self._received = [False] * n
        # Parameters frozen (``requires_grad_(False)``) since the last install: what they
        # accumulated in the window before stays theirs, as in torch (see [Note: gradients the
        # optimizer sees]).
        self._frozen_in_window = [False] * n

    def view(self, index: int) -> DTensor:
        """Parameter ``index``'s gradient view (zero rows for an empty local shard). Built for
        every parameter, trained or not: one frozen after it received a gradient keeps it."""
        if self._views is None:
            group = self.group
            local = self._main_grad_local()
            self._views = [
                group.to_dtensor(group.local_view(local, i), i) for i in range(len(group.records))
            ]
        return self._views[index]

    def note_received(self, received: list[bool]) -> None:
        """Per parameter, whether it received a gradient on this rank in a backward."""
        for index, flag in enumerate(received):
            if flag:
                self._received[index] = True

    def note_frozen(self, index: int) -> None:
        """Parameter ``index`` stopped requiring gradients: what it accumulated in this window
        stays its gradient (torch's ``.grad`` is not cleared by ``requires_grad_(False)``).
        Marked whatever this rank holds: another rank may have accumulated for it, which only
        the reduced values show (the install reads them, as for a parameter unused here)."""
        self._frozen_in_window[index] = True

    def forget_window(self) -> None:
        """Gradients cleared: nothing received or frozen in a window counts any more."""
        self._received = [False] * len(self._received)
        self._frozen_in_window = [False] * len(self._frozen_in_window)

    def forget_installed(self) -> None:
        """``main_grad``'s storage was freed: no view is installed any more."""
        self._installed = [None] * len(self._installed)
        self._any_installed = False

    def install(self) -> bool:
        """Set each optimizer-facing parameter's ``.grad`` to its view of the reduced
        ``main_grad``, or None (see [Note: gradients the optimizer sees]); returns whether any
        view was installed (if none, the owner starts the next window afresh)."""
        records = self.group.records
        views: list[DTensor | None] = [self.view(index) for index in range(len(records))]
        # No gradient here, none installed: None unless another rank's use shows in the
        # reduced values (the one host read left; see [Note: gradients known without a host
        # read] in _zeroed_grads.py), read for all such parameters at once. A parameter that
        # does not train gets None, unless it was frozen inside this window.
        unknown = []
        for index, view in enumerate(views):
            assert view is not None
            if self._received[index] or self._installed[index] is not None:
                continue
            if not records[index].dist_param.requires_grad and not self._frozen_in_window[index]:
                views[index] = None
            elif view._local_tensor.numel() == 0:  # no rows here: nothing to read
                views[index] = None
            else:
                unknown.append((index, view))
        flags = reduced_nonzero([view._local_tensor for _, view in unknown])
        for (index, _), used_elsewhere in zip(unknown, flags):
            if not used_elsewhere:
                views[index] = None
        any_installed = False
        for index, (record, view) in enumerate(zip(records, views)):
            record.dist_param.grad = view
            self._installed[index] = view
            any_installed |= view is not None
        self.forget_window()
        self._any_installed = any_installed
        return any_installed

    def sweep(self) -> bool:
        """Take in what the user did to the installed gradients since they were installed
        (see [Note: gradients the optimizer sees]). Values written in place are kept as they
        are, not read: the next window adds onto them. Returns whether every installed
        gradient was cleared (the owner then frees ``main_grad``)."""
        if not self._any_installed:
            return False
        live = False
        cleared = []
        for index, record in enumerate(self.group.records):
            view = self._installed[index]
            if view is None:
                continue
            grad = record.dist_param.grad
            if grad is view:
                live = True
            elif grad is None:
                cleared.append(index)
                self._installed[index] = None
            else:  # replaced by the user: adopt its values
                with torch.no_grad():
                    view._local_tensor.copy_(grad.to_local() if isinstance(grad, DTensor) else grad)
                record.dist_param.grad = view
                live = True
        if not live:
            return True
        for index in cleared:
            self.view(index)._local_tensor.zero_()
        return False
