"""The collectives of the training step (and the wrap-time broadcast). Every collective runs on
a flat 1-D buffer through
``torch.distributed`` (NCCL on GPUs, gloo on CPU).

[Note: asynchronous collectives]
:class:`CommStreams` runs a collective either synchronously or in the background and returns a
:class:`CommHandle` whose ``wait()`` is called exactly where the result is needed.

* CUDA: the collective is launched on a side stream (one for all-gathers, one for reductions)
  after that stream waits on the caller stream, so it sees buffers the caller allocated and
  filled; an event recorded after it is what ``wait()`` makes the caller stream wait on. Buffers
  are allocated and freed on the caller stream, and freed only after that wait, so memory is
  never reused while a collective still reads it, without ``record_stream``.
* CPU (gloo): the collective runs with ``async_op=True`` on gloo's worker threads while the
  Python thread keeps computing; ``wait()`` waits on the returned work.

Which calls carry each collective of a group (``collective_impl``) is decided here, by the
:class:`~._collective_impl.GroupCollectives` the caller passes (``collectives=``: the group's
issuer, see [Note: who issues collectives] in ``_runtime/_issuer.py``); see [Note: collective
implementation] in ``_collective_impl.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .. import _registry
from .._profiling import traced
from ._collective_impl import (
    ALL_GATHER,
    ALL_REDUCE,
    BROADCASTS,
    REDUCE_SCATTER,
    GroupCollectives,
)
from ._deadline import WaitBound, wait_for_event

__all__ = [
    "CommHandle", "CommStreams", "all_gather_into", "reduce_scatter_into", "all_reduce_inplace",
    "all_to_all_uneven", "broadcast_from_first", "check_collective_order",
]

Work = dist.Work

# torch 2.14 renamed the flat-tensor collectives; keep working on older releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _choose(logical: str, buffer: torch.Tensor, process_group: ProcessGroup,
            collectives: GroupCollectives | None) -> str:
    if collectives is None:
        return logical
    return collectives.choose(logical, process_group, buffer.nbytes, buffer.device.type)


def _record(logical: str, issued: str, ops: int, buffer: torch.Tensor,
            collectives: GroupCollectives | None) -> None:
    if collectives is not None:
        collectives.record(logical, issued, ops, buffer.nbytes)


class _Joined(dist.Work):
    """Several works waited on as one, then ``then`` (a copy of the result into place).
    A ``dist.Work`` itself, so launch sites and :class:`CommStreams` treat it like any
    other."""

    def __init__(self, works: list[Work], then: Callable[[], object] | None = None) -> None:
        super().__init__()
        self._works = works
        self._then = then

    def wait(self, timeout: object = None) -> bool:
        works, self._works = self._works, []
        for work in works:
            work.wait()
        then, self._then = self._then, None
        if then is not None:
            then()
        return True


def _finish(works: list[Work], then: Callable[[], object] | None, async_op: bool) -> Work | None:
    """Return the works to wait on (``async_op``), or wait now (then run ``then``)."""
    joined = _Joined(works, then)
    if async_op:
        return joined
    joined.wait()
    return None


def all_gather_into(
    output: torch.Tensor, shard: torch.Tensor, process_group: ProcessGroup, async_op: bool = False,
    *, collectives: GroupCollectives | None = None,
) -> Work | None:
    """Gather every rank's ``shard`` into ``output`` (rank-major). ``shard`` may be the rank's own
    slot of ``output`` (in-place gather, used by the replicated-buffer refresh). ``collectives``:
    the issuing group's implementation choice and accounting (None: native, not counted)."""
    issued = _choose(ALL_GATHER, output, process_group, collectives)
    if issued == BROADCASTS:
        world = dist.get_world_size(process_group)
        _record(ALL_GATHER, issued, world, output, collectives)
        return _all_gather_as_broadcasts(output, shard, process_group, world, async_op)
    _record(ALL_GATHER, issued, 1, output, collectives)
    return _all_gather_single(output, shard, group=process_group, async_op=async_op)


def _all_gather_as_broadcasts(
    output: torch.Tensor, shard: torch.Tensor, process_group: ProcessGroup, world: int,
    async_op: bool,
) -> Work | None:
    """The all-gather as one broadcast per rank, each from that rank's slot of ``output`` into
    the same slot on the others: no buffer beyond ``output``, the same bits."""
    n = shard.numel()
    assert output.numel() == n * world, (output.numel(), n, world)
    rank = dist.get_rank(process_group)
    own = output[rank * n : (rank + 1) * n]
    if own.data_ptr() != shard.data_ptr() or own.dtype != shard.dtype:
        own.copy_(shard)
    works = []
    for r in range(world):
        work = dist.broadcast(output[r * n : (r + 1) * n],
                              src=dist.get_global_rank(process_group, r),
                              group=process_group, async_op=True)
        assert work is not None
        works.append(work)
    return _finish(works, None, async_op)


def reduce_scatter_into(
    output: torch.Tensor, reduce_scatter_input: torch.Tensor, process_group: ProcessGroup,
    async_op: bool = False, *, collectives: GroupCollectives | None = None,
) -> Work | None:
    """Sum ``reduce_scatter_input`` over ranks and leave this rank's slot in ``output``, which may
    be that slot of the input itself (in-place reduce-scatter). Under ``collective_impl="auto"``
    the rest of the input may be overwritten with the reduced values too."""
    issued = _choose(REDUCE_SCATTER, reduce_scatter_input, process_group, collectives)
    _record(REDUCE_SCATTER, issued, 1, reduce_scatter_input, collectives)
    if issued == ALL_REDUCE:
        return _reduce_scatter_as_all_reduce(output, reduce_scatter_input, process_group, async_op)
    return _reduce_scatter_single(
        output, reduce_scatter_input, op=dist.ReduceOp.SUM, group=process_group, async_op=async_op
    )


def _reduce_scatter_as_all_reduce(
    output: torch.Tensor, reduce_scatter_input: torch.Tensor, process_group: ProcessGroup,
    async_op: bool,
) -> Work | None:
    """The reduce-scatter as an in-place all-reduce of its input; this rank's slot is the
    result, copied into ``output`` unless ``output`` is that slot."""
    n = output.numel()
    rank = dist.get_rank(process_group)
    slot = reduce_scatter_input[rank * n : (rank + 1) * n]
    work = dist.all_reduce(reduce_scatter_input, op=dist.ReduceOp.SUM, group=process_group,
                           async_op=True)
    assert work is not None
    in_place = slot.data_ptr() == output.data_ptr() and slot.dtype == output.dtype
    then = None if in_place else (lambda: output.copy_(slot))
    return _finish([work], then, async_op)


def all_reduce_inplace(
    buffer: torch.Tensor, process_group: ProcessGroup, async_op: bool = False,
    *, collectives: GroupCollectives | None = None,
) -> Work | None:
    """Sum ``buffer`` over ranks in place."""
    _record(ALL_REDUCE, ALL_REDUCE, 1, buffer, collectives)
    return dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=process_group, async_op=async_op)


def all_to_all_uneven(
    output: torch.Tensor, send: torch.Tensor, output_splits: list[int], send_splits: list[int],
    process_group: ProcessGroup,
) -> None:
    """One all-to-all of 1-D ``send`` into 1-D ``output``: ``send_splits[r]`` elements go to
    group rank ``r`` (in rank order), ``output_splits[r]`` come from it. The whole-matrix
    exchange of matrix optimizers (``_runtime/_whole_matrices.py``) issues it outside the
    training step."""
    dist.all_to_all_single(output, send, output_split_sizes=output_splits,
                           input_split_sizes=send_splits, group=process_group)


def broadcast_from_first(buffer: torch.Tensor, process_group: ProcessGroup) -> None:
    """Overwrite ``buffer`` with its value on the group's first rank (wrap time: replicas start
    from the same weights, as with DDP)."""
    dist.broadcast(buffer, src=dist.get_global_rank(process_group, 0), group=process_group)


def check_collective_order(
    process_group: ProcessGroup, description: str, device: torch.device
) -> None:
    """Debug check (``MFSDP_DEBUG_COLLECTIVES=1``): before a collective, make sure every rank of
    ``process_group`` is about to issue the same one. One 8-byte all-gather of a digest of
    ``description``; on a mismatch every rank raises, naming what each rank issues.

    Without the check, ranks that run different units (data-dependent control flow) pair up
    unrelated collectives: equal-sized buffers silently exchange the wrong data, others abort.
    """
    digest = int.from_bytes(hashlib.sha256(description.encode()).digest()[:7], "little")
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    everyone = torch.empty(dist.get_world_size(process_group), dtype=torch.int64, device=device)
    _all_gather_single(everyone, mine, group=process_group)
    if bool((everyone == mine).all()):
        return
    descriptions: list[str | None] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(descriptions, description, group=process_group)
    issued = "; ".join(f"rank {r}: {d}" for r, d in enumerate(descriptions))
    raise RuntimeError(
        f"ranks issue different collectives ({issued}). Every rank must run the same "
        "fully_shard units, in the same order, with the same micro-batch marking, in every "
        "iteration: make data-dependent control flow agree across ranks (e.g. decide it from an "
        "all-reduced flag), or run the skipped unit with an empty input"
    )


class CommHandle(Protocol):
    def wait(self) -> None: ...


class _WorkHandle:
    __slots__ = ("work",)

    def __init__(self, work: Work) -> None:
        self.work = work

    def wait(self) -> None:
        self.work.wait()


class _EventHandle:
    __slots__ = ("event", "streams")

    def __init__(self, event: torch.cuda.Event, streams: CommStreams) -> None:
        self.event = event
        self.streams = streams  # whose wait bound applies (set during recovery only)

    def wait(self) -> None:
        # Recovery only: poll until done or its deadline (see [Note: recovery deadline]).
        wait_for_event(self.event.query, self.streams.wait_bound)
        torch.cuda.current_stream(self.streams.device).wait_event(self.event)


Launch = Callable[[bool], "Work | None"]


class CommStreams:
    """Where collectives of one device run. See [Note: asynchronous collectives]."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.all_gather_stream = torch.cuda.Stream(device, priority=-1)
            self.reduce_stream = torch.cuda.Stream(device, priority=-1)
        # How long waits on this device's events may take; None outside recovery (see [Note:
        # recovery deadline]).
        self.wait_bound: WaitBound | None = None

    @contextmanager
    def bounded_waits(self, bound: WaitBound) -> Iterator[None]:
        """Inside the block, waits on the events of these streams poll under ``bound``."""
        previous, self.wait_bound = self.wait_bound, bound
        try:
            yield
        finally:
            self.wait_bound = previous

    def run(self, launch: Launch, *, async_op: bool, reduce: bool) -> CommHandle | None:
        """Run ``launch(async_op)``; in the background when ``async_op``. Returns the handle to
        wait on, or None when the collective has already completed (in stream order)."""
        if not async_op:
            _run_synchronously(launch)
            return None
        if not self.is_cuda:
            work = launch(True)
            return _WorkHandle(work) if work is not None else None
        stream = self.reduce_stream if reduce else self.all_gather_stream
        # The parameters' device, not the current one: they may differ.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            launch(False)
            event = torch.cuda.Event()
            event.record(stream)
        return _EventHandle(event, self)


@traced("mfsdp::sync_collective")
def _run_synchronously(launch: Launch) -> None:
    launch(False)


def streams_for(device: torch.device) -> CommStreams:
    """The shared :class:`CommStreams` of ``device`` (one pair of side streams per GPU)."""
    streams = _registry.comm_streams.get(device)
    if streams is None:
        streams = _registry.comm_streams[device] = CommStreams(device)
    return streams
