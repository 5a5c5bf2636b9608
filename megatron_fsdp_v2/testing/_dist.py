"""Run a function on N spawned ranks over gloo (or any backend string), with a hard timeout.

A failing rank's traceback is raised in the caller; ranks still blocked in a collective are
killed after a short grace period, so a deadlock or a crashed peer fails in seconds instead of
hanging the test session.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["DistributedTestError", "run_distributed"]


class DistributedTestError(AssertionError):
    """A rank raised, or the ranks did not finish in time."""


def _worker(
    fn: Callable[..., Any], rank: int, world_size: int, init_file: str, backend: str | None,
    pg_timeout_s: float, results: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args, **kwargs)
        results.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    backend: str | None = "gloo",
    grace_s: float = 10.0,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned ranks.

    ``fn`` must be importable (a module-level function); its module is imported in each rank
    before the process group is initialized (so it can register a backend). ``backend`` is
    passed to ``init_process_group`` as given: a name (``"gloo"``, ``"nccl"``), a device map
    (``"cpu:gloo,cuda:nccl"``), or ``None`` for torch's choice by device. Returns the per-rank
    results in rank order. Raises :class:`DistributedTestError` with the failing ranks'
    tracebacks, or when the ranks are not done within ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        pg_timeout_s = max(5.0, min(timeout_s, 60.0))
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    fn, rank, world_size, init_file, backend, pg_timeout_s, results, args, kwargs
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        outcomes: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        first_error_at: float | None = None
        try:
            while len(outcomes) < world_size:
                now = time.monotonic()
                limit = (
                    deadline if first_error_at is None else min(deadline, first_error_at + grace_s)
                )
                if now >= limit:
                    break
                try:
                    rank, status, payload = results.get(timeout=min(0.5, limit - now))
                except queue.Empty:
                    if all(not p.is_alive() for p in procs) and results.empty():
                        break
                    continue
                outcomes[rank] = (status, payload)
                if status == "error" and first_error_at is None:
                    first_error_at = time.monotonic()
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
    errors = [
        f"--- rank {r} ---\n{payload}"
        for r, (s, payload) in sorted(outcomes.items())
        if s == "error"
    ]
    missing = [r for r in range(world_size) if r not in outcomes]
    if errors or missing:
        reason = []
        if errors:
            reason.append("\n".join(errors))
        if missing:
            exitcodes = {r: procs[r].exitcode for r in missing}
            reason.append(
                f"ranks {missing} did not finish within {timeout_s:.0f}s "
                f"(after an error: {grace_s:.0f}s grace); exit codes {exitcodes}"
            )
        raise DistributedTestError("\n".join(reason))
    return [outcomes[r][1] for r in range(world_size)]
