"""FSDP2's all-reduce hook (``FSDPModule.set_all_reduce_hook``) on a flat group's reduced
gradients.

[Note: the all-reduce hook]
FSDP2 calls ``hook(reduce_output)`` on each param group's reduced gradient shard: after the
reduce-scatter under plain FSDP (where the hook may implement a replica all-reduce itself, e.g.
over a custom group), after the HSDP all-reduce under HSDP; the hook edits it in place and the
result becomes the sharded gradients. Here a group's reduced shard is the optimizer-facing
part of ``main_grad`` (``GroupGrads.main_grad_local()``: flat, in the gradient dtype, padding
included), complete at the end of the accumulation window (``GroupGrads._finish_window``): after
every inner reduction (and the outer all-reduce or reduce-scatter under HSDP) was waited on,
before the gradients are installed for the optimizer. So the hook runs once per group and window
on the window's sum; FSDP2 runs it after every reduce-scatter, on each micro-batch's share, which
is the same for a hook that is linear in the gradient (an all-reduce, a scaling). It sees only
this window's values: a window that starts on gradients reduced earlier (not cleared between
steps, an unmarked loop) sets them aside as the HSDP window carry does and adds them back after
the hook ([Note: HSDP window carry] in ``_grads.py``). A window the hook never ends
(``no_sync()``, ``set_requires_all_reduce(False)`` on HSDP) runs no hook, as in FSDP2. With a
``stream`` (CUDA, not on an HSDP mesh, as FSDP2) the hook runs on it, ordered after the
reductions and before the install.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["AllReduceHook", "run_all_reduce_hook"]

AllReduceHook = Callable[[torch.Tensor], None]


def run_all_reduce_hook(hook: AllReduceHook, stream: torch.cuda.Stream | None,
                        reduced: torch.Tensor) -> None:
    """Call ``hook(reduced)``, on ``stream`` when given (which waits for the current stream
    first, and the current stream for it after)."""
    if stream is None:
        hook(reduced)
        return
    current = torch.cuda.current_stream(reduced.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        hook(reduced)
    reduced.record_stream(stream)
    current.wait_stream(stream)
