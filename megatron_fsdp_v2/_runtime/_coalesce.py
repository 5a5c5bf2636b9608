"""Coalescing of the accumulate path's delayed reductions (``fully_shard(...,
reduce_bucket_size_mb=...)``): the once-per-window all-reduce (``no_shard``) or reduce-scatter
(``optim``) of consecutive groups, in backward order, issued as one collective per bucket.

[Note: reduction buckets]
Without coalescing every group issues its own delayed collective over its ``main_grad`` on the
last micro-batch (the per-group count contract). A model of many small units then pays one
collective launch per group, which on gloo costs far more than the bytes. With a bucket size,
the tree's :class:`ReductionCoalescer` (one per root, ``FSDPContext.coalescer``) collects the
groups whose post-backward reaches the delayed collective, in the order their post-backward
runs: the same on every rank, since backward runs the same units in the same order (the
collective-order contract every reduction already relies on). The open bucket is issued when
adding the next group would exceed the size, when the next group reduces over another process
group, dtype or collective, and at the end of backward (the final callback) for the rest:

* one group in a bucket (or a group at least the bucket size): today's in-place collective over
  its ``main_grad`` (``_reduce.reduce_accumulated``), nothing copied;
* several groups: their ``main_grad`` s are copied (cast to the communication dtype, with the
  kernels the uncoalesced path uses) into a staging scratch buffer (``reduce_staging``) of at
  most the bucket size, one collective runs over it asynchronously (overlapping the rest of
  backward, like the per-group collectives), and its result is copied back when a group's reduction
  is waited on. All-reduce: the groups one after another. Reduce-scatter: rank-major, so that each
  rank's slot of the bucket is the concatenation of its slots of every group's ``main_grad`` (one
  ``reduce_scatter_tensor``; the copy-out writes only this rank's slots).

At most ``MAX_BUCKETS_IN_FLIGHT`` = 2 issued buckets are alive, each in its own staging buffer:
bucket i+1 is staged and issued while bucket i's collective still runs, as DDP keeps its
buckets in flight; issuing a third first finishes the oldest. Two, because the collectives of
one process group run one after another (on gloo's worker thread for the group, on the
reduction side stream on CUDA): with two issued, the next one is queued the moment the current
one ends, so a third would only wait in the queue, holding another bucket of memory. The extra
memory is at most two buckets (twice the size; shown in ``memory_report``'s temporary peak), on
top of what the uncoalesced path uses.

Results: a reduce-scatter's sum for an element does not depend on where its slot lies in the
buffer, so ``optim`` is bitwise identical to the uncoalesced path on any number of ranks. An
all-reduce's is, on two ranks (a sum of two is exact in any order); with three or more ranks
gloo's ring sums each chunk of the buffer starting from a different rank, so moving a gradient
to another offset can change the last bit of its sum, exactly as DDP's bucketing does.

Opt-in, because it changes the documented count (one collective per group per window) that the
tests and the estimator assert, and costs the staging copies and the buckets' memory, which do
not pay off for large units. HSDP (a 2-D mesh) is refused; ``optim_grads`` and
``optim_grads_params`` reduce every micro-batch through their own per-group scratch buffers and are
unaffected.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .. import ops
from .._buffers._plan import Collective
from . import _reduce
from ._issuer import BucketIssuers, CollectiveLaunch, Deferred, Pending

if TYPE_CHECKING:
    from .._buffers._allocator import ScratchAllocator
    from ._flat_param_group import FlatParamGroup

__all__ = ["MAX_BUCKETS_IN_FLIGHT", "ReductionCoalescer", "validate_bucket_size"]

MAX_BUCKETS_IN_FLIGHT = 2  # see [Note: reduction buckets] for why two


def _staging_key(slot: int) -> tuple[str, str, int]:
    """The allocator key of the staging scratch buffer in ``slot`` (one per bucket in flight)."""
    return ("tree", "reduce_staging", slot)


def validate_bucket_size(value: object, name: str = "reduce_bucket_size_mb") -> float | None:
    """A bucket size argument ``name``: ``None`` or a positive, finite number of MiB."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be None or a number of MiB (e.g. 25), got "
            f"{type(value).__name__} {value!r}"
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{name} must be a positive, finite number of MiB (e.g. 25), got "
            f"{value!r}; pass None for one collective per flat group"
        )
    return float(value)


class _Bucket:
    """Groups whose delayed reductions run as one collective."""

    __slots__ = ("key", "scale", "members", "nbytes", "pending", "issued", "done", "dropped",
                 "slot")

    def __init__(self, key: tuple[object, ...], scale: float) -> None:
        self.key = key
        self.scale = scale  # what the staging copy multiplies every member's main_grad by
        self.members: list[tuple[FlatParamGroup, torch.Tensor]] = []  # (group, main_grad)
        self.nbytes = 0
        self.pending: Pending | None = None
        self.issued = False
        self.done = False
        self.dropped = False  # abandoned before it was issued (recovery): nothing to do
        self.slot = 0  # which staging buffer it uses while in flight


class ReductionCoalescer:
    """The tree's reduction buckets (see [Note: reduction buckets])."""

    def __init__(self, bucket_size_mb: float, allocator: ScratchAllocator) -> None:
        self.bucket_bytes = max(1, int(bucket_size_mb * (1 << 20)))
        self.allocator = allocator
        # The buckets' own issuer accounts (see [Note: who issues collectives]).
        self.issuers = BucketIssuers("reduction buckets")
        self._open: _Bucket | None = None
        self._inflight: list[_Bucket] = []  # issued buckets not finished yet, oldest first
        # What coalescing did, cumulative (tests and users read it): collectives issued for a
        # bucket of several groups, the groups they covered, and groups reduced on their own.
        self.coalesced_collectives = 0
        self.coalesced_groups = 0
        self.single_collectives = 0

    def add(self, group: FlatParamGroup, main_grad: torch.Tensor, pre_scale: float = 1.0
            ) -> Deferred:
        """Queue ``group``'s delayed reduction of ``main_grad``, multiplied by ``pre_scale``
        first (gradients written in place hold unscaled sums; see [Note: gradients in place]
        in ``_grad_staging.py``). The bucket is issued by :meth:`flush` (when it is full, before
        an incompatible group, at the end of backward or of the window); the returned
        handle's ``finish()`` waits for it and copies the result into ``main_grad``."""
        (step,) = group.plan.reduce_steps
        comm_dtype = group.dtypes.comm
        # One scale per bucket: the staging copy applies it (in practice every group shares it).
        key = (step.op, comm_dtype, main_grad.device, id(group.process_group), pre_scale)
        nbytes = main_grad.numel() * comm_dtype.itemsize
        bucket = self._open
        if bucket is not None and (
            bucket.key != key or bucket.nbytes + nbytes > self.bucket_bytes
        ):
            self.flush()
            bucket = None
        if bucket is None:
            bucket = self._open = _Bucket(key, pre_scale)
        bucket.members.append((group, main_grad))
        bucket.nbytes += nbytes
        if bucket.nbytes >= self.bucket_bytes:
            self.flush()
        return Deferred("a reduction bucket's collective, then its copy-out",
                        lambda: self.complete(bucket))

    def flush(self) -> None:
        """Issue the open bucket, if any (end of backward, or before an incompatible group)."""
        bucket, self._open = self._open, None
        if bucket is None or not bucket.members:
            return
        # At most MAX_BUCKETS_IN_FLIGHT issued buckets: the oldest finishes (and frees its
        # staging buffer) before another is staged.
        while len(self._inflight) >= MAX_BUCKETS_IN_FLIGHT:
            self.complete(self._inflight[0])
        used = {b.slot for b in self._inflight}
        bucket.slot = min(slot for slot in range(MAX_BUCKETS_IN_FLIGHT) if slot not in used)
        if len(bucket.members) == 1:
            group, main_grad = bucket.members[0]
            bucket.pending = _reduce.reduce_accumulated(
                group.plan, main_grad, group.dtypes.comm, group.issuer, group.allocator,
                group.temporary_key("grad_comm"), async_op=True, pre_scale=bucket.scale,
            )
            self.single_collectives += 1
        else:
            bucket.pending = self._issue_staged(bucket)
            self.coalesced_collectives += 1
            self.coalesced_groups += len(bucket.members)
        bucket.issued = True
        self._inflight.append(bucket)

    def _issue_staged(self, bucket: _Bucket) -> Pending:
        first = bucket.members[0][0]
        op, comm_dtype, device = bucket.key[0], bucket.key[1], bucket.key[2]
        assert isinstance(comm_dtype, torch.dtype) and isinstance(device, torch.device)
        world = first.world_size
        numels = [main_grad.numel() for _, main_grad in bucket.members]
        total = sum(numels)
        key = _staging_key(bucket.slot)
        staging = self.allocator.allocate(key, total, comm_dtype, device)
        inputs: list[torch.Tensor] = []
        offsets: list[int] = []
        outputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (reduced part, destination)
        own: torch.Tensor | None = None  # this rank's slot (a reduce-scatter's output)
        if op is Collective.ALL_REDUCE:
            offset = 0
            for (_, main_grad), numel in zip(bucket.members, numels):
                inputs.append(main_grad)
                offsets.append(offset)
                outputs.append((staging[offset : offset + numel], main_grad))
                offset += numel
        else:
            assert op is Collective.REDUCE_SCATTER, op
            # Rank-major: rank r's slot of the bucket holds slot r of every group in order.
            slot_numel = total // world
            rank = first.rank
            column = 0
            for group, main_grad in bucket.members:
                lo, hi = group.plan.shard_span
                width = hi - lo
                for r in range(world):
                    inputs.append(main_grad[r * width : (r + 1) * width])
                    offsets.append(r * slot_numel + column)
                start = rank * slot_numel + column
                outputs.append((staging[start : start + width], main_grad[lo:hi]))
                column += width
            own = staging[rank * slot_numel : (rank + 1) * slot_numel]
        # The cast-and-copy kernel the uncoalesced path uses for its workspace (same rounding).
        ops.pack_(inputs, offsets, staging, scale=bucket.scale)
        allocator = self.allocator

        if all(target.dtype == comm_dtype for _, target in outputs):
            # A copy without a cast: one foreach call (the same bits as the kernel, whose
            # unit scale is exact), not a kernel launch and its checks per group.
            reduced_parts = [reduced for reduced, _ in outputs]
            targets = [target for _, target in outputs]

            def copy_out() -> None:
                torch._foreach_copy_(targets, reduced_parts)
        else:
            def copy_out() -> None:
                for reduced, target in outputs:
                    ops.reduce_scatter_copy_out_(reduced, target)

        def finish() -> None:
            copy_out()
            allocator.free(key)

        # Through the bucket account of the members' process group (its debug order check and
        # accounting), with the first member's collective_impl; ``what`` names the bucket.
        issuer = self.issuers.issuer(first.process_group, device, first.collectives.impl)
        what = (f"coalesced {op.value} of {len(bucket.members)} groups ({first.name} to "
                f"{bucket.members[-1][0].name}, {total} elements)")
        return issuer.launch(
            CollectiveLaunch(op, staging, own, what=what, complete=finish), async_op=True
        )

    def complete(self, bucket: _Bucket) -> None:
        """Make ``bucket``'s result visible in its groups' ``main_grad`` (exactly once). Only
        waits: an open bucket is issued by :meth:`flush` at a point of the schedule, never by a
        wait (a wait that issued would issue where the ranks' schedules need not agree)."""
        if bucket.done or bucket.dropped:
            return
        if not bucket.issued:
            raise RuntimeError(
                "fully_shard internal error: a reduction bucket was waited on before it was "
                "issued; the end of backward or of the window flushes the open bucket first "
                "(ReductionCoalescer.flush)"
            )
        if bucket in self._inflight:
            self._inflight.remove(bucket)
        bucket.done = True
        assert bucket.pending is not None
        bucket.pending.finish()

    def abandon(self) -> None:
        """Recovery after a failed backward: forget the open bucket without issuing it (its
        gradients are discarded); an issued one is still waited on by its groups."""
        if self._open is not None:
            self._open.dropped = True
            self._open = None

