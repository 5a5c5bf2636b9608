"""``estimate(tp=2, tp_plan=...)`` against real FSDP x TP gloo runs on a (dp=2, tp=2) mesh, and
with ``mesh_shape=(2, 1)`` against HSDP x TP runs on a (replicate=2, shard=1, tp=2) mesh.

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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from megatron_fsdp_v2 import MixedPrecisionPolicy, estimate, memory_report

# private: the units' parameter groups the estimate is compared with
from megatron_fsdp_v2._registry import state_of
from megatron_fsdp_v2.testing import RankPools, release_process_groups

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


def _one_case(rank: int, strategy: str, precision: str, outer: str | None = None
              ) -> dict[str, Any]:
    """``outer``: HSDP x TP on a (replicate 2, shard 1, tp 2) mesh with that outer strategy
    (4 ranks: the outer reductions and the sub-shards of outer optim over TP-local tensors)."""
    if outer is None:
        mesh = dp_tp_mesh()
        dp_mesh, dp_rank, kw = mesh["dp"], mesh["dp"].get_local_rank(), {}
    else:
        # DTensor's sharding caches would hand parallelize_module the equal "tp" mesh of the
        # (dp, tp) cases before, whose root mesh is not this one's (fully_shard refuses that).
        _clear_sharding_prop_cache()
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
        dp_mesh, dp_rank = mesh["replicate", "shard"], mesh.get_local_rank("replicate")
        kw = {"outer_dp_sharding_strategy": outer}
    model = apply_tp(build_model(), mesh["tp"])
    wrap_ours(model, dp_mesh, strategy, mp_policy=_mp(precision), **kw)
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


# HSDP x TP cases (strategy, precision, outer), run in the same pool task as the others.
HSDP_CASES = [("optim_grads", "bf16", "no_shard"), ("optim_grads_params", "fp32", "optim")]


def _worker(rank: int, world: int) -> dict[tuple[str, ...], Any]:
    results: dict[tuple[str, ...], Any] = {}
    cases = [(s, p) for s in STRATEGIES for p in PRECISIONS] + HSDP_CASES
    for case in cases:
        release_process_groups()  # each case's meshes
        try:
            results[case] = _one_case(rank, *case)
        except Exception as e:  # noqa: BLE001 - reported per case by the test
            results[case] = f"{type(e).__name__}: {e}"
    return results


_REAL: list[Any] = []


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", [(s, p) for s in STRATEGIES for p in PRECISIONS] + HSDP_CASES,
                         ids=lambda c: "-".join(c if len(c) == 2 else (*c[:2], "hsdp", c[2])))
def test_tp_estimate_equals_real_run(ranks: RankPools, case: tuple[str, ...]) -> None:
    if not _REAL:
        _REAL.append(ranks.run(_worker, 4, timeout_s=600))
    strategy, precision = case[:2]
    hsdp: dict[str, Any] = {} if len(case) == 2 else {"mesh_shape": (2, 1),
                                                        "outer_dp_sharding_strategy": case[2]}
    problems = []
    for rank in range(4):
        got = _REAL[0][rank][case]
        assert not isinstance(got, str), f"rank {rank}: the real run raised {got}"
        est = estimate(TPModel, world_size=4, rank=rank, tp=2, tp_plan=TP_PLAN, wrap=(TPBlock,),
                       micro_batches=MICRO, sharding_strategy=strategy, mp_policy=_mp(precision),
                       **hsdp)
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
    with pytest.raises(ValueError, match=r"R \* S == world_size \(4\) // tp \(2\)"):
        estimate(TPModel, world_size=4, tp=2, tp_plan=TP_PLAN, mesh_shape=(2, 2))
