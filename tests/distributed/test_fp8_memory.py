"""``memory_report`` of FP8 parameters (torchao float8 with FP8 all-gathers, design.md §3 "FP8
parameters") against the bytes of the tensors the model actually holds, found from the module
side (the weights a forward sees, the optimizer-facing parameters), each storage counted once:

* ``fp8_weights``: the persistent FP8 buffers, i.e. the storages the gathered float8 weights of
  ``optim``/``optim_grads`` view (1 byte per element of the group); none under ``no_shard``
  (full-precision weights, cast per forward) and ZeRO-3 (scratch buffers, freed after use);
  on an HSDP mesh with outer ``optim``, the inner shard's FP8 bytes (half the group at 2x2);
* ``temporary_peak`` under ZeRO-3: over a forward, exactly the scratch storages the weights view
  while it runs (the FP8 bytes and the plain group's gathered biases);
* ``fp8_scales``: the scale tensors (``_scale`` of each gathered float8 weight,
  ``_precomputed_scale`` of each optimizer-facing weight), each storage once.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from test_fp8_params import DIMS, _batches, _model, _rank_losses
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard, memory_report

# private: the tree's allocator (bytes of gathered float8 buckets)
from megatron_fsdp_v2._registry import state_of

from _models import agree
from _pool import RankPools

pytest.importorskip("torchao")

TIMEOUT_S = 300
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _seen_in_forward(model: nn.Module, x: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """The tensors the linears compute with during a forward: the float8 data and scales of
    the gathered weights, and the plain parameters (biases)."""
    seen: dict[str, list[torch.Tensor]] = {"fp8_data": [], "scales": [], "plain": [],
                                            "sizes": [], "fp8_sizes": []}

    def hook(module: nn.Module, args: Any) -> None:
        weight = module.weight
        if hasattr(weight, "_data"):  # a gathered Float8TrainingTensor
            seen["fp8_data"].append(weight._data)
            seen["scales"].append(weight._scale)
            seen["fp8_sizes"].append(torch.tensor(_storage_bytes([weight._data])))
        seen["plain"].append(module.bias)
        # Live sizes now (ZeRO-3's scratch storages are freed after the forward).
        seen["sizes"].append(torch.tensor(_storage_bytes(
            [t for t in (getattr(weight, "_data", None), module.bias) if t is not None])))

    handles = [m.register_forward_pre_hook(hook) for m in model if isinstance(m, nn.Linear)]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return seen


def _memory(rank: int, world: int, strategy: str, hsdp: str | None) -> None:
    dim = DIMS[2]
    model = _model(dim)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp \
        else None
    fully_shard(model, mesh=mesh, sharding_strategy=strategy,
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                **({"outer_dp_sharding_strategy": hsdp} if hsdp else {}))
    _rank_losses(model, rank, _batches(world, dim)[:2])  # FP8 buffers and scales exist after a step
    state = state_of(model)
    assert state is not None
    state.allocator.reset_peak()
    seen = _seen_in_forward(model, torch.randn(8, dim))
    report = memory_report(model)
    scales = list(seen["scales"]) + [
        p._local_tensor._precomputed_scale for p in model.parameters()  # type: ignore[attr-defined]
        if getattr(p._local_tensor, "_precomputed_scale", None) is not None]
    expected_scales = _storage_bytes(scales)
    if strategy in ("optim", "optim_grads"):
        expected_fp8 = _storage_bytes(seen["fp8_data"])
        numel = sum(g.layout.total_numel for g in state.groups if g.extension is not None)
        agree(f"{strategy}: the FP8 buffer is 1 byte per element",
              lambda: _equal(expected_fp8, numel))
    elif hsdp == "optim":  # the inner shard as FP8 bytes (the forward sees the gathered scratch)
        expected_fp8 = sum(g.layout.total_numel // 2 for g in state.groups
                           if g.extension is not None)
    else:
        expected_fp8 = 0
    agree(f"{strategy}: fp8_weights", lambda: _equal(report.fp8_weights, expected_fp8))
    agree(f"{strategy}: fp8_scales", lambda: _equal(report.fp8_scales, expected_scales))
    agree(f"{strategy}: scales exist", lambda: _positive(expected_scales))
    plain = sum(g.model_weight.numel() * g.model_weight.element_size() for g in state.groups)
    agree(f"{strategy}: model_weights holds the FP8 bytes",
          lambda: _equal(report.model_weights, plain + expected_fp8))
    if strategy == "optim_grads_params":
        live = int(seen["sizes"][-1])  # one unit: everything gathered at its last linear
        agree(f"{strategy}: temporary_peak is the gathered FP8 + plain scratch",
              lambda: _equal(report.temporary_peak, live))
        agree(f"{strategy}: FP8 scratch is 1 byte per element", lambda: _equal(
            int(seen["fp8_sizes"][-1]),
            sum(g.layout.total_numel for g in state.groups if g.extension is not None)))


def _equal(got: int, expected: int) -> None:
    assert got == expected, (got, expected)


def _positive(value: int) -> None:
    assert value > 0, value


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_memory_report_counts_fp8(ranks: RankPools, strategy: str) -> None:
    ranks.run(_memory, 2, strategy, None, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize(("strategy", "outer"), [("optim", "no_shard"),
                                                 ("optim_grads_params", "no_shard"),
                                                 ("optim_grads_params", "optim")])
def test_memory_report_counts_fp8_hsdp(ranks: RankPools, strategy: str, outer: str) -> None:
    ranks.run(_memory, 4, strategy, outer, timeout_s=TIMEOUT_S)
