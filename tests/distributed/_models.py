"""Small models and a reference trainer shared by the distributed tests."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from megatron_fsdp_v2 import fully_shard

# private: a parameter's global shard rows (record_of(p).local_rows), to compare with the reference
from megatron_fsdp_v2._registry import record_of


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, checkpointed: bool = False) -> None:
        """``checkpointed``: recompute the body in backward (checkpoint *inside* forward)."""
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        # No qkv bias: the key bias has an exactly-zero gradient, which Adam turns into noise.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.checkpointed = checkpointed

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attn(x)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed and torch.is_grad_enabled():
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


class TinyGPT(nn.Module):
    """GPT-style LM with tied embedding / output head."""

    def __init__(self, vocab: int = 37, dim: int = 16, layers: int = 2, heads: int = 2,
                 seq: int = 8, tie: bool = True, checkpoint: str | None = None) -> None:
        """``checkpoint``: None, "inner" (inside each block's forward) or "outer" (around each
        block call, so the recompute runs the block's forward hooks)."""
        super().__init__()
        self.outer_checkpoint = checkpoint == "outer"
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, checkpoint == "inner") for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            if self.outer_checkpoint and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))


class OddMLP(nn.Module):
    """Odd shapes (17x257, 7x15), a bias smaller than the world, a frozen layer, and a layer
    used twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(15, 257)
        self.mid = nn.Linear(257, 17)
        self.shared = nn.Linear(17, 17)
        self.frozen = nn.Linear(17, 7)
        self.out = nn.Linear(7, 3)
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))  # used twice
        return self.out(torch.tanh(self.frozen(h)))


class ThinMLP(nn.Module):
    """Rows 7, 7, 2, 2, 1, 1: at world 3 uneven shards and one-row parameters (empty shards on
    some ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 2)
        self.c = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class SmallMLP(nn.Module):
    """5 -> 7 -> 3 with tanh: odd widths, uneven shards at world 2 and 4."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class MLPBlock(nn.Module):
    """Residual MLP block ``x + fc2(tanh(fc1(x)))``; ``hidden`` (default ``2 * dim + 1``) odd,
    so shards are uneven.

    ``checkpoint="inner"``: activation checkpoint inside forward (bypasses the unit's forward
    hooks on recompute), reentrant or not by ``reentrant``. ``unused``: a Linear forward never
    calls. ``extra``: a Linear used only while ``self.use_extra`` is true. Parameters are
    created in the order fc1, fc2, unused, extra (the initialisation draws follow it)."""

    def __init__(self, dim: int, *, hidden: int | None = None, checkpoint: str | None = None,
                 reentrant: bool = True, unused: bool = False, extra: bool = False) -> None:
        super().__init__()
        width = 2 * dim + 1 if hidden is None else hidden
        self.fc1 = nn.Linear(dim, width)
        self.fc2 = nn.Linear(width, dim)
        self.inner_checkpoint = checkpoint == "inner"
        self.reentrant = reentrant
        if unused:
            self.unused = nn.Linear(dim, dim)
        self.use_extra = extra
        if extra:
            self.extra = nn.Linear(dim, dim)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.fc2(torch.tanh(self.fc1(x)))
        if self.use_extra:
            h = h + torch.tanh(self.extra(h))
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner_checkpoint and torch.is_grad_enabled():
            return checkpoint(self._body, x, use_reentrant=self.reentrant)
        return self._body(x)


class MLPStack(nn.Module):
    """inp -> blocks (:class:`MLPBlock`, each a unit when wrapped) -> [frozen] -> head; the root
    unit owns inp, frozen and head.

    ``inp_tanh``: tanh after inp. ``checkpoint``: "outer" (around each block call, so the
    recompute runs the block's forward hooks) or "inner" (inside each block's forward),
    reentrant or not by ``reentrant``. ``unused`` / ``extra``: block 0's unused / extra Linear
    (see :class:`MLPBlock`). ``frozen``: a Linear without gradients before the head. Control
    flow set per step: ``skip`` (block indices forward leaves out), ``twice`` (blocks called
    twice: one unit, two forward calls), ``discard`` (blocks whose output is dropped: no
    backward reaches them)."""

    DIN, DIM, DOUT = 5, 6, 3

    def __init__(self, layers: int = 2, dim: int = DIM, *, inp_tanh: bool = True,
                 checkpoint: str | None = None, reentrant: bool = True, unused: bool = False,
                 extra: bool = False, frozen: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(self.DIN, dim)
        self.blocks = nn.ModuleList(
            MLPBlock(dim, checkpoint=checkpoint, reentrant=reentrant, unused=unused and i == 0,
                     extra=extra and i == 0)
            for i in range(layers)
        )
        if frozen:
            self.frozen = nn.Linear(dim, dim)
            for p in self.frozen.parameters():
                p.requires_grad_(False)
        self.head = nn.Linear(dim, self.DOUT)
        self.inp_tanh = inp_tanh
        self.outer_checkpoint = checkpoint == "outer"
        self.reentrant = reentrant
        self.skip: set[int] = set()
        self.twice: set[int] = set()
        self.discard: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.inp_tanh:
            h = torch.tanh(h)
        for i, block in enumerate(self.blocks):
            if i in self.skip:
                continue
            for _ in range(2 if i in self.twice else 1):
                if self.outer_checkpoint and torch.is_grad_enabled():
                    out = checkpoint(block, h, use_reentrant=self.reentrant)
                else:
                    out = block(h)
                h = h if i in self.discard else out
        if hasattr(self, "frozen"):
            h = h + torch.tanh(self.frozen(h))
        return self.head(h)


class TanhResidual(nn.Module):
    """``h + tanh(ff(h))``: the smallest residual block (one Linear)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ff = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.ff(h))


class SharedLayerNet(nn.Module):
    """inp -> block (an :class:`MLPBlock` of hidden width 7 with an unused Linear: uneven
    shards, a 3-element bias that leaves ranks of world 3 empty-handed) -> shared (one unit,
    called twice) -> head; the root owns inp and head. ``ckpt``: None, "reentrant" or
    "non_reentrant" checkpointing inside the block."""

    def __init__(self, ckpt: str | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 3)
        self.block = MLPBlock(3, hidden=7, checkpoint=None if ckpt is None else "inner",
                              reentrant=ckpt == "reentrant", unused=True)
        self.shared = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(torch.tanh(self.inp(x)))
        h = self.shared(torch.tanh(self.shared(h)))
        return self.head(h)


class LinearTanhStack(nn.Module):
    """An input layer, ``layers`` blocks ``Sequential(Linear, Tanh)`` (each wrapped as a unit)
    and an output layer (root)."""

    def __init__(self, dim: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(5, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(layers)
        )
        self.out = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class UnusedRootNet(nn.Module):
    """inp -> block (a unit) -> head; the root owns inp and head (and ``unused``, a parameter no
    rank uses, when asked for)."""

    def __init__(self, unused: bool) -> None:
        super().__init__()
        # 16 inputs: at world 2 both ranks hold rows of inp.weight (the write variants of
        # test_host_syncs write into it on every rank; see [Note: gradients known without a
        # host read]).
        self.inp = nn.Linear(16, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)
        self.unused = nn.Linear(8, 8) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(self.inp(x))))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def make_batches(kind: str, steps: int, micro: int, world: int, per_rank: int, seed: int = 0,
                 vocab: int = 37, seq: int = 9) -> list[list[list]]:
    """batches[step][micro][rank] -> that rank's micro-batch; identical on every rank."""
    g = torch.Generator().manual_seed(1234 + seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(micro):
            if kind == "lm":
                step.append([torch.randint(0, vocab, (per_rank, seq), generator=g)
                             for _ in range(world)])
            else:
                step.append([(torch.randn(per_rank, 15, generator=g),
                              torch.randn(per_rank, 3, generator=g)) for _ in range(world)])
        out.append(step)
    return out


def cat_batch(kind: str, parts: list) -> object:
    if kind == "lm":
        return torch.cat(parts)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def shard_rows(dist_param: torch.Tensor) -> tuple[int, int]:
    """The global dim-0 rows this rank's local shard of a fully_shard parameter covers."""
    record = record_of(dist_param)
    assert record is not None, "not a fully_shard parameter"
    return record.local_rows


def assert_close_to_reference(model: nn.Module, ref: nn.Module, rtol: float, atol: float,
                              what: str = "param") -> None:
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        full = ref_params[name].detach()
        if isinstance(p, DTensor):
            lo, hi = shard_rows(p)
            local = p.to_local().detach()
            expected = full[lo:hi]
        else:
            local, expected = p.detach(), full
        torch.testing.assert_close(local.float(), expected.float(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what} {name}: {m}")


def all_ranks_ok(ok: bool) -> bool:
    """Reduce a local verdict so every rank raises together (no rank left in a collective)."""
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    return int(flag.item()) == 0


def check_all_ranks(ok: bool, message: str) -> None:
    """Raise on every rank when any rank failed (no rank left waiting in a collective)."""
    if not all_ranks_ok(ok):
        raise AssertionError(message if not ok else f"{message} (on another rank)")


def wrap_blocks(model: nn.Module, strategy: str, **kw: object) -> nn.Module:
    """``fully_shard`` each of ``model.blocks`` (when it has them), then the root; the root."""
    for block in getattr(model, "blocks", []):
        fully_shard(block, sharding_strategy=strategy, **kw)  # type: ignore[arg-type]
    return fully_shard(model, sharding_strategy=strategy, **kw)  # type: ignore[arg-type]


def local_detached(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a parameter or gradient (a DTensor's local shard), detached."""
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def reference_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def lr_schedule(step: int) -> float:
    return 1e-2 * (0.5 + 0.5 * math.cos(step))


def agree(what: str, fn: Callable[[], object]) -> None:
    """Run a local check on every rank; fail on all ranks if it failed on any."""
    try:
        fn()
        err = None
    except AssertionError as e:
        err = e
    if not all_ranks_ok(err is None):
        raise AssertionError(f"{what}: {err if err is not None else 'failed on another rank'}")


def step_mean_loss(loss: torch.Tensor, opt: torch.optim.Optimizer) -> float:
    """Backward, optimizer step and ``zero_grad`` for this rank's ``loss``; returns the loss
    averaged over the ranks (the single-process loss of the global batch)."""
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()
