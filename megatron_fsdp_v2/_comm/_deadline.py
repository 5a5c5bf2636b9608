"""Waits with a deadline for collectives whose completion the host cannot otherwise bound: on
CUDA, the library waits for a collective through an event, which never raises (see [Note:
recovery deadline]).

[Note: recovery deadline]
On gloo a collective that does not complete raises from ``Work.wait()`` after the group's
timeout. On CUDA the library never waits on the host: ``CommHandle.wait()`` makes the caller
stream wait on the event recorded after the collective, and an event wait neither blocks nor
fails. ``FSDPContext.recover`` after a failed step must know whether the collectives it finds
in flight completed (then buffers may be freed and training goes on) or not (the ranks failed
at different points: the group is unusable). So recovery hands a :class:`WaitBound` to the
:class:`~._collectives.CommStreams` its groups' collectives ran on, for the duration of its waits
(``CommStreams.bounded_waits``; no hidden context: the bound is an attribute of the object that
made every event handle). While it is set, every event wait of those streams first polls
``event.query()`` (a non-blocking host check) until the event completes, asking the process
groups for an error between polls (``Backend.get_error()``: the NCCL watchdog records a timeout
or communicator error there), and raises :class:`CollectiveTimeoutError` when a group reports
one or when the deadline passes.
The deadline is the largest timeout of the tree's groups (:func:`collective_timeout_s`) from the
start of recovery, the time after which the watchdog itself declares a collective failed; a
matched collective (every rank failed at the same point) completes long before. ``recover``
then resets the hook state, touches no buffer a collective may still write, and raises the
"cannot recover, restart the job" error. With NCCL's default asynchronous error handling the
watchdog ends the process when it detects the timeout, which may happen before this deadline
passes: the job then ends with the watchdog's error instead of this one; with
``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` this error is what the user sees. Outside recovery
nothing polls: the step keeps its waits on the device (no host synchronization).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveTimeoutError", "WaitBound", "collective_timeout_s", "group_error",
    "wait_for_event",
]

Clock = Callable[[], float]


class CollectiveTimeoutError(RuntimeError):
    """A collective waited on under a :class:`WaitBound` did not complete in time, or its
    group reported an error."""


@dataclass(frozen=True)
class WaitBound:
    """How long event waits may take: until ``deadline`` on ``clock``, or until ``check()``
    reports a failed group (its description; None while all are healthy)."""

    deadline: float
    seconds: float
    check: Callable[[], str | None]
    clock: Clock

    @classmethod
    def starting_now(cls, seconds: float, check: Callable[[], str | None] = lambda: None,
                     clock: Clock = time.monotonic) -> WaitBound:
        """A bound of ``seconds`` from now."""
        return cls(clock() + seconds, seconds, check, clock)


def wait_for_event(query: Callable[[], bool], bound: WaitBound | None,
                   what: str = "a collective",
                   sleep: Callable[[float], object] = time.sleep) -> None:
    """Under a ``bound``: return once ``query()`` (``torch.cuda.Event.query``) is true, polling
    with growing pauses (0.1 ms to 50 ms); raise if the deadline passes or a group fails first.
    Without one: return at once (the caller's stream waits on the device)."""
    if bound is None:
        return
    pause = 1e-4
    while not query():
        failed = bound.check()
        if failed is not None:
            raise CollectiveTimeoutError(f"{what} did not complete: {failed}")
        remaining = bound.deadline - bound.clock()
        if remaining <= 0:
            raise CollectiveTimeoutError(
                f"{what} did not complete within {bound.seconds:g} s (the collective timeout): "
                "its peers never issued the matching collective"
            )
        sleep(min(pause, remaining))
        pause = min(pause * 2, 0.05)


def collective_timeout_s(process_group: dist.ProcessGroup, device: torch.device) -> float:
    """The timeout ``process_group`` was created with (its backend's for ``device``), else torch's
    default for the backend."""
    try:
        return float(process_group._get_backend(device).options._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        nccl = device.type == "cuda"
        default = dist.constants.default_pg_nccl_timeout if nccl else dist.default_pg_timeout
        return float(default.total_seconds()) if default is not None else 600.0


def group_error(groups: Iterable[tuple[dist.ProcessGroup, torch.device]]) -> str | None:
    """The first of ``groups`` whose backend reports an error (NCCL's watchdog records a timeout
    or communicator failure), described, or None."""
    for group, device in groups:
        try:
            error = group._get_backend(device).get_error()
        except (AttributeError, RuntimeError):
            continue
        if error.name != "SUCCESS":
            return f"process group {group.group_name} reports {error.name}"
    return None
