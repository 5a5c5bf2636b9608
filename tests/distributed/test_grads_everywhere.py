"""Every rank holds a gradient of every parameter that has one anywhere, as FSDP2 (see [Note:
gradients the optimizer sees] in ``megatron_fsdp_v2/_runtime/_grad_views.py``).

At world 3 a tiny model leaves some ranks no rows of some parameters (and one rank no rows of
the root's group at all). After backward, on every rank and for every strategy: the parameters
with a gradient are the same (zero-row gradients where the shard is empty, views of
``main_grad``, so nothing is allocated for them), a parameter no rank used has none, and the
hand-written clippings of a torch user over ``[p.grad for p in params if p.grad is not None]``
issue the same collectives everywhere and give single-process torch's norm: torchtitan's
``get_total_norm`` + ``clip_grads_with_norm_`` (every p, ``foreach``), and the 2-norm written
with DTensor ops (``vector_norm`` of each gradient, stacked, ``full_tensor()``).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from megatron_fsdp_v2 import fully_shard

# private: a parameter's shard rows (record_of), to read the local gradient rows
from megatron_fsdp_v2._registry import record_of

from _models import all_ranks_ok
from _pool import RankPools

TIMEOUT_S = 240
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 5)
        self.b = nn.Linear(5, 1)
        self.unused = nn.Linear(2, 2)  # no rank calls it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def _hand_written_l2(grads: list[torch.Tensor]) -> torch.Tensor:
    norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    return total.full_tensor() if isinstance(total, DTensor) else total


def _worker(rank: int, world: int, strategy: str) -> list[str]:
    torch.manual_seed(0)
    model = Tiny()
    ref = copy.deepcopy(model)
    fully_shard(model.a, sharding_strategy=strategy, timeout=30)
    fully_shard(model, sharding_strategy=strategy, timeout=30)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 3, generator=g), torch.randn(6, 1, generator=g)
    errors: list[str] = []
    F.mse_loss(ref(x), y).backward()
    ref_grads = [p.grad for p in ref.parameters() if p.grad is not None]
    forms: list[tuple[str, float, bool | None]] = [
        ("titan", p, foreach) for p in (1.0, 2.0, math.inf) for foreach in (None, True, False)
    ] + [("dtensor_ops", 2.0, None)]
    for form, p, foreach in forms:
        model.zero_grad()
        F.mse_loss(model(x), y).backward()  # every rank the whole batch: same mean gradient
        with_grad = [n for n, q in model.named_parameters() if q.grad is not None]
        want = [n for n, q in ref.named_parameters() if q.grad is not None]
        if with_grad != want:
            errors.append(f"gradients of {with_grad}, torch has {want}")
        for name, q in model.named_parameters():
            grad = q.grad
            if isinstance(grad, DTensor) and grad.to_local().numel() == 0:
                record = record_of(q)
                main_grad = record.group.grads._main_grad  # type: ignore[union-attr]
                storage = grad.to_local().untyped_storage()
                if main_grad is None or storage.data_ptr() != main_grad.untyped_storage(
                ).data_ptr():
                    errors.append(f"{name}: the empty gradient is not a view of main_grad")
        with CommDebugMode() as comm:
            if form == "titan":
                norm = torch.nn.utils.get_total_norm(_grads(model), p, False, foreach)
                torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), 0.01, norm,
                                                     foreach)
            else:
                norm = _hand_written_l2(_grads(model))
        want_norm = torch.nn.utils.get_total_norm(ref_grads, p)
        if not torch.allclose(norm.float(), want_norm, rtol=1e-5):
            errors.append(f"{form} p={p} foreach={foreach}: norm {float(norm)} vs torch "
                          f"{float(want_norm)}")
        seen: list[Any] = [None] * world
        counts = {str(k): v for k, v in comm.get_comm_counts().items()}
        dist.all_gather_object(seen, (len(_grads(model)), counts))
        if any(s != seen[0] for s in seen):
            errors.append(f"{form} p={p} foreach={foreach}: ranks differ: {seen}")
    empty: list[Any] = [None] * world
    dist.all_gather_object(empty, [n for n, q in model.named_parameters()
                                   if isinstance(q, DTensor) and q.to_local().numel() == 0])
    if strategy != "no_shard" and not any(empty):
        errors.append("no rank holds an empty shard: the case under test did not occur")
    if not all_ranks_ok(not errors):
        errors = errors or ["failed on another rank"]
    return [f"{strategy} rank {rank}: {e}" for e in errors]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_rank_holds_every_gradient(ranks: RankPools, strategy: str) -> None:
    failures = [e for r in ranks.run(_worker, 3, strategy, timeout_s=TIMEOUT_S) for e in r]
    assert not failures, "\n".join(failures[:20])
