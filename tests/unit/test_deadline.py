"""The recovery deadline of CUDA event waits (see [Note: recovery deadline] in
``megatron_fsdp_v2/_comm/_deadline.py``), with fake events and a fake clock: events never raise,
so ``FSDPContext.recover`` polls them under a ``WaitBound`` and fails with a clear error when a
collective never completes or its group reports an error. The real groups' timeout and error
queries run on two gloo ranks."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_fsdp_v2._comm._collectives import CommStreams, _EventHandle
from megatron_fsdp_v2._comm._deadline import (
    CollectiveTimeoutError,
    WaitBound,
    collective_timeout_s,
    group_error,
    wait_for_event,
)
from megatron_fsdp_v2.testing import run_distributed


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.sleeps.append(seconds)
        self.now += seconds


class FakeEvent:
    """``query()`` is true from the ``done_after``-th call on (never, if None)."""

    def __init__(self, done_after: int | None) -> None:
        self.done_after = done_after
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done_after is not None and self.queries > self.done_after


def test_outside_recovery_nothing_is_polled() -> None:
    event = FakeEvent(None)
    wait_for_event(event.query, None)
    assert event.queries == 0


def test_an_event_that_completes_returns() -> None:
    clock, event = FakeClock(), FakeEvent(3)
    wait_for_event(event.query, WaitBound.starting_now(10.0, clock=clock), sleep=clock.sleep)
    assert event.queries == 4 and len(clock.sleeps) == 3


def test_an_event_that_never_completes_raises_at_the_deadline() -> None:
    clock, event = FakeClock(), FakeEvent(None)
    with pytest.raises(
            CollectiveTimeoutError, match=r"within 7.5 s \(the collective timeout\)"):
        wait_for_event(event.query, WaitBound.starting_now(7.5, clock=clock),
                       sleep=clock.sleep)
    assert clock.now == pytest.approx(107.5)  # no later than the deadline
    assert max(clock.sleeps) <= 0.05  # short pauses: a late completion is seen at once


def test_a_group_error_raises_before_the_deadline() -> None:
    clock, event = FakeClock(), FakeEvent(None)
    errors = iter([None, None, "process group 3 reports TIMEOUT"])
    with pytest.raises(
            CollectiveTimeoutError, match="process group 3 reports TIMEOUT"):
        wait_for_event(event.query, WaitBound.starting_now(60.0, lambda: next(errors), clock),
                       sleep=clock.sleep)
    assert event.queries == 3 and clock.now < 101.0


def test_event_handle_polls_under_recovery() -> None:
    """The library's CUDA handle: while its streams hold a wait bound (recovery), a collective
    that never completes raises instead of leaving the caller stream waiting forever; the bound
    is gone after the block (the error comes before any CUDA call, so this runs on CPU)."""
    streams = CommStreams(torch.device("cpu"))  # CPU: no side streams are created
    handle = _EventHandle(FakeEvent(None), streams)  # type: ignore[arg-type]
    with streams.bounded_waits(WaitBound.starting_now(0.01)), pytest.raises(
            CollectiveTimeoutError):
        handle.wait()
    assert streams.wait_bound is None


def _real_groups(rank: int, world: int) -> tuple[float, str | None, float]:
    group = dist.new_group([0, 1], timeout=timedelta(seconds=42))
    cpu = torch.device("cpu")
    return (collective_timeout_s(group, cpu), group_error([(group, cpu)]),
            collective_timeout_s(dist.group.WORLD, cpu))  # type: ignore[arg-type]


def test_real_group_timeout_and_health() -> None:
    for timeout, error, world_timeout in run_distributed(_real_groups, 2, timeout_s=120):
        assert timeout == 42.0
        assert error is None
        assert world_timeout > 0
