"""The buffer plan (``_plan.py``) against design.md's tables (§3 buffers per strategy, §4 the
collective schedule): the plan is the only place a strategy turns into buffer decisions."""

from __future__ import annotations

import pytest
import torch

from megatron_fsdp_v2._buffers._layout import build_layout
from megatron_fsdp_v2._buffers._plan import Collective, Extent, GradPath, Refresh, make_plan
from megatron_fsdp_v2.api import MixedPrecisionPolicy, ShardingStrategy

FULL, SHARD, SUB = Extent.FULL, Extent.SHARD, Extent.SUB_SHARD
ACC, EACH = GradPath.ACCUMULATE_THEN_REDUCE, GradPath.REDUCE_EACH_MICRO_BATCH
AR, RS, AG = Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.ALL_GATHER

# strategy: (model_weight, main_weight, main_grad, gathers, grad path, reduction,
#            refresh with one dtype, refresh with bf16 compute + fp32 main)
TABLE = {
    "no_shard": (FULL, FULL, FULL, False, ACC, AR, Refresh.NONE, Refresh.CAST),
    "optim": (FULL, SHARD, FULL, False, ACC, RS, Refresh.CAST_OWN_SLOT_THEN_GATHER,
              Refresh.CAST_OWN_SLOT_THEN_GATHER),
    "optim_grads": (FULL, SHARD, SHARD, False, EACH, RS, Refresh.CAST_OWN_SLOT_THEN_GATHER,
                    Refresh.CAST_OWN_SLOT_THEN_GATHER),
    "optim_grads_params": (SHARD, SHARD, SHARD, True, EACH, RS, Refresh.NONE,
                           Refresh.CAST_AT_GATHER),
}

LAYOUT = build_layout([torch.Size([7, 5]), torch.Size([3])], 3)  # 3 ranks, uneven
SAME = MixedPrecisionPolicy().resolve(torch.float32)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16).resolve(torch.float32)


@pytest.mark.parametrize("strategy", list(TABLE))
@pytest.mark.parametrize("dtypes", [SAME, BF16], ids=["fp32", "bf16_compute_fp32_main"])
def test_plan_matches_design_table(strategy: str, dtypes) -> None:
    model, main, grad, gathers, path, reduce_op, refresh_same, refresh_mixed = TABLE[strategy]
    plan = make_plan(ShardingStrategy.parse(strategy), dtypes, LAYOUT, rank=1)
    assert (plan.model_weight, plan.main_weight, plan.main_grad) == (model, main, grad)
    assert plan.optimizer_placement is main  # Shard(0) iff main weights are sharded
    assert plan.gathers_weights is gathers
    assert plan.grad_path is path
    assert [s.op for s in plan.reduce_steps] == [reduce_op]
    separate = dtypes is BF16
    assert plan.main_weight_separate is separate
    assert plan.refresh is (refresh_mixed if separate else refresh_same)
    # One all-gather per iteration for ZeRO-1/2 (the refresh), two per micro-batch for ZeRO-3.
    assert [s.op for s in plan.refresh_steps] == (
        [AG] if plan.refresh is Refresh.CAST_OWN_SLOT_THEN_GATHER else []
    )
    assert [s.op for s in plan.gather_steps] == ([AG] if gathers else [])
    assert all(
        s.axis == "shard"
        for s in (*plan.reduce_steps, *plan.refresh_steps, *plan.gather_steps)
    )


@pytest.mark.parametrize("strategy", list(TABLE))
def test_plan_spans(strategy: str) -> None:
    plan = make_plan(ShardingStrategy.parse(strategy), SAME, LAYOUT, rank=1)
    full, shard = (0, LAYOUT.total_numel), LAYOUT.shard_range(1)
    assert plan.shard_span == shard
    span = {FULL: full, SHARD: shard}
    assert plan.model_weight_span == span[plan.model_weight]
    assert plan.main_weight_span == span[plan.main_weight]
    assert plan.main_grad_span == span[plan.main_grad]


def test_temporaries() -> None:
    def temporaries(strategy: str, dtypes=SAME) -> tuple[str, ...]:
        return make_plan(ShardingStrategy.parse(strategy), dtypes, LAYOUT, 0).temporaries

    assert temporaries("optim_grads_params") == ("unsharded_model_weight", "staged_grad")
    assert temporaries("optim_grads") == ("staged_grad",)
    # The accumulate path reduces in place unless the reduction dtype differs.
    assert "grad_comm" not in temporaries("no_shard")
    comm_bf16 = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16).resolve(torch.float32)
    assert "grad_comm" in temporaries("optim", comm_bf16)
    assert make_plan(ShardingStrategy.NO_SHARD, SAME, LAYOUT, 0).reduces_in_place
    assert not make_plan(ShardingStrategy.OPTIM, comm_bf16, LAYOUT, 0).reduces_in_place


@pytest.mark.parametrize("strategy", list(TABLE))
def test_hsdp_outer_no_shard_adds_one_window_step(strategy: str) -> None:
    """HSDP adds steps, not branches: the inner plan is unchanged and an outer no_shard axis
    adds one all-reduce over "outer" at the end of each window; a 1-D mesh has none."""
    inner = make_plan(ShardingStrategy.parse(strategy), SAME, LAYOUT, 1)
    assert inner.window_steps == ()
    hsdp = make_plan(ShardingStrategy.parse(strategy), SAME, LAYOUT, 1,
                     outer=ShardingStrategy.NO_SHARD)
    assert [(s.op, s.axis) for s in hsdp.window_steps] == [(AR, "outer")]
    for field in ("model_weight", "main_weight", "main_grad", "optimizer_placement", "grad_path",
                  "reduce_steps", "refresh_steps", "gather_steps", "main_grad_span"):
        assert getattr(hsdp, field) == getattr(inner, field), field
    assert hsdp.temporaries == (*inner.temporaries, "window_carry")
    comm_bf16 = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16).resolve(torch.float32)
    assert "outer_comm" in make_plan(ShardingStrategy.parse(strategy), comm_bf16, LAYOUT, 1,
                                     outer=ShardingStrategy.NO_SHARD).temporaries
    assert hsdp.window_grad_span is None and hsdp.norm_axis == inner.norm_axis == "shard"
    if strategy != "optim_grads_params":
        with pytest.raises(ValueError, match="needs sharding_strategy='optim_grads_params'"):
            make_plan(ShardingStrategy.parse(strategy), SAME, LAYOUT, 1,
                      outer=ShardingStrategy.OPTIM, outer_size=1)


SUB_LAYOUT = build_layout([torch.Size([7, 5]), torch.Size([3])], 3 * 2)  # S=3 x R=2 sub-shards


@pytest.mark.parametrize("dtypes", [SAME, BF16], ids=["fp32", "bf16_compute_fp32_main"])
@pytest.mark.parametrize("rank,outer_rank", [(0, 0), (1, 1), (2, 0)])
def test_hsdp_outer_optim_plan(dtypes, rank: int, outer_rank: int) -> None:
    """Outer optim over inner ZeRO-3: the layout is over R*S sub-shards; inner shard s is
    sub-shards [s*R, (s+1)*R) and this rank's main weights and grads are sub-shard s*R + r.
    Steps, not branches: an inner reduce-scatter per micro-batch into the window_grad bucket
    (the inner shard), one outer reduce-scatter per window into main_grad, one outer all-gather
    refresh before the inner gathers; norms over the whole mesh."""
    plan = make_plan(ShardingStrategy.OPTIM_GRADS_PARAMS, dtypes, SUB_LAYOUT, rank,
                     outer=ShardingStrategy.OPTIM, outer_rank=outer_rank, outer_size=2)
    sub = SUB_LAYOUT.shard_numel
    inner = (rank * 2 * sub, (rank + 1) * 2 * sub)
    own = SUB_LAYOUT.shard_range(rank * 2 + outer_rank)
    assert own == (inner[0] + outer_rank * sub, inner[0] + (outer_rank + 1) * sub)
    assert (plan.model_weight, plan.main_weight, plan.main_grad) == (SHARD, SUB, SUB)
    assert plan.optimizer_placement is SUB
    assert (plan.model_weight_span, plan.shard_span, plan.window_grad_span) == (inner,) * 3
    assert plan.main_weight_span == plan.main_grad_span == own
    assert plan.gathers_weights and plan.grad_path is EACH
    assert plan.main_weight_separate is (dtypes is BF16)
    # Cast own slot (a no-op when main aliases model), then the outer all-gather, always: the
    # optimizer updates only this rank's sub-shard of the inner shard.
    assert plan.refresh is Refresh.CAST_OWN_SLOT_THEN_OUTER_GATHER
    steps = {name: [(s.op, s.axis) for s in getattr(plan, name)]
             for name in ("reduce_steps", "window_steps", "refresh_steps", "gather_steps")}
    assert steps == {
        "reduce_steps": [(RS, "shard")],
        "window_steps": [(RS, "outer")],
        "refresh_steps": [(AG, "outer")],
        "gather_steps": [(AG, "shard")],
    }
    assert plan.norm_axis == "mesh"
    assert plan.temporaries == ("unsharded_model_weight", "staged_grad", "window_grad",
                                "window_carry")
    # Gathered weights (ZeRO-3): gradients are staged (see [Note: gradients in place]).
    assert not plan.grads_in_place
    comm_bf16 = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16).resolve(torch.float32)
    assert "outer_comm" in make_plan(ShardingStrategy.OPTIM_GRADS_PARAMS, comm_bf16, SUB_LAYOUT,
                                     rank, outer=ShardingStrategy.OPTIM, outer_rank=outer_rank,
                                     outer_size=2).temporaries
    # 1-D plans and outer no_shard keep their reductions in main_grad.
    one_d = make_plan(ShardingStrategy.OPTIM_GRADS_PARAMS, dtypes, LAYOUT, 1)
    assert one_d.window_grad_span is None and one_d.norm_axis == "shard"


@pytest.mark.parametrize("strategy", list(TABLE))
def test_grads_in_place(strategy: str) -> None:
    """[Note: gradients in place]: autograd writes gradients straight into the first buffer of
    the gradient path (``main_grad`` on the accumulate path, ``staged_grad`` on the
    reduce-each path) exactly when that buffer is in the compute dtype; else they are staged."""
    def in_place(policy: MixedPrecisionPolicy, outer: ShardingStrategy | None = None) -> bool:
        return make_plan(ShardingStrategy.parse(strategy), policy.resolve(torch.float32),
                         LAYOUT, 1, outer=outer, outer_size=2).grads_in_place

    bf16, fp32 = torch.bfloat16, torch.float32
    each = TABLE[strategy][4] is EACH
    if TABLE[strategy][3]:  # ZeRO-3 gathers weights: always staged
        assert not any(in_place(MixedPrecisionPolicy(param_dtype=d, main_params_dtype=d))
                       for d in (bf16, fp32))
        return
    assert in_place(MixedPrecisionPolicy())
    assert in_place(MixedPrecisionPolicy(), outer=ShardingStrategy.NO_SHARD)
    # bf16 compute, fp32 main gradients reduced in fp32: a cast either way.
    assert not in_place(MixedPrecisionPolicy(param_dtype=bf16))
    # bf16 compute reduced in bf16: the reduce-each bucket is bf16, main_grad fp32.
    assert in_place(MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)) is each
    # fp32 compute reduced in bf16: main_grad is fp32, the reduce-each bucket bf16.
    assert in_place(MixedPrecisionPolicy(reduce_dtype=bf16)) is not each
    # bf16 everywhere.
    assert in_place(MixedPrecisionPolicy(param_dtype=bf16, main_params_dtype=bf16))
    assert in_place(MixedPrecisionPolicy(param_dtype=fp32))
