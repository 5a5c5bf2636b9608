"""Waits with a deadline for collectives whose completion the host cannot otherwise bound: on
CUDA, the library waits for a collective through an event, which never raises (see [Note:
recovery deadline]).

[Note: recovery deadline]
On gloo a collective that does not complete raises from ``Work.wait()`` after the group's
timeout. On CUDA the library never waits on the host: ``CommHandle.wait()`` makes the caller
stream wait on the event recorded after the collective, and an event wait neither blocks nor
fails. ``FSDPContext.recover`` after a failed step must know whether the collectives it finds
in flight completed (then buffers may be freed and training goes on) or not (the ranks failed
at different points: the group is unusable). So recovery runs its waits inside
:func:`bounded_waits`: every event wait first polls ``event.query()`` (a non-blocking host
check) until the event completes, asking the process groups for an error between polls
(``Backend.get_error()``: the NCCL watchdog records a timeout or communicator error there), and
raises :class:`CollectiveTimeoutError` when a group reports one or when the deadline passes.
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
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveTimeoutError", "bounded_waits", "collective_timeout_s", "group_error",
    "wait_for_event",
]

Clock = Callable[[], float]


class CollectiveTimeoutError(RuntimeError):
    """A collective waited on under :func:`bounded_waits` did not complete in time, or its
    group reported an error."""


@dataclass(frozen=True)
class _Bound:
    deadline: float  # on the clock below
    seconds: float
    check: Callable[[], str | None]  # a failed group, described, or None
    clock: Clock


_bound: ContextVar[_Bound | None] = ContextVar("mfsdp_wait_deadline", default=None)


@contextmanager
def bounded_waits(seconds: float, check: Callable[[], str | None] = lambda: None,
                  clock: Clock = time.monotonic) -> Iterator[None]:
    """Event waits inside the block (:func:`wait_for_event`) poll until completion and raise
    :class:`CollectiveTimeoutError` once ``seconds`` have passed or ``check()`` reports a
    failed group."""
    token = _bound.set(_Bound(clock() + seconds, seconds, check, clock))
    try:
        yield
    finally:
        _bound.reset(token)


def wait_for_event(query: Callable[[], bool], what: str = "a collective",
                   sleep: Callable[[float], object] = time.sleep) -> None:
    """Inside :func:`bounded_waits`: return once ``query()`` (``torch.cuda.Event.query``) is
    true, polling with growing pauses (0.1 ms to 50 ms); raise if the deadline passes or a
    group fails first. Outside: return at once (the caller's stream waits on the device)."""
    bound = _bound.get()
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
