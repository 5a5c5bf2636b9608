"""The bucket-size arguments (``reduce_bucket_size_mb``, ``refresh_bucket_size_mb``): invalid
sizes fail clearly, HSDP refuses them, and the ranks must agree on them.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from test_coalescing import (
    TIMEOUT_S,
)

from megatron_fsdp_v2 import fully_shard

# private: a refused wrap leaves no unit state behind (state_of(module) is None)
from megatron_fsdp_v2._registry import state_of

from _comm_counts import CollectiveCounts

# Both bucket options (reduce_bucket_size_mb, refresh_bucket_size_mb; see [Note: refresh
# buckets]) share their argument rules; each with a strategy it affects.
OPTIONS = [("reduce_bucket_size_mb", "no_shard"), ("refresh_bucket_size_mb", "optim")]


def _invalid_sizes(rank: int, world: int, option: str, strategy: str) -> list[str]:
    out = []
    for value, error in [(0, ValueError), (-1.0, ValueError), (math.nan, ValueError),
                         (math.inf, ValueError), (True, TypeError), ("25", TypeError)]:
        model = nn.Linear(4, 4)
        before = model.weight.detach().clone()
        with pytest.raises(error, match=option):
            fully_shard(model, sharding_strategy=strategy, **{option: value})
        assert state_of(model) is None and torch.equal(model.weight, before)
        out.append(repr(value))
    # Units of one model must agree: raised at the first forward, before any collective.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], sharding_strategy=strategy, **{option: 1.0})
    fully_shard(model, sharding_strategy=strategy)
    with CollectiveCounts() as comm, pytest.raises(ValueError, match="same for every fully_shard"):
        model(torch.randn(2, 4))
    assert comm.get_total_counts() == 0
    return out


def _hsdp_refused(rank: int, world: int, option: str, strategy: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = nn.Linear(4, 4)
    with pytest.raises(NotImplementedError, match=option):
        fully_shard(model, mesh=mesh, sharding_strategy=strategy, **{option: 1.0})
    assert state_of(model) is None


def _agrees_across_ranks(rank: int, world: int, option: str, strategy: str) -> None:
    """Ranks passing different sizes fail the wrap-time cross-rank check on every rank."""
    model = nn.Linear(4, 4)
    with pytest.raises((RuntimeError, ValueError), match=option):
        fully_shard(model, sharding_strategy=strategy, **{option: 1.0 if rank == 0 else None})
    dist.barrier()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("option,strategy", OPTIONS, ids=[o for o, _ in OPTIONS])
def test_invalid_bucket_size(ranks: Any, option: str, strategy: str) -> None:
    ranks.run(_invalid_sizes, 2, option, strategy, timeout_s=TIMEOUT_S)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("option,strategy", OPTIONS, ids=[o for o, _ in OPTIONS])
def test_hsdp_refused(ranks: Any, option: str, strategy: str) -> None:
    ranks.run(_hsdp_refused, 2, option, strategy, timeout_s=TIMEOUT_S)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("option,strategy", OPTIONS, ids=[o for o, _ in OPTIONS])
def test_ranks_must_agree(ranks: Any, option: str, strategy: str) -> None:
    ranks.run(_agrees_across_ranks, 2, option, strategy, timeout_s=TIMEOUT_S)
