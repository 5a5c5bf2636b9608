"""What a flat group's ``main_grad`` holds and where its window stands: the states of the
gradient state machine (``GroupGrads`` in ``_grads.py``, which alone reads and sets them; its
components, the staging and the optimizer's views, are told what they need)."""

from __future__ import annotations

import enum

__all__ = ["GradState", "WindowState"]


class GradState(enum.Enum):
    """What ``main_grad`` holds."""

    EMPTY = "empty"
    """Nothing: the next gradient write overwrites (storage may be freed)."""
    ACCUMULATING = "accumulating"
    """Local, unreduced sums in the full-size ``main_grad`` (the accumulate path between the
    first and the last micro-batch)."""
    REDUCED = "reduced"
    """Reduced sums in this rank's part of ``main_grad``; new micro-batches are reduced first and
    then added."""


class WindowState(enum.Enum):
    """Where the gradient window stands, relative to what the optimizer was shown."""

    CLOSED = "closed"
    """Nothing staged or reduced since the last install (or clearing)."""
    OPEN = "open"
    """Something was staged or reduced that the optimizer has not been shown yet."""
    ENDING = "ending"
    """The window's steps (HSDP's outer reduction) were launched; installed when they finish."""
