"""FP8 parameters on an HSDP (2-D, (replicate, shard)) mesh: torchao float8 linears with
``enable_fsdp_float8_all_gather=True`` wrapped with outer ``no_shard`` against FSDP2's HSDP
(``torch.distributed.fsdp.fully_shard(mesh=<2-D mesh>)``) + torchao, run in the same 4 ranks
on the same model and data as the control (the helpers of ``test_fp8_params.py``).

Every replica runs the 1-D FP8 design over the shard axis (the FP8 bytes gathered over the
inner group only); the gradients take the plain HSDP path (inner reduction, then one outer
all-reduce per window); ``precompute_float8_dynamic_scale_for_fsdp`` reduces the amaxes over
the DTensors' mesh. Outer ``optim`` (FSDP2 has no such mode) is checked against one process
and against outer ``no_shard``.

Tolerances: as ``test_fp8_params.py`` at world 2 for ``no_shard``/``optim`` in fp32 (the same
two-rank sums, each then summed over two replicas: bitwise), else 1e-6 on losses and parameters
(``optim_grads``/``optim_grads_params`` reduce every micro-batch where FSDP2 reduces their sum:
``a/2 + b/2`` vs ``(a + b)/2``, an ulp that AdamW carries into a parameter); bf16: 1e-4 on
parameters (FSDP2's HSDP reduces bf16-computed gradients over 4 ranks in another order).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_fp8_params import (
    DIMS,
    STEPS,
    _batches,
    _check_bytes,
    _gather_bytes,
    _model,
    _rank_losses,
    _state_dict_round_trip,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

# private: switches the fused float8 gather off (ExtensionGather.fuse_float8)
from megatron_fsdp_v2._runtime._subclass_gather import ExtensionGather

from _models import agree, shard_rows
from _pool import RankPools

pytest.importorskip("torchao")

TIMEOUT_S = 300
WORLD = 4
REPLICAS = 2
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
DIM = DIMS[WORLD // REPLICAS]


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (REPLICAS, WORLD // REPLICAS),
                            mesh_dim_names=("replicate", "shard"))


def _fsdp2_hsdp(model: nn.Module, mesh: DeviceMesh, dtype: torch.dtype) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    policy = FSDP2Policy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fsdp2_fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fsdp2_fully_shard(model, mesh=mesh, mp_policy=policy)


def _tolerances(strategy: str, dtype: torch.dtype) -> tuple[float, float]:
    """(loss rtol, parameter atol); see the module docstring."""
    if dtype == torch.bfloat16:
        return 1e-6, 1e-4
    if strategy in ("no_shard", "optim"):
        return 0.0, 0.0
    return 1e-6, 1e-6


def _hsdp_parity(rank: int, world: int, strategy: str, dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    mesh = _mesh()
    ours = _model(DIM)
    # no_shard casts full-precision weights in each forward (design.md §3 "FP8 parameters"):
    # its control casts per forward too (see test_fp8_params.py).
    control = _model(DIM, fp8_all_gather=strategy != "no_shard")
    fully_shard(ours, mesh=mesh, sharding_strategy=strategy, outer_dp_sharding_strategy="no_shard",
                mp_policy=MixedPrecisionPolicy(param_dtype=dtype))
    _fsdp2_hsdp(control, mesh, dtype)
    batches = _batches(world, DIM)
    last_step: dict[str, Any] = {}

    def count(step: int) -> None:
        if step == STEPS - 2:
            ours.reset_collective_stats()  # type: ignore[operator]
        if step == STEPS - 1:
            last_step.update(_gather_bytes(ours))

    losses = _rank_losses(ours, rank, batches, count)
    control_losses = _rank_losses(control, rank, batches)
    loss_rtol, param_atol = _tolerances(strategy, dtype)
    case = f"HSDP {strategy} {dtype_name}"
    agree(f"{case}: losses", lambda: torch.testing.assert_close(
        losses, control_losses, rtol=loss_rtol, atol=0.0))
    controls = dict(control.named_parameters())
    for name, p in ours.named_parameters():
        full, expected = p.full_tensor().detach(), controls[name].full_tensor().detach()
        agree(f"{case}: parameter {name}", lambda: torch.testing.assert_close(
            full, expected, rtol=0.0, atol=param_atol))
    # 1 byte per element of the group's inner layout per all-gather (over the shard axis only);
    # no_shard gathers nothing; optim/optim_grads refresh once per step.
    calls, nbytes, numel = last_step.get("fp8", (0, 0, 0))
    expected_calls = {"no_shard": 0, "optim": 1, "optim_grads": 1,
                      "optim_grads_params": None}[strategy]
    agree(f"{case}: FP8 all-gather bytes", lambda: _check_bytes(
        calls, nbytes, numel, expected_calls))


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp8_hsdp_matches_fsdp2_hsdp(ranks: RankPools, strategy: str, dtype_name: str) -> None:
    """HSDP 2x2, outer ``no_shard``, 2 micro-batches, 5 AdamW steps: losses and parameters equal
    FSDP2's HSDP + torchao; the weight all-gathers move FP8 bytes."""
    ranks.run(_hsdp_parity, WORLD, strategy, dtype_name, timeout_s=TIMEOUT_S)


def _dynamic_scale(rank: int, world: int, outer: str) -> None:
    """No precomputed scale, the fused cast off: torchao's own ``fsdp_pre_all_gather`` computes
    each weight's amax and all-reduces it over the mesh it is given, which must be the shard
    axis (as FSDP2's ``shard_mesh``), or with outer ``optim`` (each rank a distinct sub-shard)
    the whole mesh: forward and backward equal FSDP2's HSDP."""
    mesh = _mesh()
    ours, control = _model(DIM), _model(DIM)
    for layer in ours:  # one unit per linear: every rank holds rows of each weight
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, sharding_strategy="optim_grads_params",
                        outer_dp_sharding_strategy=outer)
    fully_shard(ours, mesh=mesh, sharding_strategy="optim_grads_params",
                outer_dp_sharding_strategy=outer)
    _fsdp2_hsdp(control, mesh, torch.float32)
    x, y = _batches(world, DIM)[0][0]
    rows = slice(rank * 8, (rank + 1) * 8)
    ExtensionGather.fuse_float8 = False
    try:
        out = ours(x[rows])
    finally:
        ExtensionGather.fuse_float8 = True
    expected = control(x[rows])
    out.sub(y[rows]).square().mean().backward()
    expected.sub(y[rows]).square().mean().backward()
    agree("dynamic scale: output", lambda: torch.testing.assert_close(
        out, expected, rtol=0.0, atol=0.0))
    grads = {n: p.grad.full_tensor() for n, p in control.named_parameters()}
    for name, p in ours.named_parameters():
        (lo, hi), got = shard_rows(p), p.grad.to_local()  # type: ignore[union-attr]
        agree(f"dynamic scale: gradient of {name}", lambda: torch.testing.assert_close(
            got, grads[name][lo:hi], rtol=0.0, atol=1e-7))


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_dynamic_scale_over_the_shard_axis(ranks: RankPools, outer: str) -> None:
    ranks.run(_dynamic_scale, WORLD, outer, timeout_s=TIMEOUT_S)


def _precompute_over_mesh(rank: int, world: int) -> None:
    """The scales precomputed on the library's 2-D DTensors equal those of the same weights on
    one process (the amax covers every row of each weight), with one all-reduce of all amaxes."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    model = _model(DIM)
    reference = _model(DIM)
    fully_shard(model, mesh=_mesh(), sharding_strategy="optim_grads_params")
    with CommDebugMode() as comm:
        precompute_float8_dynamic_scale_for_fsdp(model)
    reduces = sum(n for op, n in comm.get_comm_counts().items() if "all_reduce" in str(op))
    agree("precompute: one all-reduce of every amax", lambda: _equal(reduces, 1))
    for layer, ref in zip(model, reference):
        if not isinstance(layer, nn.Linear):
            continue
        scale = layer.weight._local_tensor._precomputed_scale  # type: ignore[union-attr]
        amax = ref.weight.detach().abs().max()
        expected = torch.finfo(torch.float8_e4m3fn).max / amax.clamp(min=1e-12)
        agree("precomputed scale", lambda: torch.testing.assert_close(
            scale.reshape(()), expected, rtol=0.0, atol=0.0))


def test_precompute_covers_the_whole_mesh(ranks: RankPools) -> None:
    ranks.run(_precompute_over_mesh, WORLD, timeout_s=TIMEOUT_S)


def _outer_optim(rank: int, world: int, dtype_name: str) -> None:
    """Outer ``optim`` (main weights, gradients and AdamW state sharded over all 4 ranks; the
    inner shard held as FP8 bytes, refreshed by an outer FP8 all-gather after each step) against
    outer ``no_shard`` on the same mesh and, in fp32, one process training the same float8
    model on every rank's rows (it casts each full weight to float8 with its dynamic amax, which
    is the precomputed scale of the sharded runs; bf16 compute has no single-process twin).
    Measured in fp32: losses bitwise equal, parameters within 3e-8 of one process (gradients
    summed over 4 ranks in another order than one process sums its rows); checked to 1e-6."""
    dtype = getattr(torch, dtype_name)
    batches = _batches(world, DIM)
    runs: dict[str, Any] = {}
    for outer in ("optim", "no_shard"):
        model = _model(DIM)
        fully_shard(model, mesh=_mesh(), sharding_strategy="optim_grads_params",
                    outer_dp_sharding_strategy=outer,
                    mp_policy=MixedPrecisionPolicy(param_dtype=dtype))
        last_step: dict[str, Any] = {}

        def count(step: int, model: nn.Module = model, last_step: dict = last_step) -> None:
            if step == STEPS - 2:
                model.reset_collective_stats()  # type: ignore[operator]
            if step == STEPS - 1:
                last_step.update(_gather_bytes(model))

        runs[outer] = (model, _rank_losses(model, rank, batches, count), last_step)
    (ours, losses, last_step), (no_shard, no_shard_losses, _) = runs["optim"], runs["no_shard"]
    expected = {n: p.full_tensor().detach() for n, p in no_shard.named_parameters()}
    agree(f"outer optim {dtype_name}: losses = outer no_shard", lambda: torch.testing.assert_close(
        losses, no_shard_losses, rtol=1e-6, atol=0.0))
    if dtype == torch.float32:
        reference, ref_losses = _single_process(world, batches)
        expected = {n: p.detach() for n, p in reference.named_parameters()}
        agree("outer optim: losses = one process", lambda: torch.testing.assert_close(
            losses, ref_losses[rank], rtol=1e-6, atol=0.0))
    for name, p in ours.named_parameters():
        lo, hi = shard_rows(p)
        got, full = p.to_local().detach(), expected[name]
        agree(f"outer optim {dtype_name}: parameter {name} rows {lo}:{hi}",
              lambda: torch.testing.assert_close(got, full[lo:hi], rtol=0.0, atol=1e-6))
    # Per step: 4 inner gathers (2 micro-batches, forward and backward) of the whole FP8 layout
    # and one outer refresh of the inner shard (half of it), 1 byte per element each.
    calls, nbytes, numel = last_step["fp8"]
    agree("outer optim: FP8 all-gather bytes", lambda: _equal(
        (calls, nbytes), (5, 4 * numel + numel // (WORLD // REPLICAS))))


def _single_process(world: int, batches: list[Any]) -> tuple[nn.Module, list[list[float]]]:
    """The float8 model trained on one process on every rank's rows; each rank's loss."""
    model = _model(DIM)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses: list[list[float]] = [[] for _ in range(world)]
    for parts in batches:
        totals = [0.0] * world
        for x, y in parts:
            per_rank = [F.mse_loss(model(x[r * 8:(r + 1) * 8]), y[r * 8:(r + 1) * 8]) / len(parts)
                        for r in range(world)]
            (sum(per_rank) / world).backward()  # type: ignore[operator]
            totals = [t + loss.item() for t, loss in zip(totals, per_rank)]
        opt.step()
        opt.zero_grad()
        for r in range(world):
            losses[r].append(totals[r])
    return model, losses


def _equal(got: Any, expected: Any) -> None:
    assert got == expected, (got, expected)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_fp8_outer_optim_matches_one_process(ranks: RankPools, dtype_name: str) -> None:
    ranks.run(_outer_optim, WORLD, dtype_name, timeout_s=TIMEOUT_S)


def test_fp8_outer_optim_state_dict_round_trip(ranks: RankPools) -> None:
    """Outer ``optim``: ``load_state_dict`` of another model's state dict marks the FP8 inner
    shard stale; the next forward refreshes it (outer all-gather) and equals the source's."""
    ranks.run(_state_dict_round_trip, WORLD, "optim_grads_params", "optim", timeout_s=TIMEOUT_S)
