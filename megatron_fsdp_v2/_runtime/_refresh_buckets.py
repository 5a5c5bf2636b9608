"""Coalescing of the refresh all-gathers (``fully_shard(..., refresh_bucket_size_mb=...)``):
after an optimizer step, ``optim`` and ``optim_grads`` rebuild each group's replicated compute
weights with one in-place all-gather of every rank's updated shard (see [Note: replicated-buffer
refresh] in ``_gather.py``); with a bucket size, consecutive groups share one.

[Note: refresh buckets]
A model of many small units pays one all-gather launch per group after every step, which on
gloo costs far more than the bytes (DeepSpeed's ZeRO-1/2 have ``allgather_bucket_size`` for
this). The root's pre-forward (``FSDPState._root_pre_forward``) hands the tree's
:class:`RefreshCoalescer` the groups whose compute weights are stale, in forward order (the
order the previous forward recorded, else the wrap order: the same on every rank). It cuts them
into buckets of consecutive groups with one process group, device and compute dtype, each at
most the bucket size in gathered bytes; a group that would be alone in its bucket keeps its own
in-place all-gather. A member asked for its weights (``FlatParamGroup.ready_compute_weights``:
the root's launch of every refresh with ``overlap=True``, else the unit's pre-forward) issues its
bucket and, first, every bucket planned before it, so every rank issues the same collectives in
the same order:

* copy-in: each member's main-weight shard, cast to the compute dtype where the main weights
  are separate (the cast-and-copy kernel of the uncoalesced refresh), into its column of this
  rank's slot of a staging scratch buffer (``refresh_staging``): rank-major, rank r's slot holds
  slot r of every member in order;
* one all-gather of that slot, in place, through the tree's refresh-bucket account for the
  members' process group (``RefreshCoalescer.issuers``: the debug order check and the
  accounting, which the root's ``collective_stats`` reports; the first member's
  ``collective_impl``; see [Note: who issues collectives] in ``_issuer.py``);
* copy-out, when a member first waits for its weights: every rank's column of each member into
  its replicated ``model_weight`` (one strided copy per member); then the staging buffer is
  freed.

Issuing a bucket makes all its members fresh and gives them one shared handle; whichever waits
first completes the bucket for all. Copies move bits, so the compute weights are bitwise those
of the uncoalesced refresh. At most two buckets are alive (issuing a third completes the oldest
first): two bucket sizes of temporary memory, where the in-place refresh needs none. With
``overlap=True`` the root's pre-forward issues the first two, and each unit's pre-forward,
once it waited for its weights (which completes their buckets), issues the next ones up to two
alive (``RefreshCoalescer.prefetch``), so the gathers still run ahead of the units' compute.
Waiting only waits: a wait that issued the next bucket would issue wherever the waiting code
happens to wait. When the root's forward ends,
buckets still in flight (their units skipped by control flow) are completed and unissued ones
dropped (their groups stay stale and are refreshed on their own when next used), so no
temporary outlives the forward.

Opt-in, because it changes the documented count (one refresh all-gather per group per step) and
costs the copies and the buckets' memory, which do not pay off for large units. A 2-D (HSDP)
mesh is refused; ``no_shard`` (no all-gather) and ``optim_grads_params`` (its gathers are per
unit, freed after use) are unaffected, and so are groups gathered through FSDP2's all-gather
extensions (FP8 parameters: one all-gather per input buffer of the group; see [Note: FSDP2
all-gather extensions] in ``_subclass_gather.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import ops
from .._buffers._plan import Collective, Refresh
from .._profiling import traced
from ._issuer import BucketIssuers, CollectiveLaunch, Deferred, Pending

if TYPE_CHECKING:
    from .._buffers._allocator import ScratchAllocator
    from ._flat_param_group import FlatParamGroup

__all__ = ["RefreshBucket", "RefreshCoalescer", "coalescible"]

_MAX_ALIVE = 2


def coalescible(group: FlatParamGroup) -> bool:
    """Whether ``group``'s refresh is one in-place all-gather over its own process group (1-D
    ``optim``/``optim_grads``), which a bucket can carry."""
    steps = group.plan.refresh_steps
    return (
        group.plan.refresh is Refresh.CAST_OWN_SLOT_THEN_GATHER
        and not group.plan.gathers_weights and len(steps) == 1
        and steps[0].op is Collective.ALL_GATHER and steps[0].axis == "shard"
    )


class RefreshBucket:
    """Consecutive groups whose refresh all-gathers run as one."""

    __slots__ = ("coalescer", "members", "index", "pending", "issued", "done")

    def __init__(self, coalescer: RefreshCoalescer, members: list[FlatParamGroup],
                 index: int) -> None:
        self.coalescer = coalescer
        self.members = members
        self.index = index  # position in the plan
        self.pending: Pending | None = None
        self.issued = False
        self.done = False


class RefreshCoalescer:
    """The tree's refresh buckets (see [Note: refresh buckets])."""

    def __init__(self, bucket_size_mb: float, allocator: ScratchAllocator, overlap: bool) -> None:
        self.bucket_bytes = max(1, int(bucket_size_mb * (1 << 20)))
        self.allocator = allocator
        # The buckets' own issuer accounts (see [Note: who issues collectives] in _issuer.py).
        self.issuers = BucketIssuers("refresh buckets")
        self.overlap = overlap  # the root's: prefetch the next bucket when one completes
        self._plan: list[RefreshBucket] = []
        self._next = 0  # the first bucket of the plan not issued yet
        self._alive: list[RefreshBucket] = []  # issued, not completed (oldest first)
        # What coalescing did, cumulative (tests and users read it): all-gathers issued for a
        # bucket and the groups they covered.
        self.coalesced_collectives = 0
        self.coalesced_groups = 0

    # ------------------------------------------------------------------ planning

    def plan(self, stale: list[FlatParamGroup]) -> None:
        """A new forward: cut ``stale`` (in forward order) into buckets. What the last forward
        left is settled first."""
        self.settle()
        buckets: list[list[FlatParamGroup]] = []
        key: tuple[object, ...] | None = None
        nbytes = 0
        for group in stale:
            if not coalescible(group):
                continue
            group_key = (id(group.process_group), group.device, group.dtypes.model)
            group_bytes = group.model_weight.numel() * group.dtypes.model.itemsize
            if not buckets or key != group_key or nbytes + group_bytes > self.bucket_bytes:
                buckets.append([])
                key, nbytes = group_key, 0
            buckets[-1].append(group)
            nbytes += group_bytes
        for members in buckets:
            if len(members) < 2:
                continue  # alone: its own in-place all-gather, nothing copied
            bucket = RefreshBucket(self, members, len(self._plan))
            for group in members:
                group.weights.refresh_bucket = bucket
            self._plan.append(bucket)

    def settle(self) -> None:
        """End of a forward (or the next plan): complete buckets in flight, drop the rest."""
        for bucket in self._plan[self._next:]:
            for group in bucket.members:
                group.weights.refresh_bucket = None  # still stale: refreshed alone when used
        self._plan, self._next = [], 0
        while self._alive:
            self._retire(self._alive[0])

    # ------------------------------------------------------------------ issuing

    def issue_through(self, bucket: RefreshBucket, async_op: bool) -> bool:
        """Issue ``bucket`` and every bucket planned before it that is not issued yet; False if
        it was issued already."""
        if bucket.issued:
            return False
        assert self._plan[bucket.index] is bucket, "a bucket of an earlier plan"
        # Buckets and their views made under inference mode could not be written later.
        with torch.inference_mode(False):
            while self._next <= bucket.index:
                self._next += 1
                self._issue(self._plan[self._next - 1], async_op)
        return True

    @traced("mfsdp::refresh")
    def _issue(self, bucket: RefreshBucket, async_op: bool) -> None:
        bucket.issued = True
        while len(self._alive) >= _MAX_ALIVE:
            self._retire(self._alive[0])
        members = bucket.members
        first = members[0]
        world, rank = first.world_size, first.rank
        widths = [g.main_weight.numel() for g in members]
        slot_numel = sum(widths)
        key = ("tree", "refresh_staging", bucket.index % _MAX_ALIVE)
        gathered = self.allocator.allocate(key, slot_numel * world, first.dtypes.model,
                                           first.device)
        own = gathered[rank * slot_numel : (rank + 1) * slot_numel]
        offsets, column = [], rank * slot_numel
        for width in widths:
            offsets.append(column)
            column += width
        # The refresh's cast-and-copy kernel (same rounding as the uncoalesced refresh).
        ops.pack_([g.main_weight for g in members], offsets, gathered)
        allocator = self.allocator

        def finish() -> None:
            by_rank = gathered.view(world, slot_numel)
            column = 0
            with torch.no_grad():
                for group, width in zip(members, widths):
                    group.model_weight.view(world, width).copy_(
                        by_rank[:, column : column + width]
                    )
                    column += width
            allocator.free(key)

        what = (f"coalesced refresh all-gather of {len(members)} groups ({first.name} to "
                f"{members[-1].name}, {gathered.numel()} elements)")
        issuer = self.issuers.issuer(first.process_group, first.device, first.collectives.impl)
        bucket.pending = issuer.launch(CollectiveLaunch(
            Collective.ALL_GATHER, gathered, own, what=what, complete=finish,
        ), async_op)
        shared = Deferred("a refresh bucket's all-gather, then its copy-out",
                          lambda: self.complete(bucket))
        for group in members:
            group.weights.refresh_bucket = None
            group.weights.take_refresh(shared)
        self._alive.append(bucket)
        self.coalesced_collectives += 1
        self.coalesced_groups += len(members)

    def complete(self, bucket: RefreshBucket) -> None:
        """A member waits for its weights: complete ``bucket`` (once). Only waits: the next
        bucket is issued by :meth:`prefetch`, where the unit's pre-forward has waited for its
        weights."""
        self._retire(bucket)

    def prefetch(self) -> None:
        """With ``overlap``: issue the plan's next buckets asynchronously while fewer than two
        are alive, so the gathers stay ahead of compute (a unit's pre-forward, after it
        waited for its weights, which completes their buckets)."""
        while self.overlap and self._next < len(self._plan) and len(self._alive) < _MAX_ALIVE:
            self.issue_through(self._plan[self._next], async_op=True)

    def _retire(self, bucket: RefreshBucket) -> None:
        """Wait for ``bucket`` and copy its result out, exactly once."""
        if bucket.done:
            return
        bucket.done = True
        self._alive.remove(bucket)
        assert bucket.pending is not None
        bucket.pending.finish()

    def issues_now(self, group: FlatParamGroup) -> bool:
        """Whether the root's launch of every refresh issues ``group``'s now: a group on its
        own, or in a bucket while fewer than two are alive (the rest follow as they complete)."""
        return group.weights.refresh_bucket is None or len(self._alive) < _MAX_ALIVE

