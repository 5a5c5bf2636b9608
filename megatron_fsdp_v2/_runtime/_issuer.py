"""One flat group's collectives, launched in one place: :class:`GroupIssuer` owns the group's
process groups, the ``collective_impl`` choice and its accounting, the debug order check and
the streams, and :meth:`GroupIssuer.launch` runs a :class:`CollectiveLaunch` (a description of
one collective over flat buffers) and returns its :class:`Pending` handle.

[Note: who issues collectives]
Every collective of a group's gradient and weight pipeline goes down the layers once and comes
back once:

* the group's gradient state machine (``GroupGrads`` in ``_grads.py``) or weights
  (``FlatParamGroup`` in ``_flat_param_group.py``) decide *that* a reduction, gather or refresh
  runs now, and pass the group's issuer down;
* the planning functions (``_reduce.py`` for reductions, ``_gather.py`` for gathers and
  refreshes, and the tree's buckets in ``_coalesce.py`` and ``_refresh_buckets.py``) prepare
  the buffers the plan names (copy-in, workspace, staging buffer), describe the collective as a
  :class:`CollectiveLaunch` with what completes it (copy-out, freeing a temporary), and hand it
  to the issuer of the group it is counted for (a bucket: the tree's bucket account for its
  process group, :class:`BucketIssuers`, never a member's);
* :meth:`GroupIssuer.launch` runs the debug order check, then the collective function of
  ``_collectives.py`` on the stream or ``async_op`` of [Note: asynchronous collectives], passing
  its :class:`~.._comm._collective_impl.GroupCollectives` explicitly (which calls carry the
  collective, and the count of what ran);
* the :class:`Pending` it returns travels back up to whoever waits: ``finish()`` waits and then
  completes, exactly once. What completes several of them, or something issued for several
  groups (a bucket's shared collective, the end of a window), is a :class:`Deferred`: it waits
  and finishes, and never launches; a collective is launched only where the schedule issues it.

One issuer per group rather than per unit: a unit's groups differ in dtype, device and
``requires_grad`` and are counted, named in the debug check and coalesced one by one, and the
process groups are the group's (``FlatParamGroup`` is what the checkpoint and the clipping code
ask for them). Nothing is looked up from a context variable: the accounting a collective goes
into is an argument all the way down.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._buffers._plan import Collective
from .._comm import _collectives as comm
from .._comm._collective_impl import GroupCollectives
from .._profiling import traced

__all__ = ["BucketIssuers", "CollectiveLaunch", "Deferred", "Finishable", "GroupIssuer", "Pending"]


class Pending:
    """An issued collective: :meth:`wait` blocks until its output is written; :meth:`finish`
    also runs what consumes it (a copy-out, freeing a scratch buffer), exactly once."""

    __slots__ = ("_handle", "_finish", "_what")

    def __init__(
        self, handle: comm.CommHandle | None, finish: Callable[[], None] | None = None,
        what: tuple[str, str] = ("collective", "its group"),
    ) -> None:
        self._handle = handle
        self._finish = finish
        # (collective, group) named if the transport times out waiting for it; formatted only
        # then (a Pending is made per collective, on the step's path).
        self._what = what

    @traced("mfsdp::wait")
    def wait(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            try:
                handle.wait()
            except RuntimeError as e:
                raise _explained(e, self._what) from e

    @property
    def holds_temporary(self) -> bool:
        """Whether finishing it consumes a scratch buffer (a reduction in place into a
        persistent buffer has nothing left to run)."""
        return self._finish is not None

    def finish(self) -> None:
        self.wait()
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


class Deferred:
    """Work that completes what was issued before (a bucket's shared collective, a gather of
    several buffers and its post-processing, the end of a gradient window): no handle of its
    own, and its :meth:`finish` never launches a collective -- what it finishes was launched
    where the schedule issues it (see [Note: who issues collectives]). ``what`` names it."""

    __slots__ = ("what", "_finish")

    def __init__(self, what: str, finish: Callable[[], None]) -> None:
        self.what = what
        self._finish: Callable[[], None] | None = finish

    @property
    def holds_temporary(self) -> bool:
        """Whether finishing it is still to run (it may consume a scratch buffer)."""
        return self._finish is not None

    def finish(self) -> None:
        """Run what it finishes, exactly once."""
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    def __repr__(self) -> str:
        return f"Deferred({self.what!r})"


# What a schedule waits on: an issued collective, or the completion of something issued.
Finishable = Pending | Deferred


@dataclass(frozen=True, eq=False)
class CollectiveLaunch:
    """One collective over flat buffers, described for :meth:`GroupIssuer.launch`.

    ``full`` is the whole flat buffer and ``part`` this rank's part of it:

    * ``ALL_GATHER``: every rank's ``part`` gathered into ``full`` (``part`` may be this rank's
      own slot of ``full``: an in-place gather);
    * ``REDUCE_SCATTER``: ``full`` summed over the ranks, this rank's slot left in ``part``
      (which may be that slot of ``full``);
    * ``ALL_REDUCE``: ``full`` summed in place (``part`` unused).
    """

    op: Collective
    full: torch.Tensor
    part: torch.Tensor | None
    what: str  # names it in the debug order check ("all-gather", "outer all-reduce", ...)
    axis: str = "shard"  # the mesh axis it runs over: "shard", "outer" or "mesh"
    after: Pending | None = None  # waited on where the collective launches (stream order)
    complete: Callable[[], None] | None = None  # run by Pending.finish after the wait

    @property
    def is_reduction(self) -> bool:
        """Reductions and gathers run on different side streams on CUDA."""
        return self.op is not Collective.ALL_GATHER


class GroupIssuer:
    """The process groups and collectives of one flat group (see [Note: who issues
    collectives])."""

    def __init__(
        self, *, name: str, numel: int | None, device: torch.device,
        process_group: dist.ProcessGroup, outer_process_group: dist.ProcessGroup | None,
        mesh_process_group: dist.ProcessGroup | None, collective_impl: str,
    ) -> None:
        self.name = name  # the group's, in the debug order check
        # The group's flat size, in the debug order check (None: a bucket account, whose
        # launches name their own size).
        self.numel = numel
        self.device = device
        # The inner axis' group: the layout and every collective of the inner schedule.
        self.process_group = process_group
        # HSDP: the ranks that hold the same inner shard (None on a 1-D mesh).
        self.outer_process_group = outer_process_group
        # The whole mesh, where a plan norms over it (None otherwise).
        self.mesh_process_group = mesh_process_group
        self.axis_process_groups: dict[str, dist.ProcessGroup] = {"shard": process_group}
        if outer_process_group is not None:
            self.axis_process_groups["outer"] = outer_process_group
        if mesh_process_group is not None:
            self.axis_process_groups["mesh"] = mesh_process_group
        # Which calls carry this group's collectives, and the count of what ran.
        self.collectives = GroupCollectives(collective_impl)
        self.streams = comm.streams_for(device)
        self.debug = os.environ.get("MFSDP_DEBUG_COLLECTIVES", "0") == "1"

    def launch(self, collective: CollectiveLaunch, async_op: bool) -> Pending:
        """Run ``collective`` over its axis' process group, in the background when ``async_op``
        (see [Note: asynchronous collectives]); the handle's ``finish()`` waits for it, then
        runs its ``complete``."""
        group = self.axis_process_groups[collective.axis]
        if self.debug:
            size = "" if self.numel is None else f" ({self.numel} elements)"
            comm.check_collective_order(
                group, f"{collective.what} of {self.name}{size}", self.device
            )
        collectives = self.collectives

        def run(a: bool) -> dist.Work | None:
            if collective.after is not None:
                collective.after.wait()
            op, full, part = collective.op, collective.full, collective.part
            if op is Collective.ALL_REDUCE:
                return comm.all_reduce_inplace(full, group, a, collectives=collectives)
            assert part is not None, collective
            if op is Collective.ALL_GATHER:
                return comm.all_gather_into(full, part, group, a, collectives=collectives)
            return comm.reduce_scatter_into(part, full, group, a, collectives=collectives)

        what = (collective.what, self.name)
        try:
            handle = self.streams.run(run, async_op=async_op, reduce=collective.is_reduction)
        except RuntimeError as e:
            raise _explained(e, what) from e
        return Pending(handle, collective.complete, what)


class BucketIssuers:
    """The issuer accounts of a tree's buckets of one kind (reduction or refresh buckets): one
    :class:`GroupIssuer` per process group, device and ``collective_impl``, made on first use.
    A bucket's collective covers several groups (often of several units), so it is launched,
    counted (``FSDPModule.collective_stats`` of the root) and named in the debug order check and
    in timeouts as the bucket's, not as its first member's."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "reduction buckets", "refresh buckets": the accounts' name
        self._issuers: dict[tuple[int, torch.device, str], GroupIssuer] = {}

    def issuer(self, process_group: dist.ProcessGroup, device: torch.device,
               collective_impl: str) -> GroupIssuer:
        """The account of buckets over ``process_group`` on ``device``; ``collective_impl``:
        the members' (a bucket issues what its first member's setting chooses)."""
        # The issuer holds the process group, so its id is not reused while the key lives.
        key = (id(process_group), device, collective_impl)
        issuer = self._issuers.get(key)
        if issuer is None:
            issuer = self._issuers[key] = GroupIssuer(
                name=f"the tree's {self.kind}", numel=None, device=device,
                process_group=process_group, outer_process_group=None,
                mesh_process_group=None, collective_impl=collective_impl,
            )
        return issuer

    @property
    def accounts(self) -> list[GroupCollectives]:
        """What each account counted (``FSDPModule.collective_stats``)."""
        return [issuer.collectives for issuer in self._issuers.values()]


_TRANSPORT_GAVE_UP = ("timed out", "timeout", "closed by peer", "reset by peer")


def _explained(error: RuntimeError, what: tuple[str, str]) -> RuntimeError:
    """``error`` with what a transport timeout means here: some rank did not issue the
    matching collective (its text kept, so callers matching the transport's words still
    do). Any other error is returned as it is."""
    text = str(error)
    # A peer that timed out first closes its connections: this rank then sees the close, not a
    # timeout of its own (which rank sees which is a race).
    if not any(sign in text.lower() for sign in _TRANSPORT_GAVE_UP):
        return error
    message = (
        f"{text}\nfully_shard: the {what[0]} of {what[1]} did not complete within the group's "
        "timeout: some rank of the group did not issue the matching collective. Every rank must"
        " run the same forwards (evaluation forwards included: a sharded unit gathers its "
        "weights in every forward), backwards and optimizer steps of a wrapped model, in the "
        "same order. Do not run a forward on some ranks only (e.g. evaluation under `if rank =="
        " 0:`): to evaluate on one rank, call checkpoint.get_full_state_dict(model) on every "
        "rank and load it into an unwrapped copy on that rank. MFSDP_DEBUG_COLLECTIVES=1 names "
        "the collective each rank was about to issue"
    )
    try:
        return type(error)(message)
    except TypeError:  # an exception class with another constructor
        return RuntimeError(message)
