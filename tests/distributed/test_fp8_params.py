"""FP8 parameters: torchao float8 linears with ``enable_fsdp_float8_all_gather=True``, gathered
through FSDP2's all-gather extensions ([Note: FSDP2 all-gather extensions] in
``_runtime/_subclass_gather.py``), against FSDP2 + torchao (``torch.distributed.fsdp.
fully_shard``) run in the same ranks on the same model and data as the control.

Every strategy, world 2 and 3, fp32 and bf16 compute, 2 micro-batches (the first marked with
``set_requires_gradient_sync(False)`` in both), 5 AdamW steps, ``precompute_float8_dynamic_
scale_for_fsdp`` after wrapping and after every step in both. The library wraps the model as
one unit, so its flat FP8 group is cut by row at world 3 (rank 0 holds no row of ``2.weight``,
rank 2 none of ``0.weight``); FSDP2 wraps each linear (its torchao path needs every parameter's
rows divisible by the world size: with uneven rows its all-gather inputs differ in size across
ranks and gloo aborts, so the dims are multiples of 48 at world 3).

Tolerances (what the numbers allow):
* ``no_shard`` and ``optim`` at world 2: bitwise (gradients accumulated over the micro-batches,
  then reduced once, like FSDP2 without gradient sync; two-rank sums do not depend on order);
* ``optim_grads`` and ``optim_grads_params`` reduce every micro-batch (their design) where FSDP2
  reduces the accumulated sum once: ``a/2 + b/2`` against ``(a + b)/2`` differ by an ulp, which
  AdamW's ``m / sqrt(v)`` carries into the parameters (measured at world 2: 3e-8): parameters to
  1e-6 absolute, losses to 1e-6 relative;
* world 3: parameters to 1e-4 absolute (1% of one step of lr 1e-2), losses to 1e-6 relative:
  the library reduces its flat buffer and FSDP2 each padded parameter, so three-rank sums may
  round in another order (1 ulp), and AdamW turns a 1-ulp difference on a near-zero gradient
  element into a visible part of a step (measured: up to 5.8e-5, ``no_shard`` in bf16).
* ``no_shard`` keeps full-precision weights and torchao casts them to FP8 in each forward (the
  design: nothing to gather), in bf16 from the bf16 compute copy; FSDP2's FP8 all-gather casts
  the fp32 shard instead (one rounding, not two). Its control is therefore FSDP2 + torchao
  with ``enable_fsdp_float8_all_gather=False``, which casts the same bf16 weights per forward:
  the same numbers (fp32: both controls are the same).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _bad_input import expect_rejected
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

# private: the units' parameter groups and allocator (float8 buckets)
from megatron_fsdp_v2._registry import state_of

# private: switches the fused float8 gather on and off (ExtensionGather.fuse_float8)
from megatron_fsdp_v2._runtime._subclass_gather import ExtensionGather

from _models import agree
from _pool import RankPools
from _training import train_steps

pytest.importorskip("torchao")

TIMEOUT_S = 300

# torch 2.11: the backward of torchao's FP8 all-gathered weight with a bf16 compute dtype fails
# in torch's autograd engine ("Found dtype Float but expected BFloat16"), for FSDP2 + torchao
# (the control) as for the library, with torchao 0.15 to 0.18; 2.13 and later train. The
# control cannot run there, so those cases are skipped on 2.11 (README, "Supported torch
# releases").
BF16_FP8_BACKWARD_FAILS = tuple(
    int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) == (2, 11)


def _skip_bf16_on_torch_2_11(dtype_name: str) -> None:
    if dtype_name == "bfloat16" and BF16_FP8_BACKWARD_FAILS:
        pytest.skip("torch 2.11: torchao's FP8 all-gathered weight fails in bf16 backward, "
                    "FSDP2's too (see BF16_FP8_BACKWARD_FAILS)")
STEPS = 5
MICRO = 2
ROWS = 8  # per rank and micro-batch
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
DIMS = {2: 32, 3: 48}  # in_features; hidden = 2x. Multiples of 16 (float8 mm) and, at world
# 3, of 3 (FSDP2's even rows)


def _model(dim: int, fp8_all_gather: bool = True) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather)
    return convert_to_float8_training(model, config=config)


def _fsdp2(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    # Gradients reduced in fp32 like the library's default (FSDP2 would use param_dtype).
    policy = FSDP2Policy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fsdp2_fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fsdp2_fully_shard(model, mesh=mesh, mp_policy=policy)


def _batches(world: int, dim: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(5)
    return [[(torch.randn(world * ROWS, dim, generator=g), torch.randn(world * ROWS, dim,
                                                                       generator=g))
             for _ in range(MICRO)] for _ in range(STEPS)]


def _rank_losses(model: nn.Module, rank: int, batches: list[Any],
                 after_step: Any = None) -> list[float]:
    """AdamW over ``batches``; each rank feeds its own rows; returns this rank's loss per step."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)  # see _check_empty_shards
    rows = slice(rank * ROWS, (rank + 1) * ROWS)

    def refresh_scales(step: int) -> None:
        precompute_float8_dynamic_scale_for_fsdp(model)
        if after_step is not None:
            after_step(step)

    per_step = train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches,
                           lambda m, b: F.mse_loss(m(b[0]), b[1]), rank=rank,
                           select=lambda parts, _: (parts[0][rows], parts[1][rows]),
                           mark="gradient_sync", after_step=refresh_scales)
    return [sum(loss.item() for loss in step_losses) for step_losses in per_step]


def _tolerances(world: int, strategy: str) -> dict[str, float]:
    """(see the module docstring)"""
    if world == 3:
        return {"loss_rtol": 1e-6, "param_atol": 1e-4}
    if strategy in ("no_shard", "optim"):
        return {"loss_rtol": 0.0, "param_atol": 0.0}
    return {"loss_rtol": 1e-6, "param_atol": 1e-6}


def _gather_bytes(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """Per flat group of the root unit: (all-gather calls, bytes, gathered elements per call)."""
    state = state_of(model)
    assert state is not None
    out = {}
    for group in state.groups:
        count = group.collectives.counts.get(("all_gather", "all_gather"))
        kind = "fp8" if group.extension is not None else str(group.dtypes.model)
        calls, nbytes = (count.calls, count.bytes) if count is not None else (0, 0)
        prev = out.get(kind, (0, 0, 0))
        out[kind] = (prev[0] + calls, prev[1] + nbytes, group.layout.total_numel)
    return out


def _parity(rank: int, world: int, strategy: str, dtype_name: str, fused: bool = True,
            trace_pool: bool = False) -> None:
    ExtensionGather.fuse_float8 = fused
    try:
        _parity_run(rank, world, strategy, dtype_name, trace_pool)
    finally:
        ExtensionGather.fuse_float8 = True


def _parity_run(rank: int, world: int, strategy: str, dtype_name: str, trace_pool: bool) -> None:
    dtype = getattr(torch, dtype_name)
    dim = DIMS[world]
    ours = _model(dim)
    control = _model(dim, fp8_all_gather=strategy != "no_shard")  # see the module docstring
    fully_shard(ours, sharding_strategy=strategy, mp_policy=MixedPrecisionPolicy(param_dtype=dtype),
                enable_trace_pool=trace_pool)
    _fsdp2(control, dtype)
    batches = _batches(world, dim)
    last_step: dict[str, Any] = {}

    def count(step: int) -> None:
        if step == STEPS - 2:
            ours.reset_collective_stats()  # type: ignore[operator]
        if step == STEPS - 1:
            last_step.update(_gather_bytes(ours))

    losses = _rank_losses(ours, rank, batches, count)
    control_losses = _rank_losses(control, rank, batches)
    tol = _tolerances(world, strategy)
    agree(f"{strategy} {dtype_name} world {world}: losses", lambda: torch.testing.assert_close(
        losses, control_losses, rtol=tol["loss_rtol"], atol=0.0))
    controls = dict(control.named_parameters())
    for name, p in ours.named_parameters():
        full, expected = p.full_tensor().detach(), controls[name].full_tensor().detach()
        agree(f"{strategy} {dtype_name} world {world}: parameter {name}",
              lambda: torch.testing.assert_close(full, expected, rtol=0.0,
                                                 atol=tol["param_atol"]))
    # The FP8 group moves 1 byte per element per gather (its scales are metadata computed on
    # every rank from the all-reduced amaxes, never gathered); no_shard gathers nothing.
    calls, nbytes, numel = last_step.get("fp8", (0, 0, 0))
    expected_calls = {"no_shard": 0, "optim": 1, "optim_grads": 1,
                      "optim_grads_params": None}[strategy]
    agree(f"{strategy}: FP8 all-gather bytes", lambda: _check_bytes(
        calls, nbytes, numel, expected_calls))


def _check_bytes(calls: int, nbytes: int, numel: int, expected_calls: int | None) -> None:
    if expected_calls is not None:
        assert calls == expected_calls, (calls, expected_calls)
    else:
        assert calls > 0, calls
    assert nbytes == calls * numel, (nbytes, calls, numel)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", [2, 3])
def test_fp8_all_gather_matches_fsdp2(ranks: RankPools, world: int, strategy: str,
                                      dtype_name: str) -> None:
    """Losses and parameters equal FSDP2 + torchao over 5 steps; FP8 bytes gathered. With
    precomputed scales the library casts with its fused ``ops.fp8_quantize_``."""
    _skip_bf16_on_torch_2_11(dtype_name)
    ranks.run(_parity, world, strategy, dtype_name, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
@pytest.mark.parametrize("world", [2, 3])
def test_fp8_protocol_path_matches_fsdp2(ranks: RankPools, world: int, strategy: str) -> None:
    """The same through torchao's own ``fsdp_pre_all_gather`` (the fused cast switched off):
    the generic path any subclass with the extensions takes."""
    _skip_bf16_on_torch_2_11("bfloat16")
    ranks.run(_parity, world, strategy, "bfloat16", False, timeout_s=TIMEOUT_S)


def test_fp8_trace_pool_matches_fsdp2(ranks: RankPools) -> None:
    """ZeRO-3 with ``enable_trace_pool=True``: the FP8 scratch buffers are pinned while autograd
    may hold views of them, so the result is FSDP2's."""
    _skip_bf16_on_torch_2_11("bfloat16")
    ranks.run(_parity, 2, "optim_grads_params", "bfloat16", True, True, timeout_s=TIMEOUT_S)


def _zero3_bytes(rank: int, world: int) -> None:
    """One step of ZeRO-3 in bf16: FP8 all-gathers against the same model gathered in bf16."""
    dim = DIMS[world]
    totals = {}
    for fp8 in (True, False):
        model = _model(dim, fp8_all_gather=fp8)
        fully_shard(model, sharding_strategy="optim_grads_params",
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        _rank_losses(model, rank, _batches(world, dim)[:1])
        totals[fp8] = sum(b for _, b, _ in _gather_bytes(model).values())
    ratio = totals[True] / totals[False]
    agree(f"ZeRO-3 fp8/bf16 all-gather bytes {totals}: {ratio:.3f}",
          lambda: _at_most(ratio, 0.52))


def _at_most(value: float, bound: float) -> None:
    assert value <= bound, (value, bound)


@pytest.mark.parametrize("world", [2, 3])
def test_zero3_fp8_gathers_about_half_of_bf16(ranks: RankPools, world: int) -> None:
    _skip_bf16_on_torch_2_11("bfloat16")
    ranks.run(_zero3_bytes, world, timeout_s=TIMEOUT_S)


def _precompute_one_all_reduce(rank: int, world: int, strategy: str) -> None:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    model = _model(DIMS[world])
    fully_shard(model, sharding_strategy=strategy)
    with CommDebugMode() as comm:
        precompute_float8_dynamic_scale_for_fsdp(model)
    reduces = sum(n for op, n in comm.get_comm_counts().items() if "all_reduce" in str(op))
    scales = [m.weight._local_tensor._precomputed_scale for m in model
              if isinstance(m, nn.Linear)]
    expected = 0 if strategy == "no_shard" else 1  # replicated DTensors need no reduction
    agree(f"{strategy}: all-reduces of the scale precompute",
          lambda: _one(reduces, expected, scales))


def _one(reduces: int, expected: int, scales: list[Any]) -> None:
    assert reduces == expected, (reduces, expected)
    assert all(s is not None for s in scales), scales


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_precompute_is_one_all_reduce(ranks: RankPools, strategy: str) -> None:
    """``precompute_float8_dynamic_scale_for_fsdp`` on the library's DTensors (uneven rows with
    empty local shards at world 3): one all-reduce of every amax (none for replicated
    ``no_shard`` parameters), scales set."""
    ranks.run(_precompute_one_all_reduce, 3, strategy, timeout_s=TIMEOUT_S)


def _empty_rows_without_scale(rank: int, world: int) -> None:
    model = _model(DIMS[world])
    fully_shard(model, sharding_strategy="optim_grads_params")
    x = torch.randn(ROWS, DIMS[world])
    try:
        model(x)
    except RuntimeError as e:
        message = str(e)
    else:
        message = ""
    agree("empty rows without a precomputed scale", lambda: _mentions(message))


def _mentions(message: str) -> None:
    assert "holds no row" in message and "precompute_float8_dynamic_scale_for_fsdp" in message, \
        message


def test_empty_rows_need_a_precomputed_scale(ranks: RankPools) -> None:
    """A rank without rows of an FP8 weight cannot compute torchao's dynamic scale: every rank
    raises the same clear error before any collective (no deadlock)."""
    ranks.run(_empty_rows_without_scale, 3, timeout_s=TIMEOUT_S)


def _scale_set_before_wrap(rank: int, world: int, strategy: str) -> None:
    """torchao weights whose ``_precomputed_scale`` was set before ``fully_shard`` (a scale
    precomputed for them elsewhere, or carried by a loaded model; torchao's ``__tensor_flatten__``
    then lists it as a second inner tensor): accepted, and the stale scale (1.0 here, far from
    max/amax) is dropped as FSDP2 drops it, so neither the compute weights (``no_shard`` casts
    its own per forward) nor the gathers use it: losses and parameters equal FSDP2's on the same
    models over 2 steps."""
    dim = DIMS[world]
    ours, control = _model(dim), _model(dim, fp8_all_gather=strategy != "no_shard")
    for model in (ours, control):
        for layer in model:
            if isinstance(layer, nn.Linear) and hasattr(layer.weight, "_precomputed_scale"):
                layer.weight._precomputed_scale = torch.tensor(1.0)
    fully_shard(ours, sharding_strategy=strategy)
    _fsdp2(control, torch.float32)
    kept = [p._local_tensor._precomputed_scale for p in ours.parameters()  # type: ignore[attr-defined]
            if hasattr(p._local_tensor, "_precomputed_scale")]
    agree(f"{strategy}: the pre-wrap scale is dropped", lambda: _equal(kept, [None, None]))
    batches = _batches(world, dim)[:2]
    losses, control_losses = _rank_losses(ours, rank, batches), _rank_losses(control, rank, batches)
    tol = _tolerances(world, strategy)
    agree(f"{strategy}: losses", lambda: torch.testing.assert_close(
        losses, control_losses, rtol=tol["loss_rtol"], atol=0.0))
    controls = dict(control.named_parameters())
    for name, p in ours.named_parameters():
        full, expected = p.full_tensor().detach(), controls[name].full_tensor().detach()
        agree(f"{strategy}: parameter {name}", lambda: torch.testing.assert_close(
            full, expected, rtol=0.0, atol=tol["param_atol"]))


def _equal(got: Any, expected: Any) -> None:
    assert got == expected, (got, expected)


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_scale_precomputed_before_wrap(ranks: RankPools, strategy: str) -> None:
    ranks.run(_scale_set_before_wrap, 2, strategy, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- checkpoints and refusals

def _state_dict_round_trip(rank: int, world: int, strategy: str, outer: str | None = None
                           ) -> None:
    """``state_dict()`` holds the main weights (DTensors over the float8 subclass); loading it
    into a model with other weights marks the FP8 compute weights stale: the next forward
    gathers the loaded ones. ``outer``: on a (2, world / 2) HSDP mesh with that outer
    strategy."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    dim = DIMS[world if outer is None else world // 2]
    source, target = _model(dim), _model(dim)
    hsdp: dict[str, Any] = {}
    if outer is not None:
        hsdp = dict(mesh=init_device_mesh("cpu", (2, world // 2),
                                          mesh_dim_names=("replicate", "shard")),
                    outer_dp_sharding_strategy=outer)
    for model in (source, target):
        fully_shard(model, sharding_strategy=strategy, **hsdp)
        precompute_float8_dynamic_scale_for_fsdp(model)
    x = torch.randn(ROWS, dim, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(-0.5)
        target(x)  # gathers (or refreshes) the changed weights
        target.load_state_dict(source.state_dict())
        precompute_float8_dynamic_scale_for_fsdp(target)
        out, expected = target(x), source(x)
    agree(f"{strategy}: output after load_state_dict",
          lambda: torch.testing.assert_close(out, expected, rtol=0.0, atol=0.0))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_dict_round_trip(ranks: RankPools, strategy: str) -> None:
    ranks.run(_state_dict_round_trip, 2, strategy, timeout_s=TIMEOUT_S)


def _meta_model() -> nn.Module:
    with torch.device("meta"):
        return _model(DIMS[2])


def _refused(rank: int, world: int, case: str) -> None:
    # (FP8 on an HSDP mesh, outer no_shard and outer optim: see
    # test_fp8_hsdp.py.)
    make, call = _meta_model, fully_shard
    pattern = r"parameter '0\.weight' .*WeightWithDynamicFloat8CastTensor on the meta device"
    fully_shard(nn.Linear(4, 4))  # creates the library's process group (collective) up front
    message = expect_rejected(make, call, NotImplementedError, pattern)  # no collective at all
    agree(f"{case}: message", lambda: _matches(message, pattern))


def _matches(message: str, pattern: str) -> None:
    assert re.search(pattern, message, re.S), message


@pytest.mark.parametrize("case", ["meta_device"])
def test_unsupported_fp8_setups_refused(ranks: RankPools, case: str) -> None:
    """FP8 all-gathers from meta-device parameters: a clear
    NotImplementedError at ``fully_shard`` on every rank before any collective, the module
    untouched."""
    ranks.run(_refused, 2, case, timeout_s=TIMEOUT_S)
