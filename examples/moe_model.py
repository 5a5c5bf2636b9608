"""A small mixture-of-experts decoder: ``examples/model.py``'s GPT whose MLPs are MoE layers.

Expert parallelism (EP), torchtitan-style: each of the ``ep`` ranks of an expert-parallel group
holds ``experts / ep`` experts; every rank routes its own tokens, sends each token to the rank
that holds its expert with an autograd-aware all-to-all, runs its local experts on what it
received, and sends the results back with a second all-to-all. The backward of an all-to-all is
the all-to-all with the splits swapped, so gradients flow back to the sending rank's router and
attention, and every rank's tokens reach the expert's parameters.

With ``ep_group=None`` (the default) one process holds every expert and no collective is issued:
the single-process reference the distributed run is checked against. Routing is per token (no
capacity limit, no dropped token), so the two compute the same function of the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from model import GPT, GPTConfig, attention_residual

__all__ = ["MoEConfig", "MoEGPT", "MoE", "LocalExperts", "Expert", "all_to_all",
           "keep_local_experts", "local_expert_indices"]


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with autograd: the backward sends each gradient row back to
    the rank its row came from (the same exchange with the splits swapped)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, recv_splits: list[int], send_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        out = rows.new_empty(sum(recv_splits), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        recv_splits, send_splits = ctx.splits
        return _AllToAll.apply(grad, send_splits, recv_splits, ctx.group), None, None, None


def all_to_all(rows: torch.Tensor, recv_splits: list[int], send_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """Send ``send_splits[i]`` rows of ``rows`` to rank ``i`` of ``group``, receive
    ``recv_splits[i]`` from it; differentiable."""
    out: torch.Tensor = _AllToAll.apply(rows, recv_splits, send_splits, group)
    return out


@dataclass
class MoEConfig(GPTConfig):
    """``GPTConfig`` plus the MoE layer's shape: ``experts`` in total, each token sent to the
    ``top_k`` experts of largest router probability, each expert a ``dim -> hidden -> dim``
    GELU MLP."""

    experts: int = 4
    top_k: int = 1
    hidden: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..experts={self.experts}")


class Expert(nn.Module):
    """One expert: a GELU MLP (the names ``fc1``/``fc2`` give it GPT's residual init)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class LocalExperts(nn.Module):
    """The experts this rank holds: the unit wrapped on the expert-data-parallel mesh.

    Its forward runs on every step on every rank, even with no token routed here (empty
    inputs), so its unit gathers and reduces in step with the other ranks of its mesh."""

    def __init__(self, experts: list[Expert]) -> None:
        super().__init__()
        self.experts = nn.ModuleList(experts)

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``tokens`` sorted by local expert, ``counts[j]`` rows for expert ``j``."""
        parts = tokens.split(counts)
        return torch.cat([expert(part) for expert, part in zip(self.experts, parts)])


class MoE(nn.Module):
    """Router (a bias-free linear, softmax, top-k), experts, gate-weighted combine."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = LocalExperts([Expert(dim, hidden) for _ in range(experts)])
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        gate, chosen = probs.topk(self.top_k, dim=-1)  # [tokens, top_k]
        # Token copies sorted by expert (stable: a deterministic order on every rank).
        order = torch.argsort(chosen.reshape(-1), stable=True)
        source_token = order // self.top_k
        routed = tokens[source_token]
        counts = torch.bincount(chosen.reshape(-1), minlength=self.num_experts)
        if self.ep_group is None:
            expert_out = self.experts(routed, counts.tolist())
        else:
            expert_out = self._exchange(routed, counts)
        weighted = expert_out * gate.reshape(-1)[order].unsqueeze(-1).to(expert_out.dtype)
        combined = torch.zeros_like(tokens).index_add(0, source_token, weighted)
        return combined.reshape(shape)

    def _exchange(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Dispatch ``routed`` (sorted by global expert) to the experts' ranks, run the local
        experts, and combine back: rows return in the order they were sent."""
        group = self.ep_group
        assert group is not None
        ep = dist.get_world_size(group)
        local = len(self.experts.experts)
        # Each rank learns how many rows every peer sends to each of its experts (no grad).
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        recv_counts = recv_counts.view(ep, local)
        send_splits = counts.view(ep, local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        received = all_to_all(routed, recv_splits, send_splits, group)
        # Received rows are grouped by source rank, then by expert; the experts want them
        # grouped by expert.
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=routed.device).repeat(ep), recv_counts.reshape(-1))
        by_expert = torch.argsort(expert_of_row, stable=True)
        out = self.experts(received[by_expert], recv_counts.sum(0).tolist())
        back = out[torch.argsort(by_expert)]
        return all_to_all(back, send_splits, recv_splits, group)


class MoEBlock(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MoE MLP."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.moe = MoE(cfg.dim, cfg.hidden, cfg.experts, cfg.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = attention_residual(self, x)
        return x + self.moe(self.ln2(x))


class MoEGPT(GPT):
    """GPT (tied embeddings, GPT-2 init) with :class:`MoEBlock` blocks holding every expert;
    :func:`keep_local_experts` turns it into one expert-parallel rank's model."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__(cfg)
        self.blocks = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.layers))
        self.reset_parameters()


def local_expert_indices(experts: int, ep_rank: int, ep: int) -> range:
    """The global indices of the experts EP rank ``ep_rank`` of ``ep`` holds, in local order:
    contiguous blocks of ``experts / ep`` (what ``megatron_fsdp_v2.checkpoint.register_experts``
    needs to store each under its global name)."""
    if experts % ep:
        raise ValueError(f"experts={experts} must be a multiple of ep={ep}")
    local = experts // ep
    return range(ep_rank * local, (ep_rank + 1) * local)


def keep_local_experts(model: MoEGPT, ep_rank: int, ep: int,
                       group: dist.ProcessGroup | None) -> None:
    """Keep the experts ``local_expert_indices(E, ep_rank, ep)`` of every block and route
    through ``group`` (the EP group, of size ``ep``; ``None`` for a local slice, as a reference
    view of one rank's experts). Call on a model built with the same seed on every rank."""
    for block in model.blocks:
        moe = block.moe
        kept = list(moe.experts.experts)
        indices = local_expert_indices(moe.num_experts, ep_rank, ep)
        moe.experts.experts = nn.ModuleList(kept[i] for i in indices)
        moe.ep_group = group
