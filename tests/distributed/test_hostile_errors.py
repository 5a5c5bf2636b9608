"""Hostile use that must fail fast and clearly, or train right ("No silent wrong, round 4",
items 8, 10, 12, 13): ``fully_shard`` arguments that differ between ranks are caught by the
wrap-time rank check; optimizers that are not elementwise, and gradient penalties
(``create_graph=True``), train exactly like single-process PyTorch or are refused at their
first step naming what works; a collective issued outside the step (a full state dict) that
some rank does not join fails within seconds naming that rank and the call, not after the
transport's timeout.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from _bad_input import expect_rejected
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp_v2 import fully_shard
from megatron_fsdp_v2.testing import RankPools

# A wrap that leaves a collective unmatched waits this long before the transport raises; every
# check here must answer well before it.
_WRAP_TIMEOUT_S = 20.0


# ---------------------------------------------------------------------- 8. rank check


def _outer_strategy_disagrees(rank: int, world: int) -> None:
    """HSDP (2 x 2): rank 0 asks for outer ``optim``, the others for ``no_shard``. Every rank
    raises the rank check's error naming the argument, before any group is created for it."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    outer = "optim" if rank == 0 else "no_shard"
    start = time.monotonic()
    expect_rejected(
        lambda: nn.Linear(4, 4),
        lambda m: fully_shard(m, mesh=mesh, outer_dp_sharding_strategy=outer,
                              timeout=_WRAP_TIMEOUT_S),
        ValueError,
        r"ranks disagree on what fully_shard wraps: rank 0 has 'outer_dp_sharding_strategy: "
        r"optim' but rank \d has 'outer_dp_sharding_strategy: no_shard'.*every rank must wrap "
        r"the same model",
        collectives=True,
    )
    elapsed = time.monotonic() - start
    assert elapsed < _WRAP_TIMEOUT_S / 2, f"raised after {elapsed:.1f}s: a collective timed out"
    # The ranks are still in step: the same wrap everywhere works.
    model = fully_shard(nn.Linear(4, 4), mesh=mesh, outer_dp_sharding_strategy="optim",
                        timeout=_WRAP_TIMEOUT_S)
    model(torch.ones(2, 4)).sum().backward()
    dist.barrier()


def test_outer_strategy_disagreement_is_caught(ranks: RankPools) -> None:
    """Item 8: ``outer_dp_sharding_strategy`` is in the wrap-time rank check."""
    ranks.run(_outer_strategy_disagrees, 4, timeout_s=90)
