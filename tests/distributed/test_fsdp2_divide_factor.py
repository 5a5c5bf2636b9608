"""FSDP2's gradient-scaling methods on fully_shard units: ``set_gradient_divide_factor`` (per
unit, reached through ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` as torchtitan does),
``set_reduce_scatter_divide_factor`` and ``set_force_sum_reduction_for_comms``, for every
strategy on 2 and 3 ranks (uneven and empty shards), 2 micro-batches per step, with reduction
buckets, and on an HSDP mesh: the same parameters and losses as FSDP2 given the same calls, and
as single-process training with the correspondingly scaled gradient (see ``_divide_factor.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _divide_factor import divide_factor_worker, expert_worker
from _fsdp2_api import TIMEOUT_S, _net
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp_v2 import fully_shard

from _pool import RankPools

pytestmark = pytest.mark.timeout(900)

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
CASES = ["sum_isinstance", "per_unit", "force_sum", "force_sum_and_factor", "deprecated_alias"]


def _check(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        for name in ("ours", "fsdp2"):
            assert not r[name]["errors"], (
                f"rank {rank} {name} vs reference:\n" + "\n".join(r[name]["errors"][:4])
            )
        torch.testing.assert_close(r["ours"]["losses"], r["fsdp2"]["losses"], rtol=1e-5,
                                   atol=1e-7, msg=lambda m: f"rank {rank} losses vs FSDP2: {m}")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_divide_factor_matches_fsdp2_and_reference(
    ranks: RankPools, strategy: str, world: int, case: str
) -> None:
    _check(ranks.run(divide_factor_worker, world, strategy, case, timeout_s=TIMEOUT_S))


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_divide_factor_per_unit_in_one_reduction_bucket(ranks: RankPools, strategy: str) -> None:
    """Units with different factors whose delayed reductions are coalesced: buckets never mix
    scales, so each unit keeps its own."""
    _check(ranks.run(divide_factor_worker, 3, strategy, "per_unit_coalesced",
                     timeout_s=TIMEOUT_S))


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
@pytest.mark.parametrize("case", ["per_unit", "force_sum"])
def test_divide_factor_hsdp(ranks: RankPools, case: str, outer: str) -> None:
    """On a 2x2 HSDP mesh the factor divides the sum over both axes, as FSDP2's HSDP."""
    inner = "optim" if outer == "no_shard" else "optim_grads_params"  # outer optim needs ZeRO-3
    _check(ranks.run(divide_factor_worker, 4, inner, case, 2, outer,
                     timeout_s=TIMEOUT_S))


def _errors_worker(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,))
    model, _ = _net()
    fully_shard(model, mesh=mesh)
    found = []
    for bad, exc in [(0.0, ValueError), (-2.0, ValueError), (float("inf"), ValueError),
                     ("2", TypeError), (True, TypeError)]:
        try:
            model.set_gradient_divide_factor(bad)  # type: ignore[arg-type]
            found.append(f"{bad!r}: no error")
        except exc:
            pass
    # Changing the factor while gradients of an open window wait for their reduction.
    model.set_requires_gradient_sync(False)
    model(torch.randn(3, 5)).sum().backward()
    try:
        model.set_gradient_divide_factor(7.0)
        found.append("mid-window change: no error")
    except RuntimeError as e:
        if "accumulation window" not in str(e):
            found.append(f"mid-window message: {e}")
    dist.barrier()
    return found


def test_divide_factor_bad_input(ranks: RankPools) -> None:
    for rank, found in enumerate(ranks.run(_errors_worker, 2, timeout_s=TIMEOUT_S)):
        assert not found, f"rank {rank}: {found}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_experts_on_a_sub_mesh_with_divide_factor(ranks: RankPools, strategy: str) -> None:
    """torchtitan's experts: a unit on the expert-data-parallel sub-mesh whose gradient is
    divided by the world size (the mean over every rank's loss), dense units on the whole mesh."""
    for rank, r in enumerate(ranks.run(expert_worker, 4, strategy, timeout_s=TIMEOUT_S)):
        for name, errors in r.items():
            assert not errors, f"rank {rank} {name}: " + "\n".join(errors[:4])
