"""What the torchtitan-pattern tests share: a tiny decoder written the way torchtitan's llama3
is (token embedding, blocks, final norm, and an output head that the *loss* calls, in chunks,
outside the model's forward), its wrapping (torchtitan's ``apply_fsdp`` pattern, with our
``fully_shard`` or FSDP2's), torchtitan's gradient clipping, and a training loop that returns
losses and full parameters for comparison with single-process training.

The sizes make some parameters' shards empty on some ranks at world 3 (the 16-element row
alignment leaves a rank only padding of the head group); :func:`empty_shards` reports where.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from _models import TanhResidual

VOCAB, DIM, SEQ, BATCH = 11, 4, 5, 2


class Decoder(nn.Module):
    """torchtitan's decoder shape: the forward returns the normed hidden states; the head
    (``output``) is applied by the loss, chunk by chunk."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(TanhResidual(DIM) for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


def chunked_loss(model: Decoder, hidden: torch.Tensor, targets: torch.Tensor,
                 divisor: float, chunks: int = 2) -> torch.Tensor:
    """Sum of token cross-entropies over ``chunks`` calls of the head, divided by ``divisor``
    (torchtitan's chunked loss: the head runs outside the model's forward)."""
    total = hidden.new_zeros(())
    for h, t in zip(hidden.chunk(chunks, dim=1), targets.chunk(chunks, dim=1)):
        logits = model.output(h)
        total = total + F.cross_entropy(logits.flatten(0, 1), t.flatten(), reduction="sum")
    return total / divisor


def make_model(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder()


def apply_fsdp(model: Decoder, wrap: Callable[..., Any], **kw: Any) -> None:
    """torchtitan's ``apply_fsdp_to_decoder``: embedding, each block, ``[norm, output]`` as one
    unit that keeps its weights gathered after forward, then the root."""
    wrap(model.tok_embeddings, **kw)
    for layer in model.layers:
        wrap(layer, **kw)
    wrap([model.norm, model.output], reshard_after_forward=False, **kw)
    wrap(model, **kw)


def titan_clip(params: list[nn.Parameter], max_norm: float, norm_type: float = 2.0,
               foreach: bool | None = None) -> tuple[torch.Tensor, int]:
    """torchtitan's ``clip_grad_norm_`` (non-PP path): the norm of the gradients that are not
    ``None``, then ``clip_grads_with_norm_``. Returns the norm and how many gradients it saw."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total, len(grads)


def batches(steps: int, micro: int, world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step and micro-batch, the global (tokens, targets): ``world * BATCH`` sequences."""
    g = torch.Generator().manual_seed(5)
    return [[(torch.randint(0, VOCAB, (world * BATCH, SEQ), generator=g),
              torch.randint(0, VOCAB, (world * BATCH, SEQ), generator=g))
             for _ in range(micro)] for _ in range(steps)]


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def train(model: nn.Module, data: list[list[tuple[torch.Tensor, torch.Tensor]]], rank: int,
          world: int, summed: bool, max_norm: float = 0.5) -> dict[str, Any]:
    """AdamW on this rank's slice of every batch; ``summed``: gradients are summed over ranks
    (``set_gradient_divide_factor(1.0)``), so the loss is divided by the global token count,
    as torchtitan does; else each rank's loss is its own mean (gradients averaged).
    ``rank``/``world`` of ``None``-like 0/1: single process on the global batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, norms, counts = [], [], []
    for step in data:
        for tokens, targets in step:
            mine = slice(rank * BATCH, (rank + 1) * BATCH) if world > 1 else slice(None)
            local_tokens = targets[mine].numel()
            divisor = targets.numel() if summed else local_tokens
            divisor *= len(step)
            hidden = model(tokens[mine])
            loss = chunked_loss(model, hidden, targets[mine], divisor)  # type: ignore[arg-type]
            loss.backward()
            losses.append(loss.detach() * (1 if summed or world == 1 else 1.0 / world))
        norm, count = titan_clip(list(model.parameters()), max_norm)
        norms.append(norm.detach().float())
        counts.append(count)
        opt.step()
        opt.zero_grad()
    loss_t = torch.stack(losses)
    if world > 1:
        dist.all_reduce(loss_t)  # the global loss of each micro-batch
    return {"losses": loss_t, "norms": torch.stack(norms), "counts": counts,
            "params": {n: full(p) for n, p in model.named_parameters()}}


def reference(steps: int, micro: int, world: int) -> dict[str, Any]:
    return train(make_model(), batches(steps, micro, world), 0, 1, summed=True)


def empty_shards(model: nn.Module) -> list[str]:
    """Parameters of which this rank holds no rows (their gradient still exists, zero rows)."""
    return [n for n, p in model.named_parameters()
            if isinstance(p, DTensor) and p.to_local().numel() == 0]


def compare(got: dict[str, Any], want: dict[str, Any], what: str, rtol: float = 2e-5,
            atol: float = 2e-6) -> list[str]:
    errors = []
    for key in ("losses", "norms"):
        if not torch.allclose(got[key], want[key], rtol=rtol, atol=atol):
            errors.append(f"{what}: {key} {got[key].tolist()} vs single process "
                          f"{want[key].tolist()}")
    for name, value in want["params"].items():
        if not torch.allclose(got["params"][name], value, rtol=rtol, atol=atol):
            diff = (got["params"][name] - value).abs().max().item()
            errors.append(f"{what}: parameter {name} differs by {diff:.3g}")
    return errors


def copy_of(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
