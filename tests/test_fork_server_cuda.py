"""Ranks of the test pools can use CUDA: the fork server they are forked from never asked the
CUDA driver anything (see [Note: ranks fork from a preloaded server] in
``megatron_fsdp_v2/testing/_pool.py``).

Checked on CPU: what makes a rank unusable for CUDA is torch's fork handler, registered in the
server by its first ``cudaGetDeviceCount`` (``torch.cuda.is_available()``), GPU or not; a forked
process then reports ``torch._C._cuda_isInBadFork()``. A server that preloaded torchao's float8
(which calls ``torch.cuda.is_available()`` at import) started ranks that failed their first CUDA
call with "Cannot re-initialize CUDA in forked subprocess".
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest
import torch

from megatron_fsdp_v2.testing import _pool

TESTS = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.skipif(
    not hasattr(torch._C, "_cuda_isInBadFork"),
    reason="a torch without CUDA registers no CUDA fork handler: nothing to poison")


def rank_cuda_state(rank: int, world_size: int, modules: list[str]) -> dict[str, Any]:
    """In a rank: whether it may still initialize CUDA, and which of ``modules`` it inherited
    from the server (imported before the task arrived)."""
    del rank, world_size
    return {"bad_fork": torch._C._cuda_isInBadFork(),
            "cuda_initialized": torch.cuda.is_initialized(),
            "preloaded": sorted(m for m in modules if m in sys.modules)}


# A program: a pool started as on a machine whose GPU the ranks use (the owner sees CUDA), with
# the modules tests/conftest.py registers; then a control that the probe can see a poisoned fork.
_PROGRAM = """
import json, os, sys
sys.path.insert(0, {tests!r})
import torch
import test_fork_server_cuda as t
from megatron_fsdp_v2.testing import RankPool, _pool, preload_in_server

preload_in_server(*{suite!r})
_pool._cuda_usable = lambda: True  # as where torch sees a GPU: the ranks will use it
pool = RankPool(1)
try:
    state = pool.run(t.rank_cuda_state, {suite!r}, timeout_s=120)[0]
finally:
    pool.close()
torch.cuda.is_available()  # the control: this process asks the driver, then forks
pid = os.fork()
if pid == 0:
    os._exit(3 if torch._C._cuda_isInBadFork() else 4)
state["control_child_bad_fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 3
print("STATE " + json.dumps(state))
"""


def test_suite_preload_registered_by_conftest() -> None:
    """tests/conftest.py's modules are the suite's, preloaded only where no rank uses CUDA."""
    suite = list(_pool._SUITE_PRELOAD)
    assert "torchao.float8" in suite, suite
    assert not set(suite) & set(_pool._SERVER_PRELOAD)
    assert _pool._server_preload(cuda_usable=False) == _pool._SERVER_PRELOAD + suite
    assert _pool._server_preload(cuda_usable=True) == _pool._SERVER_PRELOAD


def test_ranks_are_not_bad_forks_where_cuda_is_usable(fresh_python) -> None:
    suite = list(_pool._SUITE_PRELOAD)
    proc = fresh_python.run(_PROGRAM.format(tests=TESTS, suite=suite), timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("STATE ")]
    assert len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = json.loads(lines[0][len("STATE "):])
    # The probe is not blind: a process forked after a CUDA query is a bad fork, GPU or not.
    assert state["control_child_bad_fork"], state
    assert not state["bad_fork"], (
        f"a rank is a bad fork (its first CUDA call would raise 'Cannot re-initialize CUDA in "
        f"forked subprocess'): the fork server asked the CUDA driver something; it preloaded "
        f"{state['preloaded']}")
    assert not state["cuda_initialized"], state
    assert state["preloaded"] == [], state
