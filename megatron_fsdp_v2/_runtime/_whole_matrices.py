"""Whole matrices for optimizers that need them: each 2-D parameter gets one owner rank, its rows
go to the owner and the owner's result comes back, with one all-to-all each way per process
group (see [Note: whole-matrix exchange]).

[Note: whole-matrix exchange]
A matrix optimizer (Muon's Newton-Schulz orthogonalization, a Shampoo-style preconditioner)
must see each 2-D parameter whole, while under every sharded strategy a rank holds only some
rows of it (``Shard(0)``: uneven, whole rows, see [Note: row-aligned flat buffers]).
:class:`WholeMatrices` plans, once per set of parameters:

* **where the rows are**: for each matrix, the dim-0 rows every rank of the group's process
  group holds, read from the group's layout (the same on every rank, so every rank computes
  the same plan with no collective). The exchange runs over the process group the rows are
  split over: the shard axis (HSDP's replicas each exchange inside their own replica), or the
  whole mesh under outer ``optim`` (sub-shards). Replicated parameters (``no_shard``) are
  whole on every rank: each rank computes its own result, with no exchange, as one process.
* **who owns each matrix**: a matrix all of whose rows sit on one rank is owned by that rank
  and needs no exchange. The others, largest cost first (Newton-Schulz FLOPs by default), go
  to the least-loaded rank (ties: the rank holding more of its rows, then the lower rank).
  Deterministic: every rank derives the same owners from the same shapes and layouts.
* **the exchange**: :meth:`WholeMatrices.to_owners` sends every rank's rows of each matrix it
  does not own to the owner, all matrices of one process group in one ``all_to_all_single``
  with uneven splits; :meth:`WholeMatrices.from_owners` sends the owners' results back the
  same way. Each piece carries one extra element, a flag saying whether the sender has a value
  for that matrix (a gradient: ``None`` on a rank that did not use a parameter), so an owner
  knows whether any rank had one and every rank learns the answer with the result. A process
  group where every matrix is whole on its owner issues nothing.

The pieces travel in the dtype the caller names (Muon: bfloat16, the dtype its Newton-Schulz
casts to first, so the owner's input is bit-identical to what one process computes from the
full fp32 matrix, at half the bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import _registry
from .._buffers._plan import Extent
from .._comm._collectives import all_to_all_uneven
from ._param_record import ParamRecord

__all__ = ["WholeMatrices", "newton_schulz_flops"]

Rows = tuple[int, int]


def newton_schulz_flops(shape: torch.Size, steps: int = 5) -> float:
    """FLOPs of ``steps`` quintic Newton-Schulz iterations on a matrix of ``shape`` (torch's
    Muon: a Gram matrix, its polynomial, and the update, on the short side)."""
    short, long = sorted(shape[:2])
    return float(steps * (4 * short * short * long + 2 * short**3))


@dataclass
class _Matrix:
    index: int  # in the caller's sequence
    shape: torch.Size
    rows: list[Rows]  # per rank of the exchange group: [start, end) dim-0 rows it holds
    owner: int = 0
    exchanged: bool = False  # some of its rows sit off the owner

    def numel_on(self, rank: int) -> int:
        start, end = self.rows[rank]
        return (end - start) * self.shape[1]


@dataclass
class _Exchange:
    """The matrices whose rows are split over one process group, and the splits of its two
    all-to-alls."""

    process_group: dist.ProcessGroup | None  # None: replicated (whole on every rank)
    rank: int
    world: int
    matrices: list[_Matrix] = field(default_factory=list)
    # to_owners: elements this rank sends to / receives from each rank (flags included)
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    # to_owners' pieces: (matrix, offset in the send buffer), owner rank then matrix order;
    # (matrix, source rank, offset in the receive buffer), source rank then matrix order.
    # from_owners sends back at the receive offsets and receives at the send offsets.
    out_pieces: list[tuple[_Matrix, int]] = field(default_factory=list)
    wire_dtype: torch.dtype | None = None  # of the last to_owners: from_owners' default
    in_pieces: list[tuple[_Matrix, int, int]] = field(default_factory=list)

    @property
    def issues(self) -> bool:
        return any(m.exchanged for m in self.matrices)


def _row_span(record: ParamRecord, slot: int) -> Rows:
    """The dim-0 rows of ``record``'s parameter in layout slot ``slot``."""
    layout, item = record.group.layout, record.item
    lo, hi = layout.local_item_range(record.index, *layout.shard_range(slot))
    start = min(max(lo - item.offset, 0), item.numel) // item.row_numel
    return start, start + (hi - lo) // item.row_numel


def _slots_of_group_ranks(record: ParamRecord, process_group: dist.ProcessGroup) -> list[int]:
    """For each rank of ``process_group``, the layout slot whose rows it holds."""
    group = record.group
    world = dist.get_world_size(process_group)
    if record.group.plan.optimizer_placement is Extent.SHARD:
        return list(range(world))  # the inner axis: group rank r holds slot r
    # Outer optim: sub-shard i * R + o is held by the rank at (outer o, inner i) of the mesh.
    mesh = group.mesh.mesh
    replicas = mesh.shape[0]
    coords = {int(g): (o, i) for (o, i), g in
              ((divmod(k, mesh.shape[1]), g) for k, g in enumerate(mesh.flatten().tolist()))}
    slots = []
    for r in range(world):
        o, i = coords[dist.get_global_rank(process_group, r)]
        slots.append(i * replicas + o)
    return slots


def _exchange_group(record: ParamRecord) -> dist.ProcessGroup | None:
    placement = record.group.plan.optimizer_placement
    if placement is Extent.FULL:
        return None
    if placement is Extent.SUB_SHARD:
        return record.group.axis_groups["mesh"]
    return record.group.process_group


class WholeMatrices:
    """Owners and exchanges for whole 2-D parameters managed by ``fully_shard`` (see
    [Note: whole-matrix exchange]).

    Args:
        params: the optimizer-facing parameters (``model.parameters()`` after wrapping), each
            2-D and managed by a ``fully_shard`` unit; the same list, in the same order, on
            every rank.
        cost: the work of one matrix, from its shape, for balancing the owners (default:
            :func:`newton_schulz_flops`).

    :attr:`owned` lists the indices (into ``params``) whose whole matrix this rank receives
    from :meth:`to_owners` and must return a result for in :meth:`from_owners`. Every rank
    calls both methods, in the same order (they are collectives over the parameters' process
    groups).
    """

    def __init__(
        self, params: Sequence[torch.Tensor], *,
        cost: Callable[[torch.Size], float] | None = None,
    ) -> None:
        cost = cost or newton_schulz_flops
        records = []
        for i, p in enumerate(params):
            record = _registry.record_of(p)
            if record is None or p is not record.dist_param:
                raise ValueError(
                    f"parameter {i} (shape {tuple(p.shape)}) is not an optimizer-facing "
                    "parameter of a fully_shard unit: pass model.parameters() after wrapping "
                    "(every matrix managed by fully_shard)"
                )
            if p.ndim != 2:
                raise ValueError(
                    f"parameter {i} ('{record.fqn}' of {record.group.owner}) has shape "
                    f"{tuple(p.shape)}: whole-matrix exchanges take 2-D parameters only"
                )
            if record.tp is not None:
                raise NotImplementedError(
                    f"parameter {i} ('{record.fqn}') is tensor-parallel: whole-matrix "
                    "exchanges of FSDP x TP parameters are not supported yet"
                )
            records.append(record)
        self.params = list(params)
        self._exchanges: list[_Exchange] = []
        by_group: dict[int, _Exchange] = {}
        for i, record in enumerate(records):
            process_group = _exchange_group(record)
            key = id(process_group)
            if key not in by_group:
                if process_group is None:
                    exchange = _Exchange(None, 0, 1)
                else:
                    exchange = _Exchange(process_group, dist.get_rank(process_group),
                                         dist.get_world_size(process_group))
                by_group[key] = exchange
                self._exchanges.append(exchange)
            exchange = by_group[key]
            shape = record.item.shape
            if process_group is None:
                rows = [(0, shape[0])]
            else:
                slots = _slots_of_group_ranks(record, process_group)
                rows = [_row_span(record, slot) for slot in slots]
                if rows[exchange.rank] != record.local_rows:
                    raise AssertionError(  # the layout math and the record disagree
                        f"'{record.fqn}': rows {rows[exchange.rank]} from the layout, "
                        f"{record.local_rows} held"
                    )
            exchange.matrices.append(_Matrix(i, shape, rows))
        for exchange in self._exchanges:
            _assign_owners(exchange, cost)
            _splits(exchange)
        self.owned: tuple[int, ...] = tuple(
            m.index for e in self._exchanges for m in e.matrices if m.owner == e.rank
        )
        self.collectives_issued = 0  # all-to-alls run by to_owners and from_owners
        self.bytes_sent = 0  # by this rank, both directions

    @property
    def exchanged(self) -> tuple[int, ...]:
        """Indices of the matrices whose rows cross ranks (the others need no collective)."""
        return tuple(m.index for e in self._exchanges for m in e.matrices if m.exchanged)

    def step_collectives(self, dtype: torch.dtype) -> tuple[int, int]:
        """The all-to-alls of one :meth:`to_owners` + :meth:`from_owners` pair and the bytes
        this rank sends in them with ``dtype`` on the wire (the estimator's count)."""
        issuing = [e for e in self._exchanges if e.issues]
        sent = sum(sum(e.send_splits) + sum(e.recv_splits) for e in issuing)
        return 2 * len(issuing), sent * dtype.itemsize

    def owner_of(self, index: int) -> tuple[dist.ProcessGroup | None, int]:
        """The process group and its rank that owns matrix ``index`` (None: replicated,
        every rank is its owner)."""
        for e in self._exchanges:
            for m in e.matrices:
                if m.index == index:
                    return e.process_group, m.owner
        raise IndexError(index)

    def to_owners(
        self, local_rows: Sequence[torch.Tensor], *, present: Sequence[bool] | None = None,
        dtype: torch.dtype | None = None,
    ) -> dict[int, torch.Tensor | None]:
        """Each owned matrix, whole, from every rank's ``local_rows[i]`` (this rank's rows of
        matrix ``i``, plain or the DTensor's local tensor, shaped ``(rows, columns)``).

        ``present[i]`` False: this rank has no value for matrix ``i`` (its rows are sent all
        the same, the caller's stand-in). The result for an owned matrix that no rank had a
        value for is ``None``. ``dtype``: what travels and what the owner gets (default: each
        piece's own; a matrix whole here is returned as given when the dtypes match).
        """
        present = [True] * len(self.params) if present is None else list(present)
        wholes: dict[int, torch.Tensor | None] = {}
        for e in self._exchanges:
            for m in e.matrices:
                if m.owner == e.rank and not m.exchanged:
                    piece = _local(local_rows[m.index])
                    whole = piece if dtype is None else piece.to(dtype)
                    wholes[m.index] = whole if present[m.index] else None
            if not e.issues:
                continue
            first = _local(local_rows[e.matrices[0].index])
            wire, device = dtype or first.dtype, first.device
            e.wire_dtype = wire
            send = torch.empty(sum(e.send_splits), dtype=wire, device=device)
            for m, offset in e.out_pieces:
                n = m.numel_on(e.rank)
                send[offset + 1 : offset + 1 + n].copy_(_local(local_rows[m.index]).reshape(-1))
            _write_flags(send, [offset for _, offset in e.out_pieces],
                         [present[m.index] for m, _ in e.out_pieces])
            received = self._all_to_all(e, send, e.recv_splits, e.send_splits)
            owned = [m for m in e.matrices if m.owner == e.rank and m.exchanged]
            whole_of = {m.index: torch.empty(m.shape, dtype=wire, device=device) for m in owned}
            for m in owned:
                start, end = m.rows[e.rank]
                whole_of[m.index][start:end].copy_(_local(local_rows[m.index]))
            for m, source, offset in e.in_pieces:
                start, end = m.rows[source]
                whole_of[m.index][start:end].copy_(
                    received[offset + 1 : offset + 1 + m.numel_on(source)].view(
                        end - start, m.shape[1]))
            anyone = {m.index: present[m.index] for m in owned}
            for (m, _, _), flag in zip(e.in_pieces, _read_flags(received, e.in_pieces)):
                anyone[m.index] = anyone[m.index] or flag
            for m in owned:
                wholes[m.index] = whole_of[m.index] if anyone[m.index] else None
        return wholes

    def from_owners(
        self, results: Mapping[int, torch.Tensor | None], *, dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor | None]:
        """This rank's rows of every matrix's result (``None`` where the owner had none, on
        every rank), from the owners' ``results`` (whole, keyed by index; every owned index).
        ``dtype``: what travels (default: what :meth:`to_owners` sent last, else the
        parameters' dtype; the same on every rank)."""
        out: list[torch.Tensor | None] = [None] * len(self.params)
        for e in self._exchanges:
            for m in e.matrices:
                result = results[m.index] if m.owner == e.rank else None
                if result is not None:
                    start, end = m.rows[e.rank]
                    out[m.index] = result[start:end]
            if not e.issues:
                continue
            # Every rank must put the same dtype on the wire, owners of nothing included.
            wire = dtype or e.wire_dtype or _local(self.params[e.matrices[0].index]).dtype
            device = _local(self.params[e.matrices[0].index]).device
            # to_owners mirrored: the pieces that came in go back, at the same offsets.
            send = torch.empty(sum(e.recv_splits), dtype=wire, device=device)
            for m, dest, offset in e.in_pieces:
                result = results[m.index]
                if result is not None:
                    start, end = m.rows[dest]
                    send[offset + 1 : offset + 1 + m.numel_on(dest)].view(
                        end - start, m.shape[1]).copy_(result[start:end])
            _write_flags(send, [offset for _, _, offset in e.in_pieces],
                         [results[m.index] is not None for m, _, _ in e.in_pieces])
            received = self._all_to_all(e, send, e.send_splits, e.recv_splits)
            flags = _read_flags(received, e.out_pieces)
            for (m, offset), flag in zip(e.out_pieces, flags):
                if flag:
                    start, end = m.rows[e.rank]
                    out[m.index] = received[offset + 1 : offset + 1 + m.numel_on(e.rank)].view(
                        end - start, m.shape[1])
        return out

    def _all_to_all(self, exchange: _Exchange, send: torch.Tensor, output_splits: list[int],
                    send_splits: list[int]) -> torch.Tensor:
        assert exchange.process_group is not None
        received = send.new_empty(sum(output_splits))
        all_to_all_uneven(received, send, output_splits, send_splits, exchange.process_group)
        self.collectives_issued += 1
        self.bytes_sent += send.nbytes
        return received


def _write_flags(buffer: torch.Tensor, offsets: list[int], flags: list[bool]) -> None:
    if offsets:  # one host-to-device copy for all of them
        index = torch.tensor(offsets, device=buffer.device)
        buffer.index_copy_(0, index, torch.tensor(flags, dtype=buffer.dtype, device=buffer.device))


def _read_flags(buffer: torch.Tensor, pieces: Sequence[tuple]) -> list[bool]:
    """The flags at each piece's offset (its last field), read back in one transfer."""
    if not pieces:
        return []
    index = torch.tensor([piece[-1] for piece in pieces], device=buffer.device)
    return [v != 0 for v in buffer.index_select(0, index).tolist()]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _assign_owners(exchange: _Exchange, cost: Callable[[torch.Size], float]) -> None:
    load = [0.0] * exchange.world
    spread = []
    for m in exchange.matrices:
        holders = [r for r in range(exchange.world) if m.rows[r][1] > m.rows[r][0]]
        if exchange.process_group is None:
            m.owner = exchange.rank  # replicated: whole everywhere
        elif len(holders) <= 1:
            m.owner = holders[0] if holders else 0
            load[m.owner] += cost(m.shape)
        else:
            spread.append(m)
    # Largest first; the order of equal costs is the caller's (stable sort): deterministic.
    for m in sorted(spread, key=lambda m: -cost(m.shape)):
        m.owner = min(range(exchange.world),
                      key=lambda r: (load[r], -(m.rows[r][1] - m.rows[r][0]), r))
        m.exchanged = True
        load[m.owner] += cost(m.shape)


def _splits(exchange: _Exchange) -> None:
    """The pieces of the to_owners all-to-all (one flag element, then the rows) and where each
    sits: sent in (owner rank, matrix) order, received in (source rank, matrix) order."""
    e = exchange
    e.send_splits = [0] * e.world
    e.recv_splits = [0] * e.world
    offset = 0
    for dest in range(e.world):
        for m in e.matrices:
            if m.exchanged and m.owner == dest and dest != e.rank:
                e.out_pieces.append((m, offset))
                e.send_splits[dest] += 1 + m.numel_on(e.rank)
                offset += 1 + m.numel_on(e.rank)
    offset = 0
    for source in range(e.world):
        for m in e.matrices:
            if m.exchanged and m.owner == e.rank and source != e.rank:
                e.in_pieces.append((m, source, offset))
                e.recv_splits[source] += 1 + m.numel_on(source)
                offset += 1 + m.numel_on(source)
