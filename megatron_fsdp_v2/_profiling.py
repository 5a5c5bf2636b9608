"""Named ranges for ``torch.profiler`` traces: every phase of the training step that this
package runs (gather, refresh, gradient staging, reduction launch, waits, gradient install, the
final callback) shows as a ``mfsdp::<phase>`` range, next to the ATen ops and collectives it
issues.

[Note: profiler ranges]
A range costs nothing measurable when no profiler runs: :func:`traced` checks
``torch.autograd.profiler._is_profiler_enabled`` (a module attribute that ``torch.profiler``
sets on start and clears on stop) before entering a ``record_function``, which on its own
costs microseconds per call even with no profiler (a dispatcher round trip), and a step runs a
few calls per group (about 1000 calls per step for 65 units: ~0.1 ms). Ranges nest
(``mfsdp::wait`` runs inside ``mfsdp::final_callback``, for example), so whoever adds them up
takes the union of their intervals, as ``benchmarks/bench_training.py --profile`` does.
Phase names are listed in :data:`PHASES`; the test of ranges
(``tests/distributed/test_profile_ranges.py``) checks each strategy shows the ones it runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch.autograd.profiler as _autograd_profiler
from torch.autograd.profiler import record_function

__all__ = ["PHASES", "traced"]

# What each range covers; "launch" means the CPU time to issue a collective (on gloo the
# collective itself runs on gloo's threads; a synchronous one is inside ``sync_collective``).
PHASES: dict[str, str] = {
    "mfsdp::unshard": "a unit makes its compute weights ready (gather or refresh launch)",
    "mfsdp::gather": "ZeRO-3 all-gather of the weight shards into the unsharded scratch buffer "
                     "(launch)",
    "mfsdp::refresh": "cast of the main-weight shard and the refresh all-gather (launch)",
    "mfsdp::free": "freeing a unit's gathered weights (waits for an in-flight gather first)",
    "mfsdp::post_backward": "a unit's post-backward: reshard, stage and reduce its gradients",
    "mfsdp::stage": "copy (scaled) param.grad into a flat gradient buffer",
    "mfsdp::reduce": "gradient reduction of one group (copy-in to the comm dtype, launch)",
    "mfsdp::wait": "blocked on an issued collective (exposed communication)",
    "mfsdp::sync_collective": "a collective run synchronously (exposed communication)",
    "mfsdp::finish_reduce": "waiting for a group's reductions and copying out the result",
    "mfsdp::install": "exposing reduced gradients to the optimizer as DTensor .grad",
    "mfsdp::final_callback": "end of backward: remaining reductions, waits, installs",
    "mfsdp::optimizer_pre_step": "optimizer step pre-hook (finalizes unsynchronized windows)",
}

P = ParamSpec("P")
R = TypeVar("R")


def traced(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: run the function inside ``record_function(name)`` while a profiler runs."""
    assert name in PHASES, name

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if not _autograd_profiler._is_profiler_enabled:
                return fn(*args, **kwargs)
            with record_function(name):
                return fn(*args, **kwargs)

        return wrapper

    return decorate
