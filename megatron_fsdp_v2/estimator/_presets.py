"""Model presets for the estimator's command line: a Llama-style and a GPT-style decoder of
configurable sizes. Built under ``torch.device("meta")`` by the estimator; never run there, but
each has a working forward so the same classes can train at small sizes."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "GPTBlock", "GPTDecoder", "LlamaBlock", "LlamaDecoder", "PRESETS", "build_preset", "tp_plan",
]


class LlamaBlock(nn.Module):
    """Pre-norm block: grouped-query attention (no biases), SwiGLU MLP, RMSNorm."""

    def __init__(self, dim: int, ffn: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        kv = kv_heads * self.head_dim
        self.attn_norm = nn.RMSNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv, bias=False)
        self.v = nn.Linear(dim, kv, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        self.gate = nn.Linear(dim, ffn, bias=False)
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaDecoder(nn.Module):
    """Token embedding, ``layers`` Llama blocks, final RMSNorm, untied output head."""

    def __init__(self, layers: int, dim: int, ffn: int, vocab: int, heads: int,
                 kv_heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(LlamaBlock(dim, ffn, heads, kv_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class GPTBlock(nn.Module):
    """Pre-norm GPT-2 block: LayerNorm, fused-qkv attention, GELU MLP, with biases."""

    def __init__(self, dim: int, ffn: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn)
        self.fc2 = nn.Linear(ffn, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPTDecoder(nn.Module):
    """Token and position embeddings, ``layers`` GPT blocks, final LayerNorm, head tied to the
    token embedding."""

    def __init__(self, layers: int, dim: int, ffn: int, vocab: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, ffn, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


PRESETS = {"llama": LlamaBlock, "gpt": GPTBlock}


def tp_plan(model: str) -> dict[str, Any]:
    """The ``parallelize_module`` plan (of the decoder root) that ``--tp`` applies to preset
    ``model``, Megatron-style as torchtitan's llama plan writes it: the Linears that fan out
    (attention inputs, MLP up/gate) colwise, those that fan back in (attention output, MLP down)
    rowwise, the norms sequence-parallel (replicated parameters). Llama also splits the
    embedding by rows and the head by columns; the GPT preset's head is tied to its embedding,
    so both stay whole (replicated on every TP rank). Only parameter shapes matter to the
    estimate, so activation layouts are left at their defaults."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    if model == "llama":
        col: tuple[str, ...] = ("q", "k", "v", "gate", "up")
        row: tuple[str, ...] = ("o", "down")
        norms: tuple[str, ...] = ("attn_norm", "mlp_norm")
        plan: dict[str, Any] = {
            "embed": RowwiseParallel(input_layouts=Replicate()),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(),
        }
    elif model == "gpt":
        col, row, norms = ("qkv", "fc1"), ("proj", "fc2"), ("ln1", "ln2")
        plan = {"ln": SequenceParallel()}
    else:
        raise ValueError(f"unknown preset {model!r}; choose one of {sorted(PRESETS)}")
    plan.update({f"blocks.*.{n}": ColwiseParallel() for n in col})
    plan.update({f"blocks.*.{n}": RowwiseParallel() for n in row})
    plan.update({f"blocks.*.{n}": SequenceParallel() for n in norms})
    return plan


def build_preset(args: argparse.Namespace) -> tuple[Callable[[], nn.Module], type]:
    """``(model_fn, block class)`` for the command line's ``--model`` and sizes."""
    if args.model == "llama":
        def llama() -> nn.Module:
            return LlamaDecoder(args.layers, args.dim, args.ffn, args.vocab, args.heads,
                                args.kv_heads)
        return llama, LlamaBlock
    if args.model == "gpt":
        def gpt() -> nn.Module:
            return GPTDecoder(args.layers, args.dim, args.ffn, args.vocab, args.heads, args.seq)
        return gpt, GPTBlock
    raise ValueError(f"unknown preset {args.model!r}; choose one of {sorted(PRESETS)}")
