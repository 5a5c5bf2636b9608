"""Whole matrices for optimizers that need them: each 2-D parameter gets one owner rank, its
pieces go to the owner and the owner's result comes back, with one all-to-all each way per process
group (see [Note: whole-matrix exchange]).

[Note: whole-matrix exchange]
A matrix optimizer (Muon's Newton-Schulz orthogonalization, a Shampoo-style preconditioner)
must see each 2-D parameter whole, while under every sharded strategy a rank holds only some
rows of it (``Shard(0)``: uneven, whole rows, see [Note: row-aligned flat buffers]), and under
FSDP x TP only its dp rows of its TP shard. :class:`WholeMatrices` plans, once per set of
parameters:

* **where the pieces are**: for each matrix, the block (rows and columns of the global
  matrix) every rank of its exchange group holds. A parameter that is not tensor-parallel is
  exchanged over the process group its rows are split over (the shard axis: HSDP's replicas
  each exchange inside their own replica; the whole mesh under outer ``optim``, whose sub-shards
  span it), its blocks whole rows read from the group's layout, the same on every rank, so no
  collective plans them; replicated (``no_shard``) it is whole on every rank. A tensor-parallel
  parameter is exchanged over its whole dp x TP mesh, its block its dp rows of its TP shard at
  the offset torch's ``Shard`` gives that shard; other TP ranks lay out other TP-local shapes,
  so these blocks are gathered once (one small all-gather per mesh, at planning).
* **who computes each matrix**: a matrix no rank holds in part is computed where it is held
  whole (one rank, or every replica) and needs no exchange. Each of the others, largest cost
  first (Newton-Schulz FLOPs by default), goes to the least-loaded rank (ties: the rank holding
  more of it, then the lower rank). Deterministic: every rank derives the same owners.
* **the exchange**: :meth:`WholeMatrices.to_owners` sends every rank's block of each matrix
  it does not own to the owner, all matrices of one process group in one ``all_to_all_single``
  with uneven splits; :meth:`WholeMatrices.from_owners` sends the owners' results back the
  same way. Each piece carries one extra element, a flag saying whether the sender has a value
  for that matrix (a gradient: ``None`` on a rank that did not use a parameter), so an owner
  knows whether any rank had one and every rank learns the answer with the result. A process
  group where no matrix is held in part issues nothing.

The pieces travel in the dtype the caller names (Muon: bfloat16, the dtype its Newton-Schulz
casts to first, so the owner's input is bit-identical to what one process computes from the
full fp32 matrix, at half the bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from .. import _registry
from .._buffers._plan import Extent
from .._comm._backends import group_timeout
from .._comm._collectives import all_to_all_uneven
from .._comm._process_groups import whole_mesh_process_group
from ._param_record import ParamRecord

__all__ = ["WholeMatrices", "local_tensor", "newton_schulz_flops"]

Block = tuple[int, int, int, int]


def newton_schulz_flops(shape: torch.Size, steps: int = 5) -> float:
    """FLOPs of ``steps`` quintic Newton-Schulz iterations on a matrix of ``shape`` (torch's
    Muon: a Gram matrix, its polynomial, and the update, on the short side)."""
    short, long = sorted(shape[:2])
    return float(steps * (4 * short * short * long + 2 * short**3))


@dataclass
class _Matrix:
    index: int  # in the caller's sequence
    shape: torch.Size
    # Per rank of the exchange group: the block of the matrix it holds, (row start, row end,
    # column start, column end); its local tensor is that block, row-major.
    blocks: list[Block]
    owner: int = 0
    exchanged: bool = False  # some of its pieces sit off the owner

    def numel_on(self, rank: int) -> int:
        r0, r1, c0, c1 = self.blocks[rank]
        return (r1 - r0) * (c1 - c0)

    def whole_on(self, rank: int) -> bool:
        return self.blocks[rank] == (0, self.shape[0], 0, self.shape[1])

    def block_of(self, matrix: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s block of a whole ``matrix`` (a view)."""
        r0, r1, c0, c1 = self.blocks[rank]
        return matrix[r0:r1, c0:c1]


@dataclass
class _Exchange:
    """The matrices exchanged over one process group, and the splits of its two all-to-alls."""

    process_group: dist.ProcessGroup
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


def _row_span(record: ParamRecord, slot: int) -> tuple[int, int]:
    """The dim-0 rows of ``record``'s (TP-local) parameter in layout slot ``slot``."""
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


def _layout_blocks(record: ParamRecord) -> tuple[dist.ProcessGroup, list[Block]]:
    """The exchange group of a parameter that is not tensor-parallel, and every rank's block,
    from the layout (the same on every rank: no collective)."""
    shape, group = record.item.shape, record.group
    placement = group.plan.optimizer_placement
    if placement is Extent.FULL:  # replicated: whole everywhere
        process_group = group.process_group
        return process_group, [(0, shape[0], 0, shape[1])] * dist.get_world_size(process_group)
    process_group = group.axis_process_groups["mesh"] if placement is Extent.SUB_SHARD \
        else group.process_group
    blocks = [(*_row_span(record, slot), 0, shape[1])
              for slot in _slots_of_group_ranks(record, process_group)]
    return process_group, blocks


def _tp_block(record: ParamRecord) -> Block:
    """This rank's block of a tensor-parallel parameter: its dp rows of the TP-local tensor,
    placed where torch's ``Shard`` puts that tensor in the global one."""
    face = record.tp
    assert face is not None
    start = [0, 0]
    local_shape = list(face.shape)
    if face.tp_mesh is not None:
        for mesh_dim, placement in enumerate(face.tp_placements):
            if isinstance(placement, Shard):
                d, k = placement.dim, face.tp_mesh.size(mesh_dim)
                chunk = -(-local_shape[d] // k)  # torch.chunk's
                offset = min(face.tp_mesh.get_local_rank(mesh_dim) * chunk, local_shape[d])
                start[d] += offset
                local_shape[d] = max(0, min(local_shape[d] - offset, chunk))
    r0, r1 = record.local_rows
    return (start[0] + r0, start[0] + r1, start[1], start[1] + local_shape[1])


def _tp_blocks(records: list[tuple[int, ParamRecord]]
               ) -> dict[int, tuple[dist.ProcessGroup, list[Block]]]:
    """Tensor-parallel parameters: the group over their whole dp x TP mesh and every rank's
    block, gathered (one all-gather of small lists per mesh: blocks of other TP ranks depend
    on their TP-local shapes, which this rank does not lay out)."""
    by_mesh: dict[int, list[tuple[int, ParamRecord]]] = {}
    for i, record in records:
        assert record.tp is not None
        by_mesh.setdefault(id(record.tp.dist_mesh), []).append((i, record))
    found: dict[int, tuple[dist.ProcessGroup, list[Block]]] = {}
    for members in by_mesh.values():
        first = members[0][1]
        assert first.tp is not None
        process_group = whole_mesh_process_group(first.tp.dist_mesh,
                                                 group_timeout(first.group.process_group))
        mine = [_tp_block(record) for _, record in members]
        everyone: list[list[Block] | None] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(everyone, mine, group=process_group)
        for k, (i, _) in enumerate(members):
            found[i] = (process_group, [tuple(blocks[k]) for blocks in everyone])  # type: ignore[index]
    return found


class WholeMatrices:
    """Owners and exchanges for whole 2-D parameters managed by ``fully_shard`` (see
    [Note: whole-matrix exchange]).

    Args:
        params: the optimizer-facing parameters (``model.parameters()`` after wrapping), each
            2-D and managed by a ``fully_shard`` unit; the same list, in the same order, on
            every rank.
        cost: the work of one matrix, from its shape, for balancing the owners (default:
            :func:`newton_schulz_flops`).
        per_tp_shard: per parameter, for tensor-parallel ones: True makes the matrix each TP
            rank's own shard (its TP-local tensor, gathered over the data-parallel ranks only;
            Megatron's per-shard ``tp_mode``); False (default), the whole global matrix.

    :attr:`owned` lists the indices (into ``params``) whose whole matrix this rank receives
    from :meth:`to_owners` and must return a result for in :meth:`from_owners`. Every rank
    calls both methods, in the same order (they are collectives over the parameters' process
    groups).
    """

    def __init__(
        self, params: Sequence[torch.Tensor], *,
        cost: Callable[[torch.Size], float] | None = None,
        per_tp_shard: Sequence[bool] | None = None,
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
            records.append(record)
        self.params = list(params)
        # Per TP shard: the matrix is this rank's TP-local tensor, exchanged over dp only.
        self.per_tp_shard = [bool(per_tp_shard[i]) if per_tp_shard is not None else False
                             for i in range(len(records))]
        tp = _tp_blocks([(i, r) for i, r in enumerate(records)
                         if r.tp is not None and not self.per_tp_shard[i]])
        self._exchanges: list[_Exchange] = []
        by_process_group: dict[int, _Exchange] = {}
        for i, record in enumerate(records):
            process_group, blocks = tp[i] if i in tp else _layout_blocks(record)
            if id(process_group) not in by_process_group:
                by_process_group[id(process_group)] = _Exchange(
                    process_group, dist.get_rank(process_group),
                    dist.get_world_size(process_group))
                self._exchanges.append(by_process_group[id(process_group)])
            exchange = by_process_group[id(process_group)]
            shape = record.item.shape if self.per_tp_shard[i] else self.params[i].shape
            held = blocks[exchange.rank]
            if (held[1] - held[0], held[3] - held[2]) != tuple(local_tensor(self.params[i]).shape):
                raise AssertionError(  # the layout math and the local tensor disagree
                    f"'{record.fqn}': block {held} from the layout, local shape "
                    f"{tuple(local_tensor(self.params[i]).shape)}"
                )
            exchange.matrices.append(_Matrix(i, shape, blocks))
        for exchange in self._exchanges:
            _assign_owners(exchange, cost)
            _splits(exchange)
        self.owned: tuple[int, ...] = tuple(
            m.index for e in self._exchanges for m in e.matrices if _computes(m, e.rank)
        )
        self.collectives_issued = 0  # all-to-alls run by to_owners and from_owners
        self.bytes_sent = 0  # by this rank, both directions

    @property
    def exchanged(self) -> tuple[int, ...]:
        """Indices of the matrices held in part by some rank (the others need no collective)."""
        return tuple(m.index for e in self._exchanges for m in e.matrices if m.exchanged)

    def step_collectives(self, dtype: torch.dtype) -> tuple[int, int]:
        """The all-to-alls of one :meth:`to_owners` + :meth:`from_owners` pair and the bytes
        this rank sends in them with ``dtype`` on the wire (the estimator's count)."""
        issuing = [e for e in self._exchanges if e.issues]
        sent = sum(sum(e.send_splits) + sum(e.recv_splits) for e in issuing)
        return 2 * len(issuing), sent * dtype.itemsize

    def owner_of(self, index: int) -> tuple[dist.ProcessGroup, int | None]:
        """The process group matrix ``index`` is exchanged over and the rank of it that
        computes its result (``None``: every rank holding it whole computes it there)."""
        for e in self._exchanges:
            for m in e.matrices:
                if m.index == index:
                    return e.process_group, m.owner if m.exchanged else None
        raise IndexError(index)

    def to_owners(
        self, local_pieces: Sequence[torch.Tensor], *, present: Sequence[bool] | None = None,
        dtype: torch.dtype | None = None,
    ) -> dict[int, torch.Tensor | None]:
        """Each owned matrix, whole, from every rank's ``local_pieces[i]`` (this rank's piece of
        matrix ``i``, plain or the DTensor's local tensor: what the parameter's local tensor
        holds, shaped as it).

        ``present[i]`` False: this rank has no value for matrix ``i`` (its piece is sent all
        the same, the caller's stand-in). The result for an owned matrix that no rank had a
        value for is ``None``. ``dtype``: what travels and what the owner gets (default: each
        piece's own; a matrix whole here is returned as given when the dtypes match).
        """
        present = [True] * len(self.params) if present is None else list(present)
        wholes: dict[int, torch.Tensor | None] = {}
        for e in self._exchanges:
            for m in e.matrices:
                if not m.exchanged and m.whole_on(e.rank):
                    piece = local_tensor(local_pieces[m.index])
                    whole = piece if dtype is None else piece.to(dtype)
                    wholes[m.index] = whole if present[m.index] else None
            if not e.issues:
                continue
            first = local_tensor(local_pieces[e.matrices[0].index])
            wire, device = dtype or first.dtype, first.device
            e.wire_dtype = wire
            send = torch.empty(sum(e.send_splits), dtype=wire, device=device)
            for m, offset in e.out_pieces:
                n = m.numel_on(e.rank)
                piece = local_tensor(local_pieces[m.index])
                send[offset + 1 : offset + 1 + n].copy_(piece.reshape(-1))
            _write_flags(send, [offset for _, offset in e.out_pieces],
                         [present[m.index] for m, _ in e.out_pieces])
            received = self._all_to_all(e, send, e.recv_splits, e.send_splits)
            owned = [m for m in e.matrices if m.owner == e.rank and m.exchanged]
            whole_of = {m.index: torch.empty(m.shape, dtype=wire, device=device) for m in owned}
            for m in owned:
                m.block_of(whole_of[m.index], e.rank).copy_(local_tensor(local_pieces[m.index]))
            for m, source, offset in e.in_pieces:
                block = m.block_of(whole_of[m.index], source)
                block.copy_(received[offset + 1 : offset + 1 + m.numel_on(source)].view(
                    block.shape))
            anyone = {m.index: present[m.index] for m in owned}
            for (m, _, _), flag in zip(e.in_pieces, _read_flags(received, e.in_pieces)):
                anyone[m.index] = anyone[m.index] or flag
            for m in owned:
                wholes[m.index] = whole_of[m.index] if anyone[m.index] else None
        return wholes

    def from_owners(
        self, results: Mapping[int, torch.Tensor | None], *, dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor | None]:
        """This rank's piece of every matrix's result (``None`` where the owner had none, on
        every rank), from the owners' ``results`` (whole, keyed by index; every owned index).
        ``dtype``: what travels (default: what :meth:`to_owners` sent last, else the
        parameters' dtype; the same on every rank)."""
        out: list[torch.Tensor | None] = [None] * len(self.params)
        for e in self._exchanges:
            for m in e.matrices:
                result = results[m.index] if _computes(m, e.rank) else None
                if result is not None:
                    out[m.index] = m.block_of(result, e.rank)
            if not e.issues:
                continue
            # Every rank must put the same dtype on the wire, owners of nothing included.
            wire = dtype or e.wire_dtype or local_tensor(self.params[e.matrices[0].index]).dtype
            device = local_tensor(self.params[e.matrices[0].index]).device
            # to_owners mirrored: the pieces that came in go back, at the same offsets.
            send = torch.empty(sum(e.recv_splits), dtype=wire, device=device)
            for m, dest, offset in e.in_pieces:
                result = results[m.index]
                if result is not None:
                    block = m.block_of(result, dest)
                    send[offset + 1 : offset + 1 + m.numel_on(dest)].view(
                        block.shape).copy_(block)
            _write_flags(send, [offset for _, _, offset in e.in_pieces],
                         [results[m.index] is not None for m, _, _ in e.in_pieces])
            received = self._all_to_all(e, send, e.send_splits, e.recv_splits)
            flags = _read_flags(received, e.out_pieces)
            for (m, offset), flag in zip(e.out_pieces, flags):
                if flag:
                    r0, r1, c0, c1 = m.blocks[e.rank]
                    out[m.index] = received[offset + 1 : offset + 1 + m.numel_on(e.rank)].view(
                        r1 - r0, c1 - c0)
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


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (this rank's piece), a plain tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _computes(m: _Matrix, rank: int) -> bool:
    """Whether ``rank`` computes matrix ``m``'s result: its owner, or, for a matrix no rank
    holds in part, every rank that holds it whole."""
    return m.owner == rank if m.exchanged else m.whole_on(rank)


def _assign_owners(exchange: _Exchange, cost: Callable[[torch.Size], float]) -> None:
    load = [0.0] * exchange.world
    spread = []
    for m in exchange.matrices:
        partial = [r for r in range(exchange.world)
                   if m.numel_on(r) > 0 and not m.whole_on(r)]
        if partial:
            spread.append(m)
            continue
        for r in range(exchange.world):  # whole where held (one rank, or every replica)
            if m.whole_on(r):
                load[r] += cost(m.shape)
    # Largest first; the order of equal costs is the caller's (stable sort): deterministic.
    for m in sorted(spread, key=lambda m: -cost(m.shape)):
        m.owner = min(range(exchange.world), key=lambda r: (load[r], -m.numel_on(r), r))
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
