"""Spawned ranks that stay up across test cases, so a sweep can be one test id per case.

``megatron_fsdp_v2.testing.run_distributed`` spawns fresh processes for every call, and each
spawn costs several seconds (every rank imports torch), so a sweep split into one test per case
would pay that per case. :class:`RankPools` keeps one pool of ranks (one world size at a time)
and runs each case on it, reporting failures the same way: a rank's traceback fails the case,
and a case that does not finish in time (a deadlock, a crashed peer) fails it too.

The ranks are never reused after a failure: the pool is closed, and the next case starts a fresh
one, so a failing case cannot leave a broken process group or stale state to later cases.
Passing cases share processes, as the single-item sweeps they replace did: a case must set its
own seeds and build its own model. Rerunning one case by its id runs it on fresh ranks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from megatron_fsdp_v2.testing import DistributedTestError

__all__ = ["RankPool", "RankPools"]


def _serve(rank: int, world_size: int, init_file: str, pg_timeout_s: float, tasks: Any,
           results: Any) -> None:
    """A rank: join the process group, then run tasks until told to stop (``None``)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
    except BaseException:  # noqa: BLE001 - report it as the first task's failure
        results.put((None, rank, "error", traceback.format_exc()))
        return
    while True:
        task_id = None
        try:
            task = tasks.get()  # unpickling imports the test module
            if task is None:
                break
            task_id, fn, args, kwargs = task
            results.put((task_id, rank, "ok", fn(rank, world_size, *args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
            results.put((task_id, rank, "error", traceback.format_exc()))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (seconds with torch loaded); nothing is pending


class RankPool:
    """``world_size`` spawned gloo ranks that run one task at a time."""

    def __init__(self, world_size: int, pg_timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        self.closed = False
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._tmp.name, "rendezvous")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(target=_serve, daemon=True,
                        args=(r, world_size, init_file, pg_timeout_s, self._tasks[r],
                              self._results))
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._last_task = 0

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0,
            grace_s: float = 10.0, **kwargs: Any) -> list[Any]:
        """``fn(rank, world_size, *args, **kwargs)`` on every rank; the results in rank order.

        Raises :class:`DistributedTestError` with the failing ranks' tracebacks, or when the
        ranks are not done within ``timeout_s`` (which includes starting the pool); the pool is
        closed then.
        """
        assert not self.closed, "the pool was closed"
        try:
            return self._run(fn, args, kwargs, timeout_s, grace_s)
        except BaseException:
            # Our own failure report, or an interruption from outside (pytest-timeout, Ctrl-C)
            # while the ranks may still be busy: never hand these ranks another case.
            self.close(graceful=False)
            raise

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             timeout_s: float, grace_s: float) -> list[Any]:
        self._last_task += 1
        task_id = self._last_task
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
        outcomes: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        first_error_at: float | None = None
        while len(outcomes) < self.world_size:
            now = time.monotonic()
            limit = deadline if first_error_at is None else min(deadline, first_error_at + grace_s)
            if now >= limit:
                break
            try:
                tid, rank, status, payload = self._results.get(timeout=min(0.5, limit - now))
            except queue.Empty:
                # A dead rank (a crash) leaves its peers blocked: give them the grace period.
                if first_error_at is None and any(not p.is_alive() for p in self._procs):
                    first_error_at = time.monotonic()
                continue
            if tid not in (task_id, None):
                continue
            outcomes[rank] = (status, payload)
            if status == "error" and first_error_at is None:
                first_error_at = time.monotonic()
        errors = [f"--- rank {r} ---\n{payload}"
                  for r, (s, payload) in sorted(outcomes.items()) if s == "error"]
        missing = [r for r in range(self.world_size) if r not in outcomes]
        if errors or missing:
            exitcodes = {r: self._procs[r].exitcode for r in missing}
            reason = list(errors)
            if missing:
                reason.append(f"ranks {missing} did not finish within {timeout_s:.0f}s (after an "
                              f"error: {grace_s:.0f}s grace); exit codes {exitcodes}")
            raise DistributedTestError("\n".join(reason))
        return [outcomes[r][1] for r in range(self.world_size)]

    def close(self, graceful: bool = True) -> None:
        """Stop the ranks: idle ones exit cleanly; busy ones (or all, ``graceful=False``) are
        killed."""
        if self.closed:
            return
        self.closed = True
        if graceful:
            for q in self._tasks:
                q.put(None)
        for p in self._procs:
            p.join(timeout=5 if graceful else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for q in [*self._tasks, self._results]:
            q.cancel_join_thread()
            q.close()
        self._tmp.cleanup()


class RankPools:
    """One live :class:`RankPool` at a time (each holds ``world_size`` processes with torch
    loaded); asking for another world size closes the current one. Order test cases by world
    size to start few pools."""

    def __init__(self) -> None:
        self._pool: RankPool | None = None

    def run(self, fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
            **kwargs: Any) -> list[Any]:
        pool = self._pool
        if pool is not None and (pool.closed or pool.world_size != world_size):
            pool.close()
            pool = None
        if pool is None:
            pool = self._pool = RankPool(world_size)
        return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
