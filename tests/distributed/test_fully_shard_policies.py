"""``fully_shard``'s grouped options (``CommPolicy``, ``ShardingPolicy``, ``InitPolicy``) train
exactly as the same values passed as flat keywords: the same losses and parameters bit for bit,
both at single-process numbers (see [Note: grouped and flat options] in
``megatron_fsdp_v2/_frontend/_policies.py``). FSDP2 has none of these options, so the control is
the single-process reference on the global batch; the cases set every field to a value other
than its default where the strategy allows it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from megatron_fsdp_v2 import CommPolicy, InitPolicy, ShardingPolicy

from _models import (
    TinyGPT,
    agree,
    assert_close_to_reference,
    lm_loss,
    local_detached,
    make_batches,
    reference_copy,
    wrap_blocks,
)
from _pool import RankPools
from _training import train_steps

TIMEOUT_S = 240
POLICIES = {"comm_policy": CommPolicy, "sharding_policy": ShardingPolicy,
            "init_policy": InitPolicy}

# strategy, the options as flat keywords
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # ZeRO-1 with coalesced reductions and refreshes, summed gradients scaled by 1/world, the
    # "auto" collectives, synchronous collectives, a loose padding bound
    "optim_buckets": ("optim", {
        "overlap": False, "timeout": 120.0, "collective_impl": "auto",
        "reduce_bucket_size_mb": 1.0, "refresh_bucket_size_mb": 1.0,
        "gradient_scaling_factor": 0.5, "max_padding_ratio": 0.5,
    }),
    # ZeRO-3 on the trace-planned pool, the mesh's own group, no padding slack, no broadcast
    # of rank 0's values and no cross-rank check (every rank seeds the same model)
    "zero3_pool": ("optim_grads_params", {
        "timeout": None, "enable_trace_pool": True, "max_padding_ratio": 0.0,
        "sync_module_states": False, "check_ranks": False,
    }),
}


def _grouped(flat: dict[str, Any]) -> dict[str, Any]:
    """The same options as policies: each field in the policy that declares it."""
    out, placed = {}, set()
    for keyword, cls in POLICIES.items():
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in flat.items() if k in names}
        if fields:
            out[keyword] = cls(**fields)
            placed |= set(fields)
    assert placed == set(flat), f"not a field of any policy: {set(flat) - placed}"
    return out


def _rank_run(rank: int, world: int, strategy: str, keywords: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT()
    ref = reference_copy(model)
    wrap_blocks(model, strategy, **keywords)
    batches = make_batches("lm", steps=2, micro=2, world=world, per_rank=2)
    losses = train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches,
                         lm_loss, rank=rank)
    train_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), batches, lm_loss, rank=None)
    agree("parameters against the single-process reference",
          lambda: assert_close_to_reference(model, ref, rtol=1e-4, atol=1e-5))
    return {"losses": [torch.stack(step) for step in losses],
            "params": {n: local_detached(p).clone() for n, p in model.named_parameters()}}


def _grouped_and_flat(rank: int, world: int, case: str) -> dict[str, Any]:
    strategy, flat = CASES[case]
    return {"flat": _rank_run(rank, world, strategy, flat),
            "grouped": _rank_run(rank, world, strategy, _grouped(flat))}


@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_options_train_as_the_flat_keywords(ranks: RankPools, case: str) -> None:
    for rank, result in enumerate(ranks.run(_grouped_and_flat, 2, case, timeout_s=TIMEOUT_S)):
        flat, grouped = result["flat"], result["grouped"]
        for step, (a, b) in enumerate(zip(flat["losses"], grouped["losses"], strict=True)):
            assert torch.equal(a, b), f"rank {rank} step {step}: flat {a} != grouped {b}"
        assert flat["params"].keys() == grouped["params"].keys()
        for name, p in flat["params"].items():
            assert torch.equal(p, grouped["params"][name]), f"rank {rank}: {name} differs"
