"""Shard layouts measured: one all-gather + reduce-scatter round per unit, in three layouts.

    python benchmarks/bench_layouts.py --quick                   # < 1 min: small GPT, 4 gloo ranks
    python benchmarks/bench_layouts.py --model-size small,medium --rounds 15 --repeats 3
    python benchmarks/bench_layouts.py --scale                   # Llama-3 8B/70B arithmetic only
    python benchmarks/bench_layouts.py --device cuda --world 8 --model-size medium,large \
        --rounds 30 --repeats 3                                  # NCCL, one GPU per rank

The layouts (one parameter group per GPT block and one for the root, as ``fully_shard`` per
block then the root makes them; ``megatron_fsdp_v2._buffers._layout`` splits a group further
when its row sizes would pad it by more than 1%):

* **(a) rows** (today's): each group is one row-aligned flat buffer from the library's own
  ``split_for_padding`` / ``build_layout``; rank ``r`` owns ``[r * shard, (r + 1) * shard)``.
  One ``all_gather_into_tensor`` from the rank's shard into the unsharded buffer, whose views
  are the compute parameters; one ``reduce_scatter_tensor`` of the unsharded gradient buffer
  (which autograd writes in place through preset ``.grad`` aliases on the ``optim_grads`` path)
  into the gradient shard. No copy. ``(a) staged``: the same, with the per-parameter gradients
  first packed into the buffer (the ZeRO-3 ``optim_grads_params`` path stages, see
  ``[Note: gradients in place]``): one copy of the gradients.
* **(b) FSDP2's**: each parameter cut at ``torch.chunk`` rows, padded to ``ceil(rows / W)`` rows
  per rank, rank-major buffers. All-gather: copy-in of the rank's padded shards into its slot of
  the all-gather buffer (``torch._foreach_copy_``, what ``torch.ops.fsdp.all_gather_copy_in``
  runs), one in-place ``all_gather_into_tensor``, copy-out of every rank's piece of every
  parameter into the padded unsharded parameters (``torch.split_with_sizes_copy``, FSDP2's
  ``foreach_all_gather_copy_out``). Reduce-scatter: copy-in of every parameter's gradient, cut
  at ``torch.chunk`` rows and zero-padded, into rank-major order (``torch._chunk_cat``, FSDP2's
  ``foreach_reduce``), one ``reduce_scatter_tensor``; the rank's shards are views of its output.
* **(c) chunk rows, parameter-major**: each parameter cut at ``torch.chunk`` rows and padded to
  ``W * ceil(rows / W)`` rows inside one flat buffer per group, parameter after parameter (each
  region 16-element aligned), so rank ``r``'s shard of a parameter is its ``torch.chunk`` piece
  and every collective input and output is a view: one ``all_gather_into_tensor`` and one
  ``reduce_scatter_tensor`` per parameter, issued together in one
  ``torch.distributed._coalescing_manager`` (torch 2.14's coalescing of these two ops: one
  ``all_gather_single_coalesced`` / ``reduce_scatter_single_coalesced`` call per group).
  Compute weights and gradients are views of the unsharded buffers, as in (a); ``(c) staged``
  packs the gradients as ``(a) staged`` does.

What the table reports per layout (per rank, per round over all groups): bytes one rank sends
(ring algorithms, ``(W-1)/W`` of each collective's full buffer: what NCCL sends; gloo's
reduce-scatter is an all-reduce, see below), padding (elements beyond the parameters, absolute
and in % of them), collective launches (Python-level calls; (c): one per group, each carrying
one collective per parameter), bytes written by the layout's copies, the bytes of every buffer
one unit's round uses (unsharded and rank-major buffers, per-parameter gradients where the layout
has them, shards; the largest unit: units run one after another), and the median round time
(slowest rank, ``--rounds`` rounds after one warm-up, the layouts interleaved in alternating
order) with its ratio to (a). With ``--repeats R`` the whole measurement runs R
times in fresh process groups; the table shows the median of the R medians and their range.

Every round's inputs are deterministic integer-valued floats (so sums are exact in any order),
and each layout's result is checked after its warm-up and after its last timed round: every
gathered parameter equals the original bit for bit, every reduce-scattered shard equals the sum
of all ranks' gradients on this rank's rows (its ``torch.chunk`` piece for (b)/(c), its layout
rows for (a)); a mismatch raises, so a wrong implementation is never timed.

Gloo (this repository's CPU runs) implements ``reduce_scatter_tensor`` (coalesced or not) as a
clone of the input, an all-reduce per tensor and a copy-out of the rank's chunk, and the
coalesced all-gather as one ``gloo::allgather`` of the flattened inputs plus a copy-out per
tensor (``ProcessGroupGloo.cpp``), so on gloo coalescing saves Python launches and, for the
all-gather, per-call synchronization, but not copies; NCCL's coalesced calls are one group
launch with no copies. ``--scale`` needs no process group: it computes the padding of every
layout and (b)'s copy bytes for Llama-3 8B and 70B shapes at 8 to 1536 ranks, and what the
library's estimator (``megatron_fsdp_v2.estimator.estimate``, run on the same shapes) gives for
(a): memory per rank and bytes per step.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "examples"))
sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# The ranks import torch only (the library is imported lazily, by the parent, for (a)'s plans):
# on a loaded 2-core machine each import of the package costs seconds per spawned rank.
ALIGN_NUMEL = 16  # megatron_fsdp_v2._buffers._layout.ALIGN_NUMEL (the unit test checks it)

# torch 2.14 renamed the flat-tensor collectives (the old names warn); the coalescing manager
# records the new names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

MiB = 1 << 20
LAYOUTS = ("a", "a_staged", "b", "c", "c_staged")
# Not in the default set: (c) with its per-parameter collectives issued one by one
# (async_op=True, waited together) instead of coalesced: what the coalescing manager buys.
EXTRA_LAYOUTS = ("c_uncoalesced",)
LABELS = {
    "a": "(a) rows, in place",
    "a_staged": "(a) rows, grads staged",
    "b": "(b) FSDP2 copy-in/out",
    "c": "(c) chunk rows, param-major",
    "c_staged": "(c) chunk rows, grads staged",
    "c_uncoalesced": "(c) not coalesced",
}
QUICK = dict(model_size="small", rounds=3, repeats=1)


def _align_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# ----------------------------------------------------------------------------- shapes

@dataclass(frozen=True)
class Group:
    """One unit's parameters, in ``named_parameters`` order (what ``fully_shard`` sees)."""

    name: str
    shapes: tuple[torch.Size, ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def gpt_groups(model_size: str, vocab: int = 8192, seq_len: int = 128) -> list[Group]:
    """The groups of ``bench_training.py``'s GPT (``examples/model.py``) at ``model_size``:
    one per block, then the root's remaining parameters (the head is tied to the embedding)."""
    from bench_training import MODEL_SIZES

    from model import GPT, GPTConfig

    dim, layers, heads = MODEL_SIZES[model_size]
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=vocab, seq_len=seq_len, dim=dim, layers=layers, heads=heads))
    groups = [Group(f"blocks.{i}", tuple(p.shape for p in block.parameters()))
              for i, block in enumerate(model.blocks)]
    in_blocks = {id(p) for p in model.blocks.parameters()}
    groups.append(Group("root", tuple(p.shape for p in model.parameters()
                                      if id(p) not in in_blocks)))
    return groups


def llama_groups(layers: int, dim: int, ffn: int, vocab: int, heads: int,
                 kv_heads: int) -> list[Group]:
    """Llama-3-style groups (the estimator's ``LlamaDecoder`` preset): one per block, the root
    (embedding, final norm, untied head). Shapes only; nothing is allocated."""
    from megatron_fsdp_v2.estimator._presets import LlamaBlock

    with torch.device("meta"):
        block = LlamaBlock(dim, ffn, heads, kv_heads)
    block_shapes = tuple(p.shape for p in block.parameters())
    root = (torch.Size([vocab, dim]), torch.Size([dim]), torch.Size([vocab, dim]))
    return [Group(f"blocks.{i}", block_shapes) for i in range(layers)] + [Group("root", root)]


# ----------------------------------------------------------------------------- plans

def row_numel(shape: Sequence[int]) -> int:
    """Elements per dim-0 row (1 for 1-D), as the library counts them."""
    return max(math.prod(shape[1:]), 1) if len(shape) > 1 else 1


@dataclass(frozen=True)
class RowsPart:
    """(a): one flat buffer of a group as the library lays it out (``split_for_padding`` may
    make several per unit): its parameters' indices in the group and their offsets."""

    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    shard_numel: int
    world: int

    @property
    def total_numel(self) -> int:
        return self.world * self.shard_numel


def rows_plan(shapes: Sequence[torch.Size], world: int) -> list[RowsPart]:
    """The library's own layout of one unit's parameters (``split_for_padding`` then
    ``build_layout`` per part, as ``fully_shard`` runs them)."""
    from megatron_fsdp_v2._buffers._layout import build_layout, split_for_padding

    parts = []
    for part in split_for_padding(shapes, world):
        lay = build_layout([shapes[i] for i in part], world)
        parts.append(RowsPart(tuple(part), tuple(it.offset for it in lay.items),
                              lay.shard_numel, world))
    return parts


def rows_padding(parts: Sequence[RowsPart], shapes: Sequence[torch.Size]) -> int:
    return sum(p.total_numel for p in parts) - sum(math.prod(s) for s in shapes)


@dataclass
class ChunkPlan:
    """(b) and (c): each parameter cut at ``torch.chunk`` rows, ``chunk_rows`` rows per rank
    (``ceil(rows / W)``: the last ranks' pieces may be shorter or empty, padded here)."""

    shapes: tuple[torch.Size, ...]
    world: int
    chunk_rows: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # elements per row
    # (b): numel of each parameter's padded per-rank piece, back to back (FSDP2 packs them).
    piece_numel: list[int] = field(default_factory=list)
    # (c): parameter-major regions (16-element aligned starts) in the unsharded buffer and the
    # matching segments of the shard buffer.
    region_offsets: list[int] = field(default_factory=list)
    segment_offsets: list[int] = field(default_factory=list)
    unsharded_numel: int = 0
    shard_numel: int = 0

    @property
    def rank_major_numel(self) -> int:
        """(b)'s all-gather output / reduce-scatter input: W padded pieces of every parameter."""
        return self.world * sum(self.piece_numel)

    def padding_numel(self, layout: str) -> int:
        content = sum(math.prod(s) for s in self.shapes)
        return (self.rank_major_numel if layout == "b" else self.unsharded_numel) - content


def chunk_plan(shapes: Sequence[torch.Size], world: int) -> ChunkPlan:
    plan = ChunkPlan(tuple(torch.Size(s) for s in shapes), world)
    region = segment = 0
    for shape in plan.shapes:
        rows = shape[0] if len(shape) else 1
        per_row = row_numel(shape) if len(shape) > 1 else 1
        chunk = -(-rows // world)
        plan.chunk_rows.append(chunk)
        plan.rows.append(per_row)
        plan.piece_numel.append(chunk * per_row)
        region = _align_up(region, ALIGN_NUMEL)
        segment = _align_up(segment, ALIGN_NUMEL)
        plan.region_offsets.append(region)
        plan.segment_offsets.append(segment)
        region += world * chunk * per_row
        segment += chunk * per_row
    plan.unsharded_numel = _align_up(region, ALIGN_NUMEL)
    plan.shard_numel = _align_up(segment, ALIGN_NUMEL)
    return plan


def chunk_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``torch.chunk(t, world)[rank]`` for ``rows`` rows (empty past the
    last chunk)."""
    chunk = -(-rows // world)
    lo = min(rank * chunk, rows)
    return lo, min(lo + chunk, rows)


# ----------------------------------------------------------------------------- data

def _values(shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
    """Deterministic small integers as fp32: sums of a few ranks are exact in any order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, tuple(shape), generator=g).float().to(device)


def group_data(group: Group, index: int, world: int, device: torch.device
               ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """(parameters, gradients[rank]) of a group, the same on every rank."""
    params = [_values(s, 1_000_003 * index + i, device) for i, s in enumerate(group.shapes)]
    grads = [[_values(s, 7_919 * (index * 64 + i) + 104_729 * (r + 1), device)
              for i, s in enumerate(group.shapes)] for r in range(world)]
    return params, grads


# ----------------------------------------------------------------------------- layouts

class LayoutState:
    """One group's buffers in one layout on one rank: ``gather()`` all-gathers the parameters
    (compute views in ``self.params``), ``reduce()`` reduce-scatters the gradients; ``check``
    compares both with the originals."""

    kind = ""
    launches = 0  # Python-level collective calls per round
    collectives = 0  # collectives inside them (a coalesced call carries several)
    copy_bytes = 0  # bytes written by this layout's own copies per round
    sent_bytes = 0  # ring bytes one rank sends per round
    padding = 0
    content = 0
    peak_bytes = 0  # every buffer one round of this group uses (nothing freed in between)

    def gather(self) -> None:
        raise NotImplementedError

    def reduce(self) -> None:
        raise NotImplementedError

    def gathered(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def reduced(self) -> list[tuple[torch.Tensor, int, int]]:
        """Per parameter: (this rank's reduced gradient rows as a tensor, first row, end row)."""
        raise NotImplementedError


def _ring(numel: int, world: int, itemsize: int = 4) -> int:
    return (world - 1) * numel * itemsize // world


class Rows(LayoutState):
    """(a)."""

    def __init__(self, group: Group, params: list[torch.Tensor], grads: list[torch.Tensor],
                 world: int, rank: int, staged: bool, plan: Sequence[RowsPart]) -> None:
        self.kind = "a_staged" if staged else "a"
        self.staged, self.world, self.rank = staged, world, rank
        self.grads, self.shapes = grads, group.shapes
        self.plan = list(plan)
        device = params[0].device
        self.parts: list[dict[str, Any]] = []
        for part in self.plan:
            lo, hi = rank * part.shard_numel, (rank + 1) * part.shard_numel
            source = torch.zeros(part.total_numel, device=device)
            unsharded = torch.zeros(part.total_numel, device=device)
            grad_buffer = torch.zeros(part.total_numel, device=device)
            views, grad_views = [], []
            for i, off in zip(part.indices, part.offsets):
                n = params[i].numel()
                source[off:off + n].copy_(params[i].reshape(-1))
                views.append(unsharded[off:off + n].view(params[i].shape))
                grad_views.append(grad_buffer[off:off + n].view(params[i].shape))
                grad_views[-1].copy_(grads[i])  # autograd's in-place accumulation (aliases)
            self.parts.append(dict(
                part=part, shard=source[lo:hi].clone(), unsharded=unsharded, views=views,
                grad_buffer=grad_buffer, grad_views=grad_views,
                grad_shard=torch.empty(hi - lo, device=device)))
        total = sum(p.total_numel for p in self.plan)
        shard_total = sum(p.shard_numel for p in self.plan)
        self.launches = self.collectives = 2 * len(self.parts)
        self.sent_bytes = 2 * _ring(total, world)
        self.copy_bytes = 4 * group.numel if staged else 0
        self.padding, self.content = rows_padding(self.plan, group.shapes), group.numel
        # Unsharded weights and gradient buffer, both shards (+ the per-parameter gradients).
        self.peak_bytes = 4 * (2 * total + 2 * shard_total + (group.numel if staged else 0))

    def gather(self) -> None:
        for part in self.parts:
            _all_gather(part["unsharded"], part["shard"])

    def reduce(self) -> None:
        for part in self.parts:
            if self.staged:  # the ZeRO-3 staging copy (the library's pack_)
                torch._foreach_copy_(part["grad_views"],
                                     [self.grads[i] for i in part["part"].indices])
            _reduce_scatter(part["grad_shard"], part["grad_buffer"])

    def gathered(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = [torch.empty(0)] * len(self.shapes)
        for part in self.parts:
            for j, i in enumerate(part["part"].indices):
                out[i] = part["views"][j]
        return out

    def reduced(self) -> list[tuple[torch.Tensor, int, int]]:
        out: list[tuple[torch.Tensor, int, int]] = [(torch.empty(0), 0, 0)] * len(self.shapes)
        for part in self.parts:
            spec: RowsPart = part["part"]
            start = self.rank * spec.shard_numel
            end = start + spec.shard_numel
            for i, off in zip(spec.indices, spec.offsets):
                shape = self.shapes[i]
                row = row_numel(shape)
                lo, hi = max(off, start), min(off + math.prod(shape), end)
                hi = max(lo, hi)
                if (lo - off) % row or (hi - lo) % row:
                    raise AssertionError(f"(a): a shard boundary cuts a row of parameter {i}")
                first, rows = (lo - off) // row, (hi - lo) // row
                piece = part["grad_shard"][lo - start:hi - start]
                out[i] = (piece.view(rows, *shape[1:]), first, first + rows)
        return out


class Fsdp2(LayoutState):
    """(b)."""

    kind = "b"

    def __init__(self, group: Group, params: list[torch.Tensor], grads: list[torch.Tensor],
                 world: int, rank: int) -> None:
        self.world, self.rank, self.grads = world, rank, grads
        self.plan = plan = chunk_plan(group.shapes, world)
        device = params[0].device
        # The sharded parameters FSDP2 keeps: each rank's torch.chunk piece, zero-padded.
        self.shards: list[torch.Tensor] = []
        for p, chunk in zip(params, plan.chunk_rows):
            padded = torch.zeros((chunk * world, *p.shape[1:]), device=device)
            padded[:p.shape[0]].copy_(p)
            self.shards.append(padded[rank * chunk:(rank + 1) * chunk].reshape(-1).clone())
        n = sum(plan.piece_numel)
        self.gather_buffer = torch.empty(world * n, device=device)
        self.slot = self.gather_buffer[rank * n:(rank + 1) * n]
        self.slot_pieces = list(torch.split(self.slot, plan.piece_numel))
        # Padded unsharded parameters (FSDP2's all_gather_outputs); compute views of their rows.
        self.unsharded = [torch.empty((c * world, *s[1:]), device=device)
                          for c, s in zip(plan.chunk_rows, group.shapes)]
        self.params = [u[:s[0]] for u, s in zip(self.unsharded, group.shapes)]
        self.reduce_input = torch.empty(world * n, device=device)
        self.reduce_output = torch.empty(n, device=device)
        self.launches = self.collectives = 2
        self.sent_bytes = 2 * _ring(world * n, world)
        # Copy-in (n) and copy-out (W n) of the gather, copy-in (W n) of the reduction.
        self.copy_bytes = 4 * (n + 2 * world * n)
        self.padding, self.content = plan.padding_numel("b"), group.numel
        # Gather buffer, padded unsharded parameters, per-parameter gradients, reduce-scatter
        # input and output, the parameter shards.
        self.peak_bytes = 4 * (3 * world * n + group.numel + 2 * n)

    def gather(self) -> None:
        torch._foreach_copy_(self.slot_pieces, self.shards)
        _all_gather(self.gather_buffer, self.slot)
        torch.split_with_sizes_copy(
            self.gather_buffer.view(self.world, -1), self.plan.piece_numel, dim=1,
            out=[u.view(self.world, -1) for u in self.unsharded])

    def reduce(self) -> None:
        torch._chunk_cat(self.grads, dim=0, num_chunks=self.world,
                         out=self.reduce_input.view(self.world, -1))
        _reduce_scatter(self.reduce_output, self.reduce_input)

    def gathered(self) -> list[torch.Tensor]:
        return self.params

    def reduced(self) -> list[tuple[torch.Tensor, int, int]]:
        out = []
        for piece, shape in zip(torch.split(self.reduce_output, self.plan.piece_numel),
                                self.plan.shapes):
            lo, hi = chunk_range(shape[0], self.world, self.rank)
            out.append((piece.view(-1, *shape[1:])[:hi - lo], lo, hi))
        return out


class ChunkRows(LayoutState):
    """(c)."""

    def __init__(self, group: Group, params: list[torch.Tensor], grads: list[torch.Tensor],
                 world: int, rank: int, staged: bool, coalesce: bool = True) -> None:
        self.kind = "c_staged" if staged else ("c" if coalesce else "c_uncoalesced")
        self.world, self.rank, self.staged, self.grads = world, rank, staged, grads
        self.coalesce = coalesce
        self.plan = plan = chunk_plan(group.shapes, world)
        device = params[0].device
        self.shard = torch.zeros(plan.shard_numel, device=device)
        self.unsharded = torch.zeros(plan.unsharded_numel, device=device)
        self.grad_buffer = torch.zeros(plan.unsharded_numel, device=device)
        self.grad_shard = torch.zeros(plan.shard_numel, device=device)
        self.segments, self.regions, self.grad_regions, self.grad_segments = [], [], [], []
        self.params, self.grad_views = [], []
        for i, (p, g) in enumerate(zip(params, grads)):
            piece, seg, reg = plan.piece_numel[i], plan.segment_offsets[i], plan.region_offsets[i]
            self.segments.append(self.shard[seg:seg + piece])
            self.grad_segments.append(self.grad_shard[seg:seg + piece])
            self.regions.append(self.unsharded[reg:reg + world * piece])
            self.grad_regions.append(self.grad_buffer[reg:reg + world * piece])
            self.params.append(self.unsharded[reg:reg + p.numel()].view(p.shape))
            self.grad_views.append(self.grad_buffer[reg:reg + p.numel()].view(p.shape))
            self.grad_views[-1].copy_(g)  # autograd's in-place accumulation into the aliases
            lo, hi = chunk_range(p.shape[0], world, rank)
            self.segments[-1][:(hi - lo) * plan.rows[i]].copy_(p[lo:hi].reshape(-1))
        self.collectives = 2 * len(group.shapes)
        self.launches = 2 if coalesce else self.collectives
        self.sent_bytes = 2 * _ring(plan.unsharded_numel, world)
        self.copy_bytes = 4 * group.numel if staged else 0
        self.padding, self.content = plan.padding_numel("c"), group.numel
        self.peak_bytes = 4 * (2 * plan.unsharded_numel + 2 * plan.shard_numel
                               + (group.numel if staged else 0))

    def gather(self) -> None:
        if not self.coalesce:
            works = [_all_gather(out, inp, async_op=True)
                     for out, inp in zip(self.regions, self.segments)]
            for work in works:
                assert work is not None
                work.wait()
            return
        with dist._coalescing_manager(async_ops=True) as cm:
            for out, inp in zip(self.regions, self.segments):
                _all_gather(out, inp)
        cm.wait()

    def reduce(self) -> None:
        if self.staged:
            torch._foreach_copy_(self.grad_views, self.grads)
        if not self.coalesce:
            works = [_reduce_scatter(out, inp, async_op=True)
                     for out, inp in zip(self.grad_segments, self.grad_regions)]
            for work in works:
                assert work is not None
                work.wait()
            return
        with dist._coalescing_manager(async_ops=True) as cm:
            for out, inp in zip(self.grad_segments, self.grad_regions):
                _reduce_scatter(out, inp)
        cm.wait()

    def gathered(self) -> list[torch.Tensor]:
        return self.params

    def reduced(self) -> list[tuple[torch.Tensor, int, int]]:
        out = []
        for i, shape in enumerate(self.plan.shapes):
            lo, hi = chunk_range(shape[0], self.world, self.rank)
            piece = self.grad_segments[i][:(hi - lo) * self.plan.rows[i]]
            out.append((piece.view(-1, *shape[1:]), lo, hi))
        return out


def make_layout(kind: str, group: Group, params: list[torch.Tensor],
                grads: list[torch.Tensor], world: int, rank: int,
                rows: Sequence[RowsPart] | None = None) -> LayoutState:
    """The buffers of ``kind`` for one unit on one rank; ``rows``: (a)'s plan (``rows_plan``,
    computed where the library is imported)."""
    if kind in ("a", "a_staged"):
        if rows is None:
            rows = rows_plan(group.shapes, world)
        return Rows(group, params, grads, world, rank, staged=kind == "a_staged", plan=rows)
    if kind == "b":
        return Fsdp2(group, params, grads, world, rank)
    if kind in ("c", "c_staged", "c_uncoalesced"):
        return ChunkRows(group, params, grads, world, rank, staged=kind == "c_staged",
                         coalesce=kind != "c_uncoalesced")
    raise ValueError(f"unknown layout {kind!r}; expected one of "
                     f"{', '.join(LAYOUTS + EXTRA_LAYOUTS)}")


def check(state: LayoutState, params: list[torch.Tensor],
          grads_by_rank: list[list[torch.Tensor]]) -> None:
    """Raise unless the gathered parameters equal ``params`` and the reduced rows equal the sum
    of every rank's gradients over the same rows."""
    for i, (got, want) in enumerate(zip(state.gathered(), params)):
        if got.shape != want.shape or not torch.equal(got, want):
            raise AssertionError(f"{LABELS[state.kind]}: gathered parameter {i} "
                                 f"{tuple(want.shape)} differs from the original")
    for i, (piece, lo, hi) in enumerate(state.reduced()):
        total = torch.stack([g[i][lo:hi] for g in grads_by_rank]).sum(0)
        if not torch.equal(piece, total):
            raise AssertionError(f"{LABELS[state.kind]}: reduced rows [{lo}, {hi}) of "
                                 f"gradient {i} differ from the sum over the ranks")


# ----------------------------------------------------------------------------- rank side

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_rank(rank: int, world: int, device: torch.device, a: dict[str, Any]) -> dict[str, Any]:
    """Build every layout of every group of ``a["model_size"]`` on this rank, check them, time
    ``a["rounds"]`` rounds; return the per-layout counts and (rank 0 meaningful) round times."""
    groups, plans = a["groups"], a["rows_plans"]
    kinds = a["layouts"]
    states: dict[str, list[LayoutState]] = {k: [] for k in kinds}
    data = []
    for index, group in enumerate(groups):
        params, grads = group_data(group, index, world, device)
        data.append((params, grads))
        for k in kinds:
            states[k].append(make_layout(k, group, params, grads[rank], world, rank,
                                         plans[index]))

    def one_round(k: str) -> float:
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        for state in states[k]:
            state.gather()
            state.reduce()
        _sync(device)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {k: [] for k in kinds}
    for k in kinds:  # warm-up round, then the check
        one_round(k)
        for state, (params, grads) in zip(states[k], data):
            check(state, params, grads)
    for r in range(a["rounds"]):
        for k in (kinds if r % 2 == 0 else kinds[::-1]):
            times[k].append(one_round(k))
    for k in kinds:
        for state, (params, grads) in zip(states[k], data):
            check(state, params, grads)
    # The slowest rank's time per round.
    # On the collective's device: NCCL reduces CUDA tensors only.
    flat = torch.tensor([t for k in kinds for t in times[k]], dtype=torch.float64,
                        device=device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    slowest = flat.view(len(kinds), -1).tolist()
    out: dict[str, Any] = {"groups": len(groups), "params": sum(g.numel for g in groups)}
    for k, ts in zip(kinds, slowest):
        s = states[k]
        out[k] = dict(times=ts, launches=sum(x.launches for x in s),
                      sent=sum(x.sent_bytes for x in s), copy=sum(x.copy_bytes for x in s),
                      padding=sum(x.padding for x in s), content=sum(x.content for x in s),
                      peak=max(x.peak_bytes for x in s),
                      collectives=sum(x.collectives for x in s))
    return out


def _rank_entry(rank: int, world: int, init_file: str, a: dict[str, Any], results: Any) -> None:
    try:
        torch.set_num_threads(a["threads"])
        if a["device"] == "cuda":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            backend = "nccl"
        else:
            device, backend = torch.device("cpu"), "gloo"
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=a["timeout"]),
                                device_id=device if backend == "nccl" else None)
        try:
            out = run_rank(rank, world, device, a)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def launch(a: dict[str, Any]) -> dict[str, Any]:
    """One fresh process group of ``a["world"]`` spawned ranks; rank 0's result."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank_entry, args=(r, a["world"], init_file, a, results))
                 for r in range(a["world"])]
        for p in procs:
            p.start()
        got: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + a["timeout"]
        try:
            while len(got) < a["world"]:
                rank, status, payload = results.get(timeout=max(1.0, deadline - time.monotonic()))
                got[rank] = (status, payload)
                if status != "ok":
                    raise RuntimeError(f"rank {rank} failed:\n{payload}")
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    return got[0][1]


# ----------------------------------------------------------------------------- report

def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:.2f}"


def render(model_size: str, runs: list[dict[str, Any]], a: dict[str, Any]) -> str:
    """One table: per layout the counts (equal across runs) and the median of the runs' median
    round times with their range."""
    first = runs[0]
    kinds = a["layouts"]
    medians = {k: [statistics.median(r[k]["times"]) * 1e3 for r in runs] for k in kinds}
    base = statistics.median(medians["a"]) if "a" in medians else None
    lines = [
        f"GPT {model_size}: {first['params'] / 1e6:.2f}M parameters, {first['groups']} units, "
        f"world {a['world']} ({a['device_desc']}), fp32, {a['rounds']} rounds x "
        f"{a['repeats']} run(s)",
        "| layout | sent MiB/rank | padding | launches (collectives) | copied MiB | "
        "buffers MiB (largest unit) | round ms (range) | vs (a) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k in kinds:
        r = first[k]
        med = statistics.median(medians[k])
        ratios = [m / b for m, b in zip(medians[k], medians["a"])] if base else []
        ratio = (f"{med / base:.2f}x" + (f" [{min(ratios):.2f}-{max(ratios):.2f}]"
                                         if len(ratios) > 1 else "")) if base else "-"
        lines.append(
            f"| {LABELS[k]} | {_mib(r['sent'])} | {r['padding']} "
            f"({100 * r['padding'] / r['content']:.3f}%) | {r['launches']} ({r['collectives']}) "
            f"| {_mib(r['copy'])} | {_mib(r['peak'])} | {med:.1f} "
            f"({min(medians[k]):.1f}-{max(medians[k]):.1f}) | {ratio} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- GPU scale

LLAMA = {  # name -> (layers, dim, ffn, vocab, heads, kv_heads)
    "llama3-8b": (32, 4096, 14336, 128256, 32, 8),
    "llama3-70b": (80, 8192, 28672, 128256, 64, 8),
}
SCALE_WORLDS = (8, 64, 256, 1024, 1536)


def scale_row(groups: list[Group], world: int) -> dict[str, Any]:
    """Padding of (a) and of (b)/(c), and (b)'s copy bytes per ZeRO-3 step (bf16 gathers twice,
    fp32 reduce-scatter once), for ``groups`` at ``world`` ranks, from the layout math alone."""
    content = sum(g.numel for g in groups)
    pad_a = pad_b = pad_c = 0
    rank_major = largest = 0
    collectives_a = collectives_c = 0
    for g in groups:
        rows = rows_plan(g.shapes, world)
        chunks = chunk_plan(g.shapes, world)
        pad_a += rows_padding(rows, g.shapes)
        pad_b += chunks.padding_numel("b")
        pad_c += chunks.padding_numel("c")
        rank_major += chunks.rank_major_numel
        largest = max(largest, chunks.rank_major_numel)
        collectives_a += len(rows)
        collectives_c += len(g.shapes)
    # (b) per step: two all-gathers (forward, backward re-gather), each a copy-in of the shard
    # (the fp32 -> bf16 cast, which (a) does too) and a copy-out of W pieces (bf16); one
    # reduce-scatter copy-in of every gradient into rank-major fp32 order.
    copy_out = 2 * 2 * rank_major
    copy_in_rs = 4 * rank_major
    # (b)'s all-gather buffer lives beside the unsharded parameters it is copied out into: one
    # more bf16 copy of the largest unit than (a) and (c), whose parameters view the buffer.
    return dict(world=world, content=content, pad_a=pad_a, pad_b=pad_b, pad_c=pad_c,
                copy_out=copy_out, copy_in_rs=copy_in_rs, extra_transient=2 * largest,
                groups_a=collectives_a, collectives_c=collectives_c)


def estimator_row(name: str, world: int) -> dict[str, Any]:
    """What ``megatron_fsdp_v2.estimator.estimate`` gives for (a): ZeRO-3, bf16 compute, fp32
    main weights and gradients, AdamW, one micro-batch."""
    from megatron_fsdp_v2 import MixedPrecisionPolicy
    from megatron_fsdp_v2.estimator import estimate
    from megatron_fsdp_v2.estimator._presets import LlamaBlock, LlamaDecoder

    layers, dim, ffn, vocab, heads, kv = LLAMA[name]
    est = estimate(lambda: LlamaDecoder(layers, dim, ffn, vocab, heads, kv), world_size=world,
                   wrap=(LlamaBlock,), sharding_strategy="optim_grads_params",
                   mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                  main_params_dtype=torch.float32))
    m = est.memory
    total = (m.model_weights + m.main_weights + m.main_grads + m.temporary_peak
             + m.optimizer_state)
    return dict(total=total, temp=m.temporary_peak, sharded=m.main_weights + m.main_grads
                + m.optimizer_state, wire=est.bytes_communicated, pad=est.padding_ratio)


def render_scale(names: Sequence[str], worlds: Sequence[int],
                 use_estimator: bool = True) -> str:
    GiB = float(1 << 30)
    lines = [
        "GPU scale: ZeRO-3, bf16 gathers (two per step), fp32 reduce-scatter, AdamW, one "
        "group per block + the root; per rank unless marked",
        "| model | W | pad (a) | pad (b)/(c) | (a) groups / (c) collectives per step-pass | "
        "(b) copy-out GiB/step | (b) RS copy-in GiB/step | (b) extra transient GiB | "
        "est. (a) GiB/rank (sharded; temp) | "
        "(b)/(c) sharded GiB (scaled by padding) | est. (a) wire GiB/step | (b)/(c) wire GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        layers, dim, ffn, vocab, heads, kv = LLAMA[name]
        groups = llama_groups(layers, dim, ffn, vocab, heads, kv)
        for w in worlds:
            s = scale_row(groups, w)
            c = s["content"]
            est = estimator_row(name, w) if use_estimator else None
            ratio = (c + s["pad_b"]) / (c + s["pad_a"])
            est_cols = (f"{est['total'] / GiB:.2f} ({est['sharded'] / GiB:.2f}; "
                        f"{est['temp'] / GiB:.2f}) [est. pad {100 * est['pad']:.3f}%] | "
                        f"{est['sharded'] * ratio / GiB:.2f} | {est['wire'] / GiB:.1f} | "
                        f"{est['wire'] * ratio / GiB:.1f}") if est else "- | - | - | -"
            lines.append(
                f"| {name} | {w} | {100 * s['pad_a'] / c:.3f}% | "
                f"{100 * s['pad_b'] / c:.3f}% / {100 * s['pad_c'] / c:.3f}% | "
                f"{s['groups_a']} / {s['collectives_c']} | {s['copy_out'] / GiB:.1f} | "
                f"{s['copy_in_rs'] / GiB:.1f} | {s['extra_transient'] / GiB:.2f} | {est_cols} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-size", default="small",
                   help="comma-separated presets of bench_training.py's GPT (tiny, small, "
                        "medium, large)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--world", type=int, default=None,
                   help="ranks (default: 4 on CPU, the GPU count on CUDA)")
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help="comma-separated, of " + ", ".join(LAYOUTS + EXTRA_LAYOUTS))
    p.add_argument("--rounds", type=int, default=15, help="timed rounds per layout and run")
    p.add_argument("--repeats", type=int, default=3,
                   help="independent runs (fresh process groups); median and range of their "
                        "medians")
    p.add_argument("--quick", action="store_true",
                   help="--model-size small --rounds 3 --repeats 1 (flags given win)")
    p.add_argument("--scale", action="store_true",
                   help="only the GPU-scale arithmetic (Llama-3 8B/70B, no process group)")
    p.add_argument("--scale-worlds", default=",".join(map(str, SCALE_WORLDS)))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: cores / world, at least 1)")
    p.add_argument("--timeout", type=int, default=600, help="seconds for one run")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    args.layouts = [k.strip() for k in args.layouts.split(",") if k.strip()]
    unknown = [k for k in args.layouts if k not in LAYOUTS + EXTRA_LAYOUTS]
    if unknown or not args.layouts:
        p.error(f"--layouts takes some of {', '.join(LAYOUTS + EXTRA_LAYOUTS)}, "
                f"got {unknown or 'none'}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda needs a GPU")
        n = torch.cuda.device_count()
        args.world = args.world or n
        if args.world > n:
            p.error(f"NCCL needs one GPU per rank: --world {args.world} > {n} GPU(s)")
    args.world = args.world or 4
    if args.world < 1 or args.rounds < 1 or args.repeats < 1:
        p.error("--world, --rounds and --repeats must be >= 1")
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.world)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.scale:
        worlds = [int(w) for w in args.scale_worlds.split(",")]
        print(render_scale(list(LLAMA), worlds), flush=True)
        return 0
    a = dict(vars(args))
    a["device_desc"] = (f"NCCL, {torch.cuda.get_device_name(0)}" if args.device == "cuda"
                        else f"gloo, {os.cpu_count()} CPU cores, {args.threads} thread(s)/rank")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average before: {load:.2f}", flush=True)
    for size in args.model_size.split(","):
        a["model_size"] = size.strip()
        a["groups"] = gpt_groups(a["model_size"], args.vocab, args.seq_len)
        a["rows_plans"] = [rows_plan(g.shapes, args.world) for g in a["groups"]]
        runs = [launch(a) for _ in range(args.repeats)]
        print(render(a["model_size"], runs, a), flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average after: {load:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
