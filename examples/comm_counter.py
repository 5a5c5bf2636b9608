"""Count the bytes moved by torch.distributed collectives, whoever issues them.

``CommCounter`` is a ``TorchDispatchMode``: every collective, whether issued from Python
(``dist.all_reduce``, ``dist.all_gather_into_tensor``, functional collectives, DTensor
redistributions) or from C++ (DDP's reducer, which calls ``ProcessGroup::allreduce``), reaches
the dispatcher as a ``c10d::*`` or ``_c10d_functional::*`` op, so one mechanism sees them all.

Two numbers are kept per collective, with ``S`` the size of the *full* buffer involved (the
all-reduced tensor, the gathered output of an all-gather, the input of a reduce-scatter, the
broadcast tensor) and ``N`` the group size:

* ``payload_bytes``: ``S``;
* ``wire_bytes``: what one rank sends under the bandwidth-optimal ring algorithm (the nccl-tests
  "bus bytes" convention): ``2 (N-1)/N * S`` for an all-reduce, ``(N-1)/N * S`` for an
  all-gather, reduce-scatter, broadcast or all-to-all, ``S`` for a send. This is the number to
  compare across systems: a DDP all-reduce and a ZeRO reduce-scatter + all-gather of the same
  gradients both come out at ``2 (N-1)/N * S``.

The mode sees every aten op while active, which costs a little Python per op; benchmarks
should count on a step they do not time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["CommCounter", "CommStats"]

_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_dtensor"})

# op name (without namespace, trailing "_" stripped) -> kind
_KINDS = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base": "all_gather",
    "allgather": "all_gather",
    "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "broadcast": "broadcast",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all",
    "shard_dim_alltoall": "all_to_all",
    "reduce": "reduce",
    "gather": "gather",
    "gather_into_tensor": "gather",
    "scatter": "scatter",
    "send": "send",
    "isend": "send",
    "recv": "recv",
    "recv_any_source": "recv",
    "irecv": "recv",
}
# Ops that move no payload worth counting.
_IGNORED = frozenset(
    {"barrier", "monitored_barrier", "check_for_nan", "wait_tensor", "batch_p2p_ops"}
)


def _wire_factor(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind == "send":
        return 1.0
    if kind == "recv":
        return 0.0  # counted by the sender
    return (n - 1) / n


def _all_to_all_sent(args: tuple[Any, ...], n: int) -> float:
    """Bytes ``c10d.alltoall_base_(output, input, group, output_splits, input_splits, ...)``
    sends to other ranks: its input less this rank's own split."""
    send = args[1]
    splits = list(args[4]) if len(args) > 4 and args[4] else []
    if not splits:  # even splits
        return _bytes(send) * _wire_factor("all_to_all", n)
    group = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
    own = 0
    if group is not None:
        try:
            own = splits[dist.ProcessGroup.unbox(group).rank()]
        except Exception:  # noqa: BLE001 - not a process group
            own = 0
    row = send[0].numel() if send.dim() > 1 else 1
    return (sum(splits) - own) * row * send.element_size()


def _bytes(obj: Any) -> int:
    leaves, _ = tree_flatten(obj)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _group_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.ScriptObject):
            # c10d ops at the dispatcher take the group as a boxed ScriptObject (so does the
            # ReduceOp, which unbox rejects): without this, a sub-group (HSDP's inner and
            # outer axes) would be counted at the world size.
            try:
                return int(dist.ProcessGroup.unbox(a).size())
            except Exception:  # noqa: BLE001 - another boxed class (ReduceOp)
                continue
        size = getattr(a, "size", None)
        if callable(size) and not isinstance(a, torch.Tensor):
            try:
                return int(size())
            except Exception:  # noqa: BLE001 - not a process group after all
                pass
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, str):  # functional collectives name their group
            try:
                return dist.distributed_c10d._resolve_process_group(a).size()
            except Exception:  # noqa: BLE001
                pass
    return dist.get_world_size() if dist.is_initialized() else 1


@dataclass
class CommStats:
    calls: Counter = field(default_factory=Counter)
    payload_bytes: Counter = field(default_factory=Counter)
    wire_bytes: Counter = field(default_factory=Counter)

    @property
    def total_wire_bytes(self) -> int:
        return int(sum(self.wire_bytes.values()))

    @property
    def total_payload_bytes(self) -> int:
        return int(sum(self.payload_bytes.values()))

    @property
    def total_calls(self) -> int:
        return int(sum(self.calls.values()))

    def summary(self) -> str:
        short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "broadcast": "BC"}
        return " ".join(f"{short.get(k, k)}={v}" for k, v in sorted(self.calls.items())) or "none"

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": dict(self.calls),
            "payload_bytes": {k: int(v) for k, v in self.payload_bytes.items()},
            "wire_bytes": {k: int(v) for k, v in self.wire_bytes.items()},
            "total_wire_bytes": self.total_wire_bytes,
            "total_payload_bytes": self.total_payload_bytes,
        }


class CommCounter(TorchDispatchMode):
    """``with CommCounter() as c: ...`` then read ``c.stats`` (reset with ``c.reset()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.stats = CommStats()

    def reset(self) -> CommStats:
        """Return the stats so far and start a fresh tally."""
        stats, self.stats = self.stats, CommStats()
        return stats

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None):
        kwargs = kwargs or {}
        # Let DTensor desugar first (as CommDebugMode does); its collectives come back through
        # here. Other subclasses (e.g. the FakeTensors of DTensor's sharding propagation) run
        # below, with this mode off.
        if DTensor in types:
            return NotImplemented
        out = func(*args, **kwargs)
        namespace = getattr(func, "namespace", None)
        if namespace in _NAMESPACES:
            name = func._overloadpacket.__name__.rstrip("_")
            name = name if name in _KINDS else func._overloadpacket.__name__
            if name.rstrip("_") in _IGNORED:
                return out
            kind = _KINDS.get(name)
            if kind is None:  # autograd wrappers and other non-collective helpers
                return out
            n = _group_size(args, kwargs)
            # The full buffer is the largest tensor argument (or result): the gathered output,
            # the reduce-scatter input, the all-reduced tensor. A functional all-gather returns
            # its output; a functional reduce-scatter takes its full input.
            size = max([_bytes(a) for a in args] + [_bytes(v) for v in kwargs.values()]
                       + [_bytes(out)])
            if (kind == "all_gather" and namespace == "_c10d_functional"
                    and name == "all_gather_into_tensor"):
                size = max(size, _bytes(args[0]) * n)
            self.stats.calls[kind] += 1
            self.stats.payload_bytes[kind] += size
            if kind == "all_to_all" and name == "alltoall_base":
                # What this rank sends: its input, less the split it keeps (uneven splits).
                self.stats.wire_bytes[kind] += _all_to_all_sent(args, n)
                return out
            self.stats.wire_bytes[kind] += size * _wire_factor(kind, n)
        return out
