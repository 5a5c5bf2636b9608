"""Spawned gloo ranks that run test functions under a hard timeout: the one way tests spawn ranks.

[Note: rank pools]
A :class:`RankPool` starts ``world_size`` processes, joins them in one process group, and then
runs tasks on them one at a time: ``fn(rank, world_size, *args, **kwargs)`` on every rank, the
per-rank results returned in rank order. Starting ranks costs time (a process group; and the
imports, paid once per session by the fork server, see the Note below), so a sweep split into
one test id per case runs all its cases on the same ranks (:class:`RankPools`, the ``ranks``
fixture of ``tests/distributed``); a one-off call
(:func:`~megatron_fsdp_v2.testing.run_distributed`) is a pool that runs one task and closes.

Failures are reported the same way everywhere: a rank's traceback fails the task, and ranks not
done within ``timeout_s`` (a deadlock, a crashed peer) fail it too; after the first error the
others get ``grace_s`` to report. A failed pool is closed (its processes killed) and never
given another task, so a failing case cannot leave a broken process group or stale state to
later cases. A task from another module than the task before it starts from the library state of
a fresh process (``_registry.reset()`` first: no units, cached process groups or patches of torch
left by another test file; and every process group but the pool's own destroyed), so files that
share ranks cannot see each other's wraps. The cases of one file share the library's cached
process groups (creating a gloo group costs 30-55 ms) until the ranks hold more than
``MAX_IDLE_PROCESS_GROUPS`` of them: then the next task, or a sweep's next case
(:func:`release_process_groups`), starts from a fresh state too. Destroying groups matters: c10d
keeps a group until it is destroyed, each gloo group holds three threads whose transport loop
polls, and a session's worth of groups from device meshes and library units (once measured: 364
groups, 1,100 threads per rank) made every later case several times slower. A destroyed group
only goes away with the last object that holds it, and a live ``DeviceMesh`` does: DTensor caches
meshes process-wide (its sharding-propagation caches, the redistribute planner cache, which is
keyed by a weak reference to the mesh but holds the mesh in the planner, and the mesh topology
cache), so those caches are emptied and reference cycles collected with the groups; before they
were, destroyed groups kept their threads: a rank of the 4-rank pool ran 380 threads late in
the suite. Results are collected before any rank is told to exit:
gloo sometimes aborts in process teardown, and a result already in hand must not be lost to that.

[Note: ranks fork from a preloaded server]
A rank is not a fresh interpreter: it is forked from multiprocessing's fork server, which imports
torch, torch._dynamo (DTensor.from_local imports it on first use, seconds with triton) and this
library once per test session (or check program). A spawned rank spent about 6 s of CPU on those
imports before its first task; every one-off ``run_distributed`` and every pool replaced after a
failing case paid that again, a quarter of the full suite's time on two cores. The fork server
runs nothing but imports (no process group, no OpenMP region, no library state), so a forked rank
starts as a spawned one did; multiprocessing still runs the spawn preparation in it (the parent's
``sys.path``, working directory and ``__main__``), and ``_serve`` applies the environment the
parent has when the pool starts (the server's is the one of its own start). A test suite adds
its own heavy imports with :func:`preload_in_server` (``tests/conftest.py``: the Hugging Face
model classes, torchao), and a rank freezes what it inherits out of the garbage collector's
sight (``gc.freeze()``), so a full collection walks only what the tasks allocate.

The server must never ask the CUDA driver anything: ``torch.cuda.is_available()`` (and
``device_count()`` when NVML cannot answer) calls ``cudaGetDeviceCount``, which registers torch's
fork handler, and every process forked after that is a "bad fork" whose first CUDA call raises
"Cannot re-initialize CUDA in forked subprocess": a server that did it starts ranks that cannot
use the GPU. torch, torch._dynamo and this library ask nothing at import; torchao's float8 and
transformers call ``torch.cuda.is_available()`` at import. So the suite's modules are preloaded
only where this process sees no CUDA device (the CPU suite, where they save seconds per rank);
where CUDA is usable the ranks import them themselves. (``PYTORCH_NVML_BASED_CUDA_CHECK=1`` is
no fix: torch falls back to ``cudaGetDeviceCount`` whenever NVML fails, and a module may ask
more than ``is_available()``.) ``tests/test_fork_server_cuda.py`` checks a rank of a server
started as on a GPU machine is not a bad fork.
"""

from __future__ import annotations

import gc
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

__all__ = [
    "MAX_IDLE_PROCESS_GROUPS", "DistributedTestError", "RankPool", "RankPools", "preload_in_server",
    "release_process_groups",
]


class DistributedTestError(AssertionError):
    """A rank raised, or the ranks did not finish in time."""


# Imported once by the fork server, not by every rank (see [Note: ranks fork from a preloaded
# server]); a module missing here is only slower to start (multiprocessing skips ImportError).
# None of them asks the CUDA driver anything at import.
_SERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "megatron_fsdp_v2"]
# Added by preload_in_server: other projects' modules, which may ask torch about CUDA at import.
_SUITE_PRELOAD: list[str] = []


def preload_in_server(*modules: str) -> None:
    """Have the fork server import ``modules`` too, so that ranks start with them imported.

    For heavy modules many ranks import (a test suite's ``conftest.py``: Hugging Face models
    take seconds per process). Takes effect when the server starts, i.e. called before the first
    pool of the process; a module that cannot be imported is skipped (the ranks import it
    themselves, or fail as they would have). Where this process sees a CUDA device they are not
    preloaded: a module that asks torch about CUDA at import (torchao's float8 does) would leave
    every rank unable to use CUDA (see [Note: ranks fork from a preloaded server]).
    """
    _SUITE_PRELOAD.extend(m for m in modules if m not in _SUITE_PRELOAD + _SERVER_PRELOAD)


def _cuda_usable() -> bool:
    """Whether ranks may use CUDA. Asked here, in the pool's owner: the fork server is a new
    interpreter (multiprocessing execs it), so this process's CUDA state is not inherited."""
    import torch

    return torch.cuda.is_available()


def _server_preload(cuda_usable: bool) -> list[str]:
    """What the fork server imports: the suite's modules only where no rank can use CUDA."""
    return _SERVER_PRELOAD + ([] if cuda_usable else _SUITE_PRELOAD)


def _context() -> Any:
    """The multiprocessing context ranks start from: forked from the preloaded server."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_server_preload(_cuda_usable()))
    return ctx


def _serve(rank: int, world_size: int, init_file: str, backend: str | None, pg_timeout_s: float,
           preload: Callable[..., Any] | None, environ: dict[str, str], tasks: Any,
           results: Any) -> None:
    """A rank: join the process group, then run tasks until told to stop (``None``).

    ``preload`` is only received, never called: unpickling it imports its module before the
    process group exists, so that module can register a backend the group then uses.
    ``environ`` is the parent's environment when the pool started (a spawned process's own).
    """
    del preload
    os.environ.clear()
    os.environ.update(environ)
    # The objects inherited from the server (torch's and the library's modules, about a million)
    # never become garbage: out of the collector's sight, a full collection in a task no longer
    # walks them (a few percent of a rank's CPU), and their pages stay shared with the server.
    gc.freeze()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
    except BaseException:  # noqa: BLE001 - report it as the first task's failure
        results.put((None, rank, "error", traceback.format_exc()))
        return
    last_module: str | None = None
    while True:
        task_id = None
        try:
            task = tasks.get()  # unpickling imports the test module
            if task is None:
                break
            task_id, fn, args, kwargs = task
            if fn.__module__ != last_module:
                _fresh_library_state()
                last_module = fn.__module__
            else:
                release_process_groups()
            results.put((task_id, rank, "ok", fn(rank, world_size, *args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
            results.put((task_id, rank, "error", traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - every result is already collected (see the Note)
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (seconds with torch loaded); nothing is pending


# More process groups than this alive on a rank and the next task (or a sweep's next case, see
# :func:`release_process_groups`) starts from a fresh library state. Measured on 4 gloo ranks
# (2 cores): 100 idle groups cost each rank 17% of a core and made an all-reduce 3.4x slower;
# 10 cost nothing measurable. Creating a gloo group again costs 30-55 ms, so not after every case.
# On the eight files that create the most meshes (345 cases): 12 took 344-359 s, 6 and 24 395 s.
MAX_IDLE_PROCESS_GROUPS = 12


def release_process_groups(more_than: int = MAX_IDLE_PROCESS_GROUPS) -> bool:
    """Start from a fresh library state when any rank holds more than ``more_than`` process
    groups besides the default one; whether it did.

    For long sweeps that run many cases in one task on the pool's ranks (each case with its own
    meshes): call it between cases on every rank. The ranks agree with one all-reduce of their
    group counts (a group is only created on its members, so counts may differ), then every rank
    forgets the library's units and cached groups and destroys every group but the default one
    (see [Note: rank pools]): a unit wrapped before the call does not work after it.
    """
    import torch  # noqa: PLC0415 - imported by _serve already
    import torch.distributed as dist  # noqa: PLC0415

    if "gloo" not in str(dist.get_backend()):
        return False  # the count travels as a CPU tensor; the pools of the tests are gloo
    held = torch.tensor([len(dist.distributed_c10d._world.pg_map) - 1])
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    if int(held) <= more_than:
        return False
    _fresh_library_state()
    return True


def _fresh_library_state() -> None:
    """Forget what another test file's tasks left in the library and in torch.distributed (see
    [Note: rank pools])."""
    import torch.distributed as dist  # noqa: PLC0415 - imported by _serve already

    from .. import _registry  # noqa: PLC0415 - the package is imported by the task's module

    _registry.reset()
    # Every process group but the pool's own: the library's (reset above only drops its
    # references) and those the tests' device meshes and new_group calls made. c10d keeps each
    # one alive until destroyed, and a gloo group holds three threads, some of them polling: left
    # alone they pile up over a session (hundreds per rank) and slow every later case several
    # times over. Every rank reaches this point at the same task, and destroying a gloo group
    # is local. DTensor's sharding caches can hold meshes over those groups: emptied too.
    world = dist.group.WORLD
    for process_group in list(dist.distributed_c10d._world.pg_map):
        if process_group is not world:
            dist.destroy_process_group(process_group)
    _clear_dtensor_caches()
    # A destroyed group lives on (with its threads) while anything still holds it: the meshes of
    # earlier cases, freed here when they are only in reference cycles.
    gc.collect()


def _clear_dtensor_caches() -> None:
    """Empty DTensor's process-wide caches that hold device meshes (and through them, their
    process groups' backends: a live mesh keeps a destroyed gloo group's threads running)."""
    from torch.distributed.tensor import _collective_utils, _redistribute, _sharding_prop  # noqa: PLC0415
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache  # noqa: PLC0415

    _clear_sharding_prop_cache()
    # Keyed by a weak reference to the mesh, but the cached planner holds the mesh itself.
    _redistribute.clear_redistribute_planner_cache()
    for cached in (_redistribute._gen_transform_infos,
                   _collective_utils.MeshTopoInfo.build_from_mesh,
                   _sharding_prop.ShardingPropagator._propagate_tensor_meta_cached):
        cached.cache_clear()


class RankPool:
    """``world_size`` spawned ranks in one process group that run one task at a time.

    ``backend`` is passed to ``init_process_group`` as given: a name (``"gloo"``, ``"nccl"``), a
    device map (``"cpu:gloo,cuda:nccl"``), or ``None`` for torch's choice by device.
    ``preload``'s module is imported in every rank before the group is initialized.
    """

    def __init__(self, world_size: int, *, backend: str | None = "gloo",
                 pg_timeout_s: float = 60.0, preload: Callable[..., Any] | None = None) -> None:
        self.world_size = world_size
        self.closed = False
        ctx = _context()
        self._tmp = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._tmp.name, "rendezvous")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(target=_serve, daemon=True,
                        args=(r, world_size, init_file, backend, pg_timeout_s, preload,
                              dict(os.environ), self._tasks[r], self._results))
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._last_task = 0

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0,
            grace_s: float = 10.0, **kwargs: Any) -> list[Any]:
        """``fn(rank, world_size, *args, **kwargs)`` on every rank; the results in rank order.

        ``fn`` must be importable (a module-level function). Raises
        :class:`DistributedTestError` with the failing ranks' tracebacks, or when the ranks are
        not done within ``timeout_s`` (which includes starting the pool); the pool is closed
        then.
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
    """Live gloo :class:`RankPool` s, one per world size, shared by every case that asks.

    A pool is started on first use and kept until :meth:`close`, so cases of several world
    sizes (and several test modules) interleave without respawning. A failed pool is replaced
    by a fresh one on the next request. Passing cases share processes: a case must set its own
    seeds and build its own model.
    """

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def run(self, fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
            **kwargs: Any) -> list[Any]:
        """``fn(rank, world_size, *args, **kwargs)`` on the pool of ``world_size`` ranks."""
        pool = self._pools.get(world_size)
        if pool is None or pool.closed:
            pool = self._pools[world_size] = RankPool(world_size)
        return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)

    def close(self) -> None:
        """Stop every pool."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
