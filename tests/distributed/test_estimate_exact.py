"""``estimate`` against real gloo runs: memory, collectives and shard spans, bit for bit.

For world sizes 2, 3 and 4, every strategy, N in {1, 3} micro-batches, fp32 and bf16 compute
(fp32 main weights): each rank trains a tiny GPT for two iterations (a marked accumulation loop,
AdamW) and records, in the second one, ``memory_report(model, opt)`` after the last backward and
before ``opt.step()``, the collectives of the whole iteration (``CommDebugMode`` counts and
``examples/comm_counter.py`` payload bytes) and each group's buffer spans. The estimate of the
same configuration for rank r of a fake world must equal rank r's record exactly. Also on a
(2, 2) HSDP mesh, and with nested units (each block's fc1 a unit inside the block's). One task on
the session's ranks of each world size runs every case (cached); each case is a test of its own.
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

# private: the units' parameter groups the estimate is compared with
from megatron_fsdp_v2._registry import state_of
from megatron_fsdp_v2.testing import RankPools, release_process_groups

from _comm_counts import COLLECTIVE_KINDS, CollectiveCounts
from _models import Block, TinyGPT, lm_loss, make_batches

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from comm_counter import CommCounter  # noqa: E402

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
MICRO = [1, 3]
PRECISIONS = ["fp32", "bf16", "bf16comm"]
WORLDS = [2, 3, 4]
# HSDP on a (2, 2) mesh: outer no_shard under every inner strategy, outer optim under ZeRO-3.
HSDP = [("no_shard", s) for s in STRATEGIES] + [("optim", "optim_grads_params")]
MESH = (2, 2)
CASES = [(s, n, p, None, False) for s in STRATEGIES for n in MICRO for p in PRECISIONS]
HSDP_CASES = [(s, n, p, outer, False) for outer, s in HSDP for n in MICRO for p in PRECISIONS]
# Nested units: each block's MLP input layer is a unit of its own inside the block's unit.
NESTED_CASES = [(s, 3, "bf16comm", None, True) for s in STRATEGIES]


def _model() -> TinyGPT:
    return TinyGPT(vocab=37, dim=16, layers=3, heads=2)


def _mp(precision: str) -> MixedPrecisionPolicy | None:
    """fp32; bf16 compute with fp32 main weights; the same reducing gradients in bf16 (the
    grad_comm / outer_comm workspaces and bf16 reduce-scatter inputs)."""
    if precision == "fp32":
        return None
    comm = torch.bfloat16 if precision == "bf16comm" else None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=torch.float32,
                                grad_comm_dtype=comm)


def _spans(model: torch.nn.Module) -> list[tuple[Any, ...]]:
    return [
        (name or "<root>", i, g.layout.total_numel, g.plan.model_weight_span,
         g.plan.main_weight_span, g.plan.main_grad_span)
        for name, m in model.named_modules() if (s := state_of(m)) is not None
        for i, g in enumerate(s.groups)
    ]


def _is_unit(nested: bool) -> Any:
    """``wrap`` for ``estimate``: the blocks, and with ``nested`` their ``fc1`` too."""
    if not nested:
        return (Block,)
    return lambda m: isinstance(m, Block) or (
        isinstance(m, torch.nn.Linear) and tuple(m.weight.shape) == (64, 16)  # fc1: 4 * dim
    )


def _one_case(rank: int, world: int, strategy: str, micro: int, precision: str,
              outer: str | None, nested: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _model()
    options: dict[str, Any] = dict(sharding_strategy=strategy, mp_policy=_mp(precision))
    if outer is not None:
        options["mesh"] = init_device_mesh("cpu", MESH, mesh_dim_names=("replicate", "shard"))
        options["outer_dp_sharding_strategy"] = outer
    for block in model.blocks:
        if nested:
            fully_shard(block.fc1, **options)
        fully_shard(block, **options)
    fully_shard(model, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = make_batches("lm", 2, micro, world, per_rank=2)
    out: dict[str, Any] = {}
    _iteration(model, opt, batches[0], micro, rank)  # unrecorded: the modes cost half the case
    with CollectiveCounts() as comm, CommCounter() as counter:
        report = _iteration(model, opt, batches[1], micro, rank)
    counts = {str(k).split(".")[-1].rstrip("_"): v for k, v in comm.get_comm_counts().items()}
    out["memory"] = dataclasses.asdict(report)
    out["counts"] = {kind: sum(counts.get(n, 0) for n in names)
                     for kind, names in COLLECTIVE_KINDS.items()}
    out["other_counts"] = {
        k: v for k, v in counts.items()
        if not any(k in names for names in COLLECTIVE_KINDS.values())
    }
    out["bytes"] = {k: counter.stats.payload_bytes.get(k, 0) for k in COLLECTIVE_KINDS}
    out["counter_calls"] = dict(counter.stats.calls)
    out["spans"] = _spans(model)
    return out


def _iteration(model: torch.nn.Module, opt: torch.optim.Optimizer, micro_batches: Any,
               micro: int, rank: int) -> Any:
    """One training iteration; the memory report after the last backward, before the step."""
    for i in range(micro):
        model.set_is_last_backward(i == micro - 1)  # type: ignore[operator]
        (lm_loss(model, micro_batches[i][rank]) / micro).backward()
    report = memory_report(model, optimizer=opt)
    opt.step()
    opt.zero_grad()
    return report


def _worker(rank: int, world: int) -> dict[tuple[Any, ...], Any]:
    results: dict[tuple[Any, ...], Any] = {}
    for case in CASES + (HSDP_CASES if world == MESH[0] * MESH[1] else []) + (
        NESTED_CASES if world == 2 else []
    ):
        release_process_groups()  # the HSDP cases' meshes, one set per case
        try:
            results[case] = _one_case(rank, world, *case)
        except Exception as e:  # noqa: BLE001 - reported per case by the test
            results[case] = f"{type(e).__name__}: {e}"
    return results


_REAL: dict[int, list[dict[tuple[Any, ...], Any]]] = {}


def _real(ranks: RankPools, world: int) -> list[dict[tuple[Any, ...], Any]]:
    """Every case of ``world``, run once on the session's ranks of that size."""
    if world not in _REAL:
        _REAL[world] = ranks.run(_worker, world, timeout_s=600)
    return _REAL[world]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("micro", MICRO, ids=lambda n: f"N{n}")
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"world{w}")
def test_estimate_equals_real_run(ranks: RankPools, world: int, strategy: str, micro: int,
                                  precision: str) -> None:
    _compare(ranks, world, (strategy, micro, precision, None, False))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nested_units_estimate_equals_real_run(ranks: RankPools, strategy: str) -> None:
    _compare(ranks, 2, (strategy, 3, "bf16comm", None, True))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("micro", MICRO, ids=lambda n: f"N{n}")
@pytest.mark.parametrize(("outer", "strategy"), HSDP, ids=[f"outer_{o}-{s}" for o, s in HSDP])
def test_hsdp_estimate_equals_real_run(ranks: RankPools, outer: str, strategy: str, micro: int,
                                       precision: str) -> None:
    _compare(ranks, MESH[0] * MESH[1], (strategy, micro, precision, outer, False))


def _compare(ranks: RankPools, world: int, case: tuple[Any, ...]) -> None:
    strategy, micro, precision, outer, nested = case
    real = _real(ranks, world)
    problems = []
    for rank in range(world):
        got = real[rank][case]
        assert not isinstance(got, str), f"rank {rank}: the real run raised {got}"
        hsdp: dict[str, Any] = {}
        if outer is not None:
            hsdp = dict(mesh_shape=MESH, outer_dp_sharding_strategy=outer)
        est = estimate(_model, world_size=world, rank=rank, wrap=_is_unit(nested),
                       micro_batches=micro,
                       sharding_strategy=strategy, mp_policy=_mp(precision), **hsdp)
        if dataclasses.asdict(est.memory) != got["memory"]:
            problems.append(f"rank {rank} memory: estimate {est.memory!r} != real {got['memory']}")
        counts = {k: c for k, (c, _) in est.collectives.items()}
        payload = {k: b for k, (_, b) in est.collectives.items()}
        if counts != got["counts"]:
            problems.append(f"rank {rank} counts: estimate {counts} != CommDebugMode "
                            f"{got['counts']}")
        if payload != got["bytes"]:
            problems.append(f"rank {rank} bytes: estimate {payload} != CommCounter {got['bytes']}")
        seen = {k: v for k, v in got["counter_calls"].items() if v}
        if seen != {k: v for k, v in counts.items() if v}:
            problems.append(f"rank {rank}: CommCounter saw {got['counter_calls']}")
        if got["other_counts"]:
            problems.append(f"rank {rank}: unmodelled collectives {got['other_counts']}")
        spans = [(s.unit, s.index, s.total_numel, s.model_weight_span, s.main_weight_span,
                  s.main_grad_span) for s in est.shards]
        if spans != got["spans"]:
            problems.append(f"rank {rank} spans: estimate {spans} != real {got['spans']}")
    assert not problems, "\n".join(problems)
