"""Streaming full weights out of a ``fully_shard`` model: ``(name, full tensor)`` pairs in
``model.state_dict()`` order, gathered a bucket of parameters at a time into one reused buffer
whose size the caller chooses (see :func:`iter_full_weights`).

[Note: streaming full weights]
Reinforcement-learning stacks push the full weights to an inference engine every few steps.
``get_full_state_dict`` (or torch's ``get_model_state_dict(full_state_dict=True)``) holds the
whole model at once on the receiving rank; here at most two buckets are alive.

*Buckets.* The managed parameters, in state-dict order, are cut into buckets of consecutive
parameters that share a gather group, dtype and device. The plan depends only on the layouts
and the bucket size, so every rank computes the same one (the bucket size and ``to_rank`` are
agreed first, one object all-gather). A bucket is gathered by one ``all_gather_into_tensor``
over its gather group: every holder of a distinct piece of the flat buffers packs its rows of
the bucket's parameters into its own slot of the gather region (``ops.pack_``), the gather runs
in place, and ``ops.pack_`` again copies every holder's rows into the assembly region, where
each parameter is contiguous. The gather group is the group's ``process_group`` for a
row-sharded main weight (1-D, or HSDP outer ``no_shard``: each replica gathers its own copy);
the whole HSDP mesh's group for outer ``optim``, whose ranks hold distinct sub-shards (piece
``s * R + r`` for mesh coordinate ``(r, s)``); none for ``no_shard``, whose main weight is full
on every rank (the assembly copies it). A bucket holds at most ``bucket_size`` bytes in the
gather region (holders x the largest holder's rows: uneven shards pad the smaller slots) and
in the assembly region; a parameter that alone exceeds it forms a bucket of its own and grows
the buffer to fit it. The buffer (gather region + assembly region, one byte tensor per device)
is allocated once, at the largest bucket's need, and reused. (gloo's all-gather allocates its
own output, the size of the gather, and copies it into ours: one more bucket at the peak there;
NCCL gathers in place.)

*Values.* The main weights (fp32 when a separate main buffer exists), as torch's full state
dict gives them: an FP8 parameter's main weight is plain main-dtype rows (the float8 bytes are
a separate buffer), so its full-precision value comes out; a tensor-parallel parameter's
buffers hold its TP-local tensor, which is then all-gathered over the TP mesh by DTensor
(``full_tensor()`` on the TP placements, TP's own ``torch.chunk`` layout: one TP all-gather per
TP parameter, a fresh tensor of the global size). Entries ``fully_shard`` does not manage are
yielded as ``model.state_dict()`` holds them: plain tensors detached (views of the model's own
buffers), other DTensors through their own ``full_tensor()``, other objects as they are.

*Early stop.* A rank whose iterator is closed before the end (``break`` or an exception out of
a ``for`` loop over it, ``close()``, its garbage collection) runs the remaining collectives
without yielding, so the other ranks finish with the right values. A rank that keeps the
iterator alive and stops calling ``next`` leaves its peers at the next bucket's arrival check
(``[Note: arrival check]`` in ``_comm/_arrival.py``), which raises a ``RuntimeError`` naming it
after the group's collective timeout, before that bucket's gather.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import _registry, ops
from .._buffers._plan import Extent
from .._comm._arrival import await_every_rank
from .._init._materialize import materialize
from .._runtime._flat_param_group import FlatParamGroup
from . import _process_group

__all__ = ["iter_full_weights"]

_CALL = "iter_full_weights"
_ALIGN_BYTES = 64  # each region of the byte buffer starts here, so any dtype can view it


@dataclass
class _Member:
    """One parameter of a bucket: where its full (TP-local) value lies in the assembly."""

    group: FlatParamGroup
    index: int
    offset: int  # in the assembly region, elements of the bucket's dtype
    numel: int


@dataclass
class _Bucket:
    """Consecutive managed parameters gathered by one collective (or none)."""

    gather_process_group: dist.ProcessGroup | None  # None: the main weights are full here
    slot: int  # this rank's slot in the gather region
    holders: int  # slots in the gather region (1 without a collective)
    dtype: torch.dtype
    device: torch.device
    members: dict[int, _Member] = field(default_factory=dict)  # id(param) -> member
    slot_numel: int = 0  # the largest holder's rows, elements
    holder_numel: list[int] = field(default_factory=list)  # each holder's rows so far
    assembly_numel: int = 0
    # This rank's pieces (its main-weight rows, offset in its slot or, without a collective, in
    # the assembly), and every holder's (holder, offset in its slot, offset in the assembly,
    # length).
    send: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    recv: list[tuple[int, int, int, int]] = field(default_factory=list)
    has_tp: bool = False

    @property
    def gather_numel(self) -> int:
        return self.holders * self.slot_numel if self.gather_process_group is not None else 0


def _aligned_bytes(numel: int, dtype: torch.dtype) -> int:
    nbytes = numel * dtype.itemsize
    return -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES


class _Holders:
    """For one group: its gather group, this rank's slot and each slot's span of the flat layout
    (the main-weight span the rank in that slot holds)."""

    def __init__(self, group: FlatParamGroup) -> None:
        extent = group.plan.optimizer_placement
        if extent is Extent.FULL or not dist.is_initialized():
            self.gather_process_group: dist.ProcessGroup | None = None
            self.spans = [group.plan.main_weight_span]
            self.slot = 0
            return
        mesh = group.mesh
        gather = (group.process_group if extent is Extent.SHARD
                  else _process_group.hsdp_mesh_process_group(group))
        coords = mesh.mesh
        layout = group.layout
        spans = []
        for g in range(dist.get_world_size(gather)):
            where = (coords == dist.get_global_rank(gather, g)).nonzero()[0].tolist()
            s = where[-1]
            # Outer optim: rank (r, s) holds sub-shard s * R + r (see _plan.make_plan).
            piece = s if extent is Extent.SHARD else s * mesh.size(0) + where[0]
            spans.append(layout.shard_range(piece))
        self.gather_process_group = gather if len(spans) > 1 else None
        self.spans = spans if len(spans) > 1 else [group.plan.main_weight_span]
        self.slot = dist.get_rank(gather) if len(spans) > 1 else 0


def _plan_buckets(entries: list[tuple[str, Any]], managed: dict[str, nn.Parameter],
                  bucket_bytes: int) -> tuple[dict[str, int], list[_Bucket]]:
    """Which bucket each managed entry is gathered in (name -> bucket index), and the buckets.
    The same on every rank: layouts, spans and ``bucket_bytes`` only."""
    holders: dict[int, _Holders] = {}
    buckets: list[_Bucket] = []
    where: dict[str, int] = {}
    for name, _ in entries:
        param = managed.get(name)
        if param is None:
            continue
        record = _registry.record_of(param)
        assert record is not None
        group, index = record.group, record.index
        h = holders.get(id(group))
        if h is None:
            h = holders[id(group)] = _Holders(group)
        item = group.layout.items[index]
        # The group's device: CPU offload keeps main weights in host memory, gathered here.
        dtype, device = group.main_weight.dtype, group.device
        pieces = [group.layout.local_item_range(index, *span) for span in h.spans]
        sizes = [hi - lo for lo, hi in pieces]
        bucket = buckets[-1] if buckets else None
        if bucket is not None and id(param) in bucket.members:
            where[name] = len(buckets) - 1  # tied: a second name of a parameter gathered here
            continue
        limit = max(1, bucket_bytes // dtype.itemsize)
        fits = (
            bucket is not None
            and bucket.gather_process_group is h.gather_process_group
            and bucket.dtype == dtype and bucket.device == device
            and bucket.assembly_numel + item.numel <= limit
            and (bucket.gather_process_group is None or bucket.holders * max(
                a + b for a, b in zip(bucket.holder_numel, sizes)) <= limit)
        )
        if not fits:
            bucket = _Bucket(h.gather_process_group, h.slot, len(h.spans), dtype, device,
                             holder_numel=[0] * len(h.spans))
            buckets.append(bucket)
        assert bucket is not None
        start, end = group.plan.main_weight_span
        mine = pieces[h.slot]
        if mine[1] > mine[0]:  # this rank's rows: packed into its slot, or copied directly
            dst = bucket.holder_numel[h.slot] if bucket.gather_process_group is not None else (
                bucket.assembly_numel + mine[0] - item.offset)
            bucket.send.append((group.main_weight[mine[0] - start : mine[1] - start], dst))
        if bucket.gather_process_group is not None:
            for g, (lo, hi) in enumerate(pieces):
                if hi > lo:
                    bucket.recv.append((g, bucket.holder_numel[g],
                                        bucket.assembly_numel + lo - item.offset, hi - lo))
                    bucket.holder_numel[g] += hi - lo
            bucket.slot_numel = max(bucket.holder_numel)
        bucket.members[id(param)] = _Member(group, index, bucket.assembly_numel, item.numel)
        bucket.has_tp |= group.tp_faces[index] is not None
        bucket.assembly_numel += item.numel
        where[name] = len(buckets) - 1
    return where, buckets


class _Buffer:
    """The reused byte buffer of one device: the gather region, then the assembly region."""

    def __init__(self, buckets: list[_Bucket], device: torch.device, keep: bool) -> None:
        """``keep``: this rank yields, so every bucket assembles (else only tensor-parallel
        ones, whose TP all-gather needs this rank's TP-local value)."""
        mine = [b for b in buckets if b.device == device]
        self.gather_bytes = max((_aligned_bytes(b.gather_numel, b.dtype) for b in mine),
                                default=0)
        assembly = max((_aligned_bytes(b.assembly_numel, b.dtype) for b in mine
                        if keep or b.has_tp), default=0)
        self.data = torch.empty(self.gather_bytes + assembly, dtype=torch.uint8, device=device)

    def gather_region(self, bucket: _Bucket) -> torch.Tensor:
        nbytes = bucket.gather_numel * bucket.dtype.itemsize
        return self.data[:nbytes].view(bucket.dtype)

    def assembly_region(self, bucket: _Bucket) -> torch.Tensor:
        nbytes = bucket.assembly_numel * bucket.dtype.itemsize
        return self.data[self.gather_bytes : self.gather_bytes + nbytes].view(bucket.dtype)


def _gather(bucket: _Bucket, buffer: _Buffer, assemble: bool) -> torch.Tensor | None:
    """Run ``bucket``'s collective; return its assembly region (each member's full TP-local
    value, contiguous) when ``assemble``."""
    assembly = buffer.assembly_region(bucket) if assemble else None
    if bucket.gather_process_group is None:
        if assembly is not None and bucket.send:
            ops.pack_([t.to(assembly.device) for t, _ in bucket.send],
                      [o for _, o in bucket.send], assembly)
        return assembly
    await_every_rank(_CALL, bucket.gather_process_group)
    gathered = buffer.gather_region(bucket)
    slot = gathered[bucket.slot * bucket.slot_numel : (bucket.slot + 1) * bucket.slot_numel]
    if bucket.send:  # host rows (CPU offload) copied to the device first
        ops.pack_([t.to(slot.device) for t, _ in bucket.send], [o for _, o in bucket.send],
                  slot)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(gathered, slot, group=bucket.gather_process_group)
    if assembly is not None and bucket.recv:
        m = bucket.slot_numel
        pieces = [gathered[g * m + src : g * m + src + n] for g, src, _, n in bucket.recv]
        ops.pack_(pieces, [dst for _, _, dst, _ in bucket.recv], assembly)
    return assembly


def _full_value(member: _Member, assembly: torch.Tensor) -> torch.Tensor:
    """The member's global full value: its assembled (TP-local) rows, all-gathered over the TP
    mesh for a tensor-parallel parameter."""
    item = member.group.layout.items[member.index]
    local = assembly[member.offset : member.offset + member.numel].view(item.shape)
    face = member.group.tp_faces[member.index]
    if face is None or face.tp_mesh is None:
        return local
    tp = DTensor.from_local(local, face.tp_mesh, face.tp_placements, run_check=False,
                            shape=face.shape, stride=face.stride)
    return tp.full_tensor()


def _check_arguments(model: Any, bucket_size_mb: Any, to_rank: Any) -> int:
    """The bucket size in bytes; ``TypeError``/``ValueError`` for bad arguments (local, before
    any collective)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"iter_full_weights: model must be an nn.Module, got {type(model)}")
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)):
        raise TypeError(
            f"iter_full_weights: bucket_size_mb must be a number of MiB (e.g. 256), got "
            f"{bucket_size_mb!r}"
        )
    if not (math.isfinite(bucket_size_mb) and bucket_size_mb > 0):
        raise ValueError(
            f"iter_full_weights: bucket_size_mb must be a positive, finite number of MiB, got "
            f"{bucket_size_mb!r}"
        )
    if to_rank is not None and (isinstance(to_rank, bool) or not isinstance(to_rank, int)):
        raise TypeError(
            f"iter_full_weights: to_rank must be a global rank (int) or None (every rank), got "
            f"{to_rank!r}"
        )
    if not any(_registry.state_of(m) is not None for m in model.modules()):
        raise ValueError(
            "iter_full_weights: the model has no fully_shard unit; call fully_shard on it (or "
            "read model.state_dict() directly)"
        )
    return max(1, int(bucket_size_mb * 2**20))


def _check_to_rank(to_rank: int | None, process_group: dist.ProcessGroup | None) -> None:
    if to_rank is None:
        return
    ranks = (list(dist.get_process_group_ranks(process_group)) if process_group is not None
             else list(range(dist.get_world_size())) if dist.is_initialized() else [0])
    if to_rank not in ranks:
        raise ValueError(
            f"iter_full_weights: to_rank={to_rank} is not a rank of the model's mesh (global "
            f"ranks {ranks}); pass one of them, or None for every rank"
        )


def iter_full_weights(
    model: nn.Module, *, bucket_size_mb: float, to_rank: int | None = None
) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, full tensor)`` for every entry of ``model.state_dict()``, in its order and
    under its names (tied parameters under each of theirs), with the values torch's
    ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))`` gives,
    bitwise, while holding at most two buckets of ``bucket_size_mb`` MiB at a time (on gloo, its
    all-gather's own temporary output adds one more).

    Managed parameters are gathered a bucket at a time: one ``all_gather_into_tensor`` per
    bucket of consecutive parameters (same gather group and dtype) on the units' process group
    (the whole mesh under HSDP outer ``optim``; none under ``no_shard``), into one buffer
    allocated once and reused: a gather region and an assembly region of at most
    ``bucket_size_mb`` each. A parameter larger than the bucket is gathered alone and the
    buffer grows to fit it. Values are the main weights (fp32 when a separate main buffer
    exists): FP8 parameters in their full-precision form, tensor-parallel parameters in their
    global form (one extra TP all-gather each, into a fresh tensor of the global size). A model
    built on the meta device is materialized first.

    **Yielded tensors are views of the reused buffer**: valid until the iterator is advanced
    again; copy (``t.clone()``, ``t.to("cpu")``, send it) before asking for the next one. They
    are read-only in spirit: writing into them does not change the model. Buffers and other
    state-dict entries ``fully_shard`` does not manage are yielded as ``model.state_dict()``
    holds them (plain tensors detached, views of the model's own; other DTensors through their
    own ``full_tensor()``).

    ``to_rank``: ``None`` (every rank yields every entry) or a global rank of the model's mesh,
    the only rank that yields; the others yield nothing but take part in every gather, so they
    must iterate too (``for _ in it: pass``, or ``list(it)``).

    **Every rank must iterate to the end**, with the same ``bucket_size_mb`` and ``to_rank``
    (checked: a mismatch raises ``ValueError`` on every rank before the first gather). A rank
    whose iterator is closed early (``break`` or an exception out of a ``for`` loop over it,
    ``close()``, its garbage collection) runs the remaining gathers without yielding, so the
    others finish
    with the right values; a rank that keeps the iterator and stops calling ``next`` makes the
    others raise a ``RuntimeError`` naming it at the next bucket, after the group's collective
    timeout (``fully_shard``'s ``timeout``; ``MFSDP_ARRIVAL_TIMEOUT_S``). Arguments are checked
    when this is called (``TypeError``/``ValueError``, no collective); the collectives start
    with the first ``next``.

    Call it outside forward and backward. See [Note: streaming full weights] in
    ``checkpoint/_streaming.py``.
    """
    bucket_bytes = _check_arguments(model, bucket_size_mb, to_rank)
    return _stream(model, bucket_bytes, to_rank)


@torch.no_grad()
def _stream(model: nn.Module, bucket_bytes: int, to_rank: int | None
            ) -> Iterator[tuple[str, Any]]:
    process_group = _process_group.model_process_group(model)
    _check_to_rank(to_rank, process_group)
    await_every_rank(_CALL, process_group)
    agreed = _process_group.all_gather((bucket_bytes, to_rank), process_group)
    if any(a != agreed[0] for a in agreed):
        raise ValueError(
            "iter_full_weights: every rank must pass the same bucket_size_mb and to_rank; got "
            f"(bucket bytes, to_rank) = {agreed} in rank order"
        )
    keep = to_rank is None or not dist.is_initialized() or dist.get_rank() == to_rank
    materialize(model)  # a model built on the meta device: values first (no collective)
    managed = _registry.managed_dist_params(model)
    entries = list(model.state_dict().items())
    where, buckets = _plan_buckets(entries, managed, bucket_bytes)
    buffers = {d: _Buffer(buckets, d, keep) for d in {b.device for b in buckets}}
    current, assembly = -1, None
    closed = False  # the consumer stopped early: finish the collectives without yielding
    for name, value in entries:
        param = managed.get(name)
        if param is not None:
            b = where[name]
            bucket = buckets[b]
            if b != current:
                current = b
                assembly = _gather(bucket, buffers[bucket.device],
                                   assemble=keep and not closed or bucket.has_tp)
            member = bucket.members[id(param)]
            if assembly is None:
                continue
            face = member.group.tp_faces[member.index]
            if not (keep and not closed) and face is None:
                continue
            value = _full_value(member, assembly)  # the TP all-gather runs on every TP rank
        elif isinstance(value, DTensor):
            value = value.full_tensor()  # not ours: its own gather, every rank in this order
        elif isinstance(value, torch.Tensor):
            value = value.detach()
        if keep and not closed:
            try:
                yield name, value
            except GeneratorExit:
                closed = True
