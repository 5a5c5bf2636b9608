"""A small GPT-style language model and a synthetic token stream it can learn.

Shared by ``examples/train.py`` and ``benchmarks/bench_training.py`` so that both train the same
network on the same data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "Block", "lm_loss", "synthetic_batch"]


@dataclass
class GPTConfig:
    vocab: int = 512
    seq_len: int = 64
    dim: int = 128
    layers: int = 4
    heads: int = 4

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} must be a multiple of heads={self.heads}")


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = attention_residual(self, x)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def attention_residual(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` plus causal self-attention of ``block`` (its ``ln1``, ``qkv``, ``proj``, ``heads``);
    shared by the dense and the MoE blocks."""
    b, t, d = x.shape
    q, k, v = block.qkv(block.ln1(x)).split(d, dim=-1)
    q, k, v = (y.view(b, t, block.heads, d // block.heads).transpose(1, 2) for y in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return x + block.proj(y.transpose(1, 2).reshape(b, t, d))


class GPT(nn.Module):
    """Token + position embeddings, ``layers`` blocks, final norm, output head tied to the
    token embedding (GPT-2 style)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, unit norms, residual projections
        scaled by 1/sqrt(2 * layers)."""
        residual_std = 0.02 / (2 * self.cfg.layers) ** 0.5
        for name, module in self.named_modules():
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("proj", "fc2")) else 0.02
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, computed in fp32 whatever the compute dtype."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def synthetic_batch(batch: int, seq_len: int, vocab: int, *, seed: int, step: int, micro: int,
                    rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``(batch, seq_len + 1)`` tokens, deterministic in (seed, step, micro, rank).

    Each row is an arithmetic progression modulo ``vocab`` with a random start and a random
    stride from 1..7, with 10% of tokens replaced by noise: learnable (the stride is visible
    from two tokens) but not trivially, so the loss falls steadily from ln(vocab).
    """
    g = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1009 + micro) * 131 + rank)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 8, (batch, 1), generator=g)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab
    noise = torch.rand(batch, seq_len + 1, generator=g) < 0.1
    tokens = torch.where(noise, torch.randint(0, vocab, tokens.shape, generator=g), tokens)
    return tokens.to(device)
