"""The only module that issues collectives. Every collective runs on a flat 1-D buffer through
``torch.distributed`` (NCCL on GPUs, gloo on CPU), optionally asynchronously; callers wait on the
returned work handle exactly where they need the data."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["all_gather_into", "reduce_scatter_into", "all_reduce_inplace", "Work"]

Work = dist.Work

# torch 2.14 renamed the flat-tensor collectives; keep working on older releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool = False
) -> Work | None:
    """Gather every rank's ``shard`` into ``output`` (rank-major). ``shard`` may be the rank's own
    slot of ``output`` (in-place gather, used by the replicated-buffer refresh)."""
    return _all_gather_single(output, shard, group=group, async_op=async_op)


def reduce_scatter_into(
    output: torch.Tensor, reduce_scatter_input: torch.Tensor, group: ProcessGroup,
    async_op: bool = False,
) -> Work | None:
    """Sum ``reduce_scatter_input`` over ranks and leave this rank's slot in ``output``, which may
    be that slot of the input itself (in-place reduce-scatter)."""
    return _reduce_scatter_single(
        output, reduce_scatter_input, op=dist.ReduceOp.SUM, group=group, async_op=async_op
    )


def all_reduce_inplace(
    buffer: torch.Tensor, group: ProcessGroup, async_op: bool = False
) -> Work | None:
    """Sum ``buffer`` over ranks in place."""
    return dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
