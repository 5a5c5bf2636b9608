"""``CollectiveCounts``: the collectives a region dispatched, counted exactly as torch's
``CommDebugMode`` counts them, without its module tracking.

[Note: counting collectives cheaply]
``CommDebugMode`` attributes every op to the module running it: a forward pre-hook per module
(a multi-grad hook registration each), a pytree walk and a fake-mode lookup per dispatched op.
The tests that train under it only read ``get_comm_counts()``, and on the tiny test models that
bookkeeping was most of a training step's CPU time (about 70% in the collective_impl parity
runs). ``CollectiveCounts`` is the same dispatch-level observer with only the counting: the same
set of collective ops (read from a ``CommDebugMode`` instance, so a torch upgrade that adds one
adds it here), the same native-to-legacy functional-collective key mapping, and the same
``NotImplemented`` for DTensor arguments so DTensor's own collectives are seen after it
desugars. It stays a witness independent of the library (it counts what reached the
dispatcher, not what the library says it issued); ``test_comm_counts.py`` checks that both
modes count the same on training runs of every strategy, HSDP and substituted collectives.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.debug import _comm_mode as _torch_comm_mode
from torch.utils._python_dispatch import TorchDispatchMode

# What CommDebugMode counts, and under which key.
COUNTED_OPS = frozenset(CommDebugMode().comm_registry) | frozenset(
    _torch_comm_mode.c10d_collective_ops)
_KEY = dict(_torch_comm_mode.NATIVE_TO_PY_MAPPING)


class CollectiveCounts(TorchDispatchMode):
    """``with CollectiveCounts() as comm: ...``; then ``comm.get_comm_counts()`` (op packet ->
    count) and ``comm.get_total_counts()``, as ``CommDebugMode`` returns them."""

    def __init__(self) -> None:
        super().__init__()
        self.supports_higher_order_operators = True  # as CommDebugMode: HOPs are redispatched
        self.comm_counts: defaultdict[Any, int] = defaultdict(int)

    def __enter__(self) -> CollectiveCounts:
        self.comm_counts.clear()  # as CommDebugMode: counts are per ``with`` block
        super().__enter__()
        return self

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t == DTensor for t in types):
            return NotImplemented  # DTensor desugars first; its collectives come back here
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in COUNTED_OPS:
            self.comm_counts[_KEY.get(packet, packet)] += 1
        return out

    def get_comm_counts(self) -> dict[Any, int]:
        return self.comm_counts

    def get_total_counts(self) -> int:
        return sum(self.comm_counts.values())


# The dispatched c10d op names of each kind of collective, as ``get_comm_counts()`` keys end
# (the estimator tests compare their sums with the estimate's per-kind counts).
COLLECTIVE_KINDS = {
    "all_gather": ("_allgather_base", "all_gather_into_tensor", "allgather_into_tensor_coalesced"),
    "reduce_scatter": ("_reduce_scatter_base", "reduce_scatter_tensor",
                       "reduce_scatter_tensor_coalesced"),
    "all_reduce": ("allreduce", "all_reduce"),
}
