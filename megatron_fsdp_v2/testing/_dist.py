"""Run a function on N spawned ranks over gloo (or any backend string), with a hard timeout.

A one-task :class:`~megatron_fsdp_v2.testing._pool.RankPool` (see the Note there): a failing
rank's traceback is raised in the caller; ranks still blocked in a collective are killed after a
short grace period, so a deadlock or a crashed peer fails in seconds instead of hanging the test
session.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._pool import DistributedTestError, RankPool

__all__ = ["DistributedTestError", "run_distributed"]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    backend: str | None = "gloo",
    grace_s: float = 10.0,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` freshly spawned ranks.

    ``fn`` must be importable (a module-level function); its module is imported in each rank
    before the process group is initialized (so it can register a backend). ``backend`` is
    passed to ``init_process_group`` as given: a name (``"gloo"``, ``"nccl"``), a device map
    (``"cpu:gloo,cuda:nccl"``), or ``None`` for torch's choice by device. Returns the per-rank
    results in rank order. Raises :class:`DistributedTestError` with the failing ranks'
    tracebacks, or when the ranks are not done within ``timeout_s``.
    """
    pool = RankPool(world_size, backend=backend, pg_timeout_s=max(5.0, min(timeout_s, 60.0)),
                    preload=fn)
    try:
        return pool.run(fn, *args, timeout_s=timeout_s, grace_s=grace_s, **kwargs)
    finally:
        pool.close()  # after the results are in hand (a no-op when run() already killed them)
