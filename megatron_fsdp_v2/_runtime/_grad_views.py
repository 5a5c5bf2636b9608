"""What the optimizer sees of a flat group's gradients: the DTensor views of ``main_grad``
installed as ``.grad`` after a window, and what the user did to them since (see [Note:
gradients the optimizer sees]). A part of :class:`~._grads.GroupGrads`.

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
  in ``utils.py``). A parameter this rank did not use and holds no rows of stays ``None``:
  another rank's use cannot show in values this rank does not hold.
* A parameter frozen (``requires_grad_(False)``) in the middle of a window keeps what it
  accumulated before, as torch's ``.grad`` does: its view is installed like a trained one's
  (``_frozen_in_window``; the group still reduces at the window's end even when none of its
  parameters trains any more). A gradient installed before it was frozen stays installed until
  the user clears it.
* Between the step and the next backward, :meth:`GroupGrads.sweep` takes in what the user
  did: all set to ``None`` (``optimizer.zero_grad()``): free the storage. Some set to ``None``
  (an optimizer over part of a unit): zero those, so they start afresh while the others keep
  accumulating. Replaced by another tensor: adopt its values. Zeroed in place on the accumulate
  path (``zero_grad(set_to_none=False)``): the zeros are valid local partial sums, so the next
  window takes the one-collective path again. Neither case reads a value on the host, nor
  does the ``None`` rule above when every parameter received a gradient here; see [Note:
  gradients known without a host read] in ``_zeroed_grads.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from .._buffers._plan import Collective, Extent, GradPath
from .._profiling import traced
from ._grad_state import GradState
from ._issuer import CollectiveLaunch
from ._zeroed_grads import ZeroMarks, all_zeros, reduced_nonzero, zero_outside

if TYPE_CHECKING:
    from ._flat_param_group import FlatParamGroup

__all__ = ["OptimizerGrads"]


class OptimizerGrads:
    """The optimizer-facing part of :class:`~._grads.GroupGrads` (its state lives there)."""

    # Set by GroupGrads.__init__ (see there).
    group: FlatParamGroup
    state: GradState
    _main_grad: torch.Tensor | None
    pending_install: bool
    _views: list[DTensor] | None
    _installed: list[DTensor | None]
    _any_installed: bool
    _received: list[bool]
    _frozen_in_window: list[bool]
    _zero_marks: ZeroMarks
    _window_issued: bool
    _path_read: bool

    if TYPE_CHECKING:  # defined by GroupGrads or its other part
        def ensure_main_grad(self) -> torch.Tensor: ...
        def main_grad_local(self) -> torch.Tensor: ...
        def _local_bounds(self) -> tuple[int, int]: ...
        def release_storage(self) -> None: ...
        def restart_accumulation_from_zeros(self) -> None: ...

    def view(self, index: int) -> DTensor:
        """Parameter ``index``'s gradient view (zero rows for an empty local shard). Built for
        every parameter, trained or not: one frozen after it received a gradient keeps it."""
        if self._views is None:
            group = self.group
            local = self.main_grad_local()
            self._views = [
                group.to_dtensor(group.local_view(local, i), i) for i in range(len(group.records))
            ]
        return self._views[index]

    def note_frozen(self, index: int) -> None:
        """Parameter ``index`` stopped requiring gradients: what it accumulated in this window
        stays its gradient (torch's ``.grad`` is not cleared by ``requires_grad_(False)``).
        Marked whatever this rank holds: another rank may have accumulated for it, which only
        the reduced values show (the install reads them, as for a parameter unused here)."""
        self._frozen_in_window[index] = True

    @traced("mfsdp::install")
    def install(self) -> None:
        """Expose the reduced gradients (after the window's last micro-batch)."""
        if self.state is not GradState.REDUCED:
            return
        self.ensure_main_grad()
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
        self._received = [False] * len(self._received)
        self._frozen_in_window = [False] * len(self._frozen_in_window)
        self.pending_install = False
        self._window_issued = False
        self._path_read = False
        self._any_installed = any_installed
        self._zero_marks.clear()
        if not any_installed:  # nothing to show: all zeros, start the next window afresh
            self.release_storage()

    def note_zeroed_in_place(self, indices: Iterable[int]) -> None:
        """An optimizer's ``zero_grad(set_to_none=False)`` just zeroed the installed gradients
        of these parameters, where still installed (see [Note: gradients known without a host
        read] in ``_zeroed_grads.py``)."""
        if not self._any_installed or self._main_grad is None:
            return
        records = self.group.records
        zeroed = []
        for index in indices:
            view = self._installed[index]
            if view is not None and records[index].dist_param.grad is view:
                zeroed.append((index, view))
        if zeroed:
            self._zero_marks.mark(zeroed, self._main_grad._version)

    def sweep(self) -> None:
        """Take in what the user did to the installed gradients since they were installed."""
        if not self._any_installed:
            return
        live: list[tuple[int, DTensor]] = []
        cleared = []
        replaced = False
        for index, record in enumerate(self.group.records):
            view = self._installed[index]
            if view is None:
                continue
            grad = record.dist_param.grad
            if grad is view:
                live.append((index, view))
            elif grad is None:
                cleared.append(index)
                self._installed[index] = None
            else:  # replaced by the user: adopt its values
                with torch.no_grad():
                    view._local_tensor.copy_(grad.to_local() if isinstance(grad, DTensor) else grad)
                record.dist_param.grad = view
                live.append((index, view))
                replaced = True
        if not live:
            self.release_storage()
            return
        main_grad = self.ensure_main_grad()
        # Before this sweep writes anything: zeroed by an optimizer, known without a read.
        known_zero = not replaced and self._zero_marks.all_zero(live, main_grad._version)
        self._zero_marks.clear()
        for index in cleared:
            self.view(index)._local_tensor.zero_()
        if (
            self.group.plan.grad_path is not GradPath.ACCUMULATE_THEN_REDUCE
            or self.state is not GradState.REDUCED
        ):
            return
        if known_zero:
            # Every other row is zeroed here, whatever it held (other ranks' regions after a
            # reduce-scatter, padding, parameters without a gradient): all of main_grad is
            # zero, as after FSDPModule.zero_grad, without writing the live views again.
            zero_outside(main_grad, [view._local_tensor for _, view in live])
            self.restart_accumulation_from_zeros()
        elif not self.pending_install and not self._path_read and self._zero_on_every_rank():
            # Zeroed by means the library did not see: read to know (one read per group and
            # window, before its first reduction; the rest of the window keeps its path).
            # Only the rest of main_grad, the other ranks' regions after a reduce-scatter
            # (nothing for no_shard), is zeroed, instead of writing the whole buffer a second
            # time (measured: 10 ms of a 110 ms forward, 1-rank 29.5M GPT).
            self._zero_outside_local()
            self.restart_accumulation_from_zeros()

    def _zero_on_every_rank(self) -> bool:
        """Whether the optimizer-facing gradients are zero on every rank of the group's shard
        axis: the path of the next window must be the same on all of them. Replicated
        (``no_shard``) gradients are the same everywhere: one local read. Sharded ones differ
        by rank (a rank may hold only rows the optimizer cleared, or only padding), so the local
        verdicts are summed with one scalar all-reduce, then read (see [Note: gradients known
        without a host read] in ``_zeroed_grads.py``)."""
        self._path_read = True  # until new values are installed or the gradients cleared
        local_zero = all_zeros(self.main_grad_local())
        group = self.group
        if group.plan.optimizer_placement is not Extent.SHARD:
            return local_zero
        nonzero = torch.full((1,), 0.0 if local_zero else 1.0, device=group.device)
        group.issuer.launch(CollectiveLaunch(
            Collective.ALL_REDUCE, nonzero, None, "zeroed-gradients agreement"), False).finish()
        return all_zeros(nonzero)

    def _zero_outside_local(self) -> None:
        lo, hi = self._local_bounds()
        main_grad = self.ensure_main_grad()
        main_grad[:lo].zero_()
        main_grad[hi:].zero_()
