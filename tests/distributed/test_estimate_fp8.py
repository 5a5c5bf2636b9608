"""``estimate(float8=True)`` against real gloo runs of a torchao float8 model with FP8
all-gathers (design.md §3 "FP8 parameters", [Note: estimating FP8 parameters]).

Each rank converts the blocks' linears of a tiny GPT to torchao float8 training with
``enable_fsdp_float8_all_gather=True`` (the estimator's own conversion, so both sides hold the
same FP8 parameters), wraps the blocks and the root, calls ``precompute_float8_dynamic_scale_
for_fsdp`` after wrapping and after every step, and trains two marked iterations of 2
micro-batches in bf16; in the second one it records ``memory_report(model, opt)`` after the last
backward and before ``opt.step()`` (``fp8_weights``, ``fp8_scales`` and the FP8 scratch in
``temporary_peak`` included) and the collectives of the whole iteration, the precompute's
all-reduce included (``CommDebugMode`` counts and ``examples/comm_counter.py`` payload bytes,
the FP8 bytes moved as ``uint8``). The estimate of rank r must equal rank r's record exactly:
every strategy at world 2, at world 3 (uneven rows: a rank with no row of a weight) the two
strategies that gather FP8 weights (the persistent buffer of ``optim``, ZeRO-3's scratch), and
on a (2, 2) HSDP mesh ``optim`` with outer ``no_shard`` and ZeRO-3 with outer ``optim`` (the
FP8 inner shard and its outer refresh).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp_v2 import MixedPrecisionPolicy, estimate, fully_shard, memory_report
from megatron_fsdp_v2.estimator._fp8 import convert_to_float8
from megatron_fsdp_v2.testing import release_process_groups

from _comm_counts import COLLECTIVE_KINDS, CollectiveCounts
from _models import Block, TinyGPT, lm_loss, make_batches
from _pool import RankPools

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from comm_counter import CommCounter  # noqa: E402

pytest.importorskip("torchao")

MICRO = 2
MESH = (2, 2)
# world -> (strategy, outer strategy on the (2, 2) mesh or None for a 1-D mesh)
CASES = {2: [(s, None) for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")],
         3: [("optim", None), ("optim_grads_params", None)],
         4: [("optim", "no_shard"), ("optim_grads_params", "optim")]}


def _model() -> TinyGPT:
    return TinyGPT(vocab=37, dim=16, layers=2, heads=2)  # every block linear: dims % 16 == 0


def _mp() -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=torch.float32)


def _options(strategy: str, outer: str | None) -> dict[str, Any]:
    if outer is None:
        return dict(sharding_strategy=strategy, mp_policy=_mp())
    return dict(sharding_strategy=strategy, mp_policy=_mp(), outer_dp_sharding_strategy=outer)


def _one_case(rank: int, world: int, strategy: str, outer: str | None) -> dict[str, Any]:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    torch.manual_seed(0)
    model = _model()
    convert_to_float8(model, lambda m: isinstance(m, Block))
    options = _options(strategy, outer)
    if outer is not None:
        options["mesh"] = init_device_mesh("cpu", MESH, mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    precompute_float8_dynamic_scale_for_fsdp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = make_batches("lm", 2, MICRO, world, per_rank=2)

    def iteration(step: int) -> Any:
        for i in range(MICRO):
            model.set_is_last_backward(i == MICRO - 1)  # type: ignore[operator]
            (lm_loss(model, batches[step][i][rank]) / MICRO).backward()
        report = memory_report(model, optimizer=opt)
        opt.step()
        opt.zero_grad()
        precompute_float8_dynamic_scale_for_fsdp(model)
        return report

    iteration(0)
    with CollectiveCounts() as comm, CommCounter() as counter:
        report = iteration(1)
    counts = {str(k).split(".")[-1].rstrip("_"): v for k, v in comm.get_comm_counts().items()}
    return {
        "memory": dataclasses.asdict(report),
        "counts": {kind: sum(counts.get(n, 0) for n in names)
                   for kind, names in COLLECTIVE_KINDS.items()},
        "bytes": {k: counter.stats.payload_bytes.get(k, 0) for k in COLLECTIVE_KINDS},
        "calls": {k: v for k, v in counter.stats.calls.items() if v},
    }


def _worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy, outer in CASES[world]:
        release_process_groups()  # each case's meshes
        try:
            out[strategy] = _one_case(rank, world, strategy, outer)
        except Exception as e:  # noqa: BLE001 - reported per case by the test
            out[strategy] = f"{type(e).__name__}: {e}"
    return out


_REAL: dict[int, list[dict[str, Any]]] = {}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("world", "strategy", "outer"),
                         [(w, s, o) for w, cases in CASES.items() for s, o in cases])
def test_fp8_estimate_equals_real_run(ranks: RankPools, world: int, strategy: str,
                                      outer: str | None) -> None:
    if world not in _REAL:  # every case of this world size in one task on its ranks
        _REAL[world] = ranks.run(_worker, world, timeout_s=400)
    problems = []
    for rank in range(world):
        got = _REAL[world][rank][strategy]
        assert not isinstance(got, str), f"rank {rank}: the real run raised {got}"
        hsdp = {} if outer is None else dict(mesh_shape=MESH, outer_dp_sharding_strategy=outer)
        est = estimate(_model, world_size=world, rank=rank, wrap=(Block,), micro_batches=MICRO,
                       float8=True, **_options(strategy, None), **hsdp)
        memory = dataclasses.asdict(est.memory)
        if memory != got["memory"]:
            problems.append(f"rank {rank} memory: estimate {memory} != real {got['memory']}")
        counts = {k: c for k, (c, _) in est.collectives.items()}
        payload = {k: b for k, (_, b) in est.collectives.items()}
        if counts != got["counts"] or {k: c for k, c in counts.items() if c} != got["calls"]:
            problems.append(f"rank {rank} counts: estimate {counts} != real {got['counts']} "
                            f"(CommCounter {got['calls']})")
        if payload != got["bytes"]:
            problems.append(f"rank {rank} bytes: estimate {payload} != real {got['bytes']}")
    assert not problems, "\n".join(problems)
    # Not vacuous: the FP8 buffers and scales are in the compared reports.
    memory = _REAL[world][0][strategy]["memory"]
    assert memory["fp8_scales"] > 0, memory
    assert (memory["fp8_weights"] > 0) == (strategy in ("optim", "optim_grads")
                                           or outer == "optim"), memory
