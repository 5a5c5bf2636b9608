"""``estimate(tp=2, tp_plan=...)`` against real FSDP x TP gloo runs on a (dp=2, tp=2) mesh.

For every strategy, fp32 and bf16 compute, 2 micro-batches: each of the 4 ranks trains the tiny
tensor-parallel model of ``_tp_common.py`` (its TP plan, then ``fully_shard`` of each block and
the root over ``mesh["dp"]``) for two marked iterations (AdamW) and records, in the second one,
``memory_report(model, opt)`` after the last backward and before ``opt.step()``, each flat
group's buffer spans, and the data-parallel collectives of the whole iteration as the groups'
own issuers counted them (``FlatParamGroup.collectives``: calls and full-buffer bytes per
kind). The TP collectives (activations, a ``Replicate()`` norm's ``Partial()`` gradient) are
the model's and not the estimate's, so ``CommDebugMode`` (which sees them too) is not the
reference here. ``estimate`` of the same configuration for rank r of a fake world of 4 with
``tp=2`` and the same plan written with wildcards must equal rank r's record exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from _tp_common import (
    STRATEGIES,
    TPBlock,
    TPModel,
    apply_tp,
    batches,
    build_model,
    dp_tp_mesh,
    loss_of,
    wrap_ours,
)
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from megatron_fsdp_v2 import MixedPrecisionPolicy, estimate, memory_report
from megatron_fsdp_v2._registry import state_of
from megatron_fsdp_v2.testing import RankPools

MICRO = 2
PRECISIONS = ["fp32", "bf16"]
# apply_tp's plan, written for the root with wildcards (the layouts of activations do not
# change a parameter's TP-local shape).
TP_PLAN = {
    "blocks.*.norm": SequenceParallel(),
    "blocks.*.up": ColwiseParallel(),
    "blocks.*.down": RowwiseParallel(),
    "embed": RowwiseParallel(input_layouts=Replicate()),
    "norm": SequenceParallel(),
    "head": ColwiseParallel(),
}


def _mp(precision: str) -> MixedPrecisionPolicy | None:
    if precision == "fp32":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=torch.float32)


def _groups(model: torch.nn.Module) -> list[tuple[str, int, Any]]:
    return [(name or "<root>", i, g) for name, m in model.named_modules()
            if (s := state_of(m)) is not None for i, g in enumerate(s.groups)]


def _one_case(rank: int, strategy: str, precision: str) -> dict[str, Any]:
    mesh = dp_tp_mesh()
    dp_rank = mesh["dp"].get_local_rank()
    model = apply_tp(build_model(), mesh["tp"])
    wrap_ours(model, mesh["dp"], strategy, mp_policy=_mp(precision))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(2, MICRO, 2)
    report = None
    for step in range(2):
        if step == 1:
            for _, _, g in _groups(model):
                g.collectives.reset()
        for i in range(MICRO):
            model.set_is_last_backward(i == MICRO - 1)  # type: ignore[operator]
            (loss_of(model, data[step, i, dp_rank]) / MICRO).backward()
        report = memory_report(model, optimizer=opt)
        opt.step()
        opt.zero_grad()
    totals = {kind: [0, 0] for kind in ("all_gather", "reduce_scatter", "all_reduce")}
    for _, _, g in _groups(model):
        for (logical, _), count in g.collectives.counts.items():
            totals[logical][0] += count.calls
            totals[logical][1] += count.bytes
    return {
        "memory": dataclasses.asdict(report),
        "collectives": {k: tuple(v) for k, v in totals.items()},
        "spans": [(u, i, g.layout.total_numel, g.plan.model_weight_span, g.plan.main_weight_span,
                   g.plan.main_grad_span) for u, i, g in _groups(model)],
    }


def _worker(rank: int, world: int) -> dict[tuple[str, str], Any]:
    results: dict[tuple[str, str], Any] = {}
    for strategy in STRATEGIES:
        for precision in PRECISIONS:
            try:
                results[(strategy, precision)] = _one_case(rank, strategy, precision)
            except Exception as e:  # noqa: BLE001 - reported per case by the test
                results[(strategy, precision)] = f"{type(e).__name__}: {e}"
    return results


_REAL: list[Any] = []


@pytest.mark.timeout(900)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tp_estimate_equals_real_run(ranks: RankPools, strategy: str, precision: str) -> None:
    if not _REAL:
        _REAL.append(ranks.run(_worker, 4, timeout_s=600))
    problems = []
    for rank in range(4):
        got = _REAL[0][rank][(strategy, precision)]
        assert not isinstance(got, str), f"rank {rank}: the real run raised {got}"
        est = estimate(TPModel, world_size=4, rank=rank, tp=2, tp_plan=TP_PLAN, wrap=(TPBlock,),
                       micro_batches=MICRO, sharding_strategy=strategy, mp_policy=_mp(precision))
        if dataclasses.asdict(est.memory) != got["memory"]:
            problems.append(f"rank {rank} memory: estimate {est.memory!r} != real {got['memory']}")
        if est.collectives != got["collectives"]:
            problems.append(f"rank {rank} collectives: estimate {est.collectives} != real "
                            f"{got['collectives']}")
        spans = [(s.unit, s.index, s.total_numel, s.model_weight_span, s.main_weight_span,
                  s.main_grad_span) for s in est.shards]
        if spans != got["spans"]:
            problems.append(f"rank {rank} spans: estimate {spans} != real {got['spans']}")
    assert not problems, "\n".join(problems)


def test_tp_arguments_checked() -> None:
    with pytest.raises(ValueError, match="needs tp_plan"):
        estimate(TPModel, world_size=4, tp=2)
    with pytest.raises(ValueError, match="dividing world_size"):
        estimate(TPModel, world_size=4, tp=3, tp_plan=TP_PLAN)
    with pytest.raises(ValueError, match="tp_plan given with tp=1"):
        estimate(TPModel, world_size=4, tp_plan=TP_PLAN)
    with pytest.raises(NotImplementedError, match="HSDP x TP"):
        estimate(TPModel, world_size=4, tp=2, tp_plan=TP_PLAN, mesh_shape=(2, 2))
