"""FSDP2's ``MixedPrecisionPolicy`` (``output_dtype`` included), ``offload_policy``,
``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``, and
``torch.nn.utils.clip_grad_norm_`` on ranks whose shards are empty, on fully_shard (see
``_fsdp2_api.py`` for how cases run).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _fsdp2_api import (
    TIMEOUT_S,
    _batches,
    _check_training,
    _loss,
    _net,
    _train,
    _wrap,
)
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import OffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

# private: reads the tree's runtime context (where the policy's buffers went)
from megatron_fsdp_v2._registry import state_of

from _models import shard_rows
from _pool import RankPools

pytestmark = pytest.mark.timeout(600)


# ---------------------------------------------------------------------- FSDP2 MixedPrecisionPolicy

def _mp_worker(rank: int, world: int) -> dict[str, Any]:
    bf16 = torch.bfloat16
    # Blocks compute in bf16 and hand bf16 activations on; the root returns fp32.
    fsdp2_policies = (TorchMixedPrecisionPolicy(param_dtype=bf16),
                      TorchMixedPrecisionPolicy(param_dtype=bf16, output_dtype=torch.float32))
    ours_policies = (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16),
                     MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16,
                                          output_dtype=torch.float32))
    out: dict[str, Any] = {}
    for name, wrap, (block_policy, root_policy) in [
        ("converted", fully_shard, fsdp2_policies), ("ours", fully_shard, ours_policies),
        ("fsdp2", torch_fully_shard, fsdp2_policies),
    ]:
        model, ref = _net()
        for block in model.blocks:
            wrap(block, mp_policy=block_policy)
        wrap(model, mp_policy=root_policy)
        seen: dict[str, torch.dtype] = {}

        def recorder(key: str) -> Any:
            def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
                seen.setdefault(key, output.dtype)
            return hook

        hooks = [model.register_forward_hook(recorder("root")),
                 model.blocks[0].register_forward_hook(recorder("block"))]
        result = _train(model, ref, steps=3, micro=1)
        for hook in hooks:
            hook.remove()
        out[name] = {
            "losses": result["losses"], "dtypes": seen,
            "params": {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
                       for n, p in model.named_parameters()},
            "param_dtype": next(model.parameters()).dtype,
        }
    return out


def test_fsdp2_mixed_precision_policy(ranks: RankPools) -> None:
    """FSDP2's policy is converted: bitwise the same training as our equivalent policy, bf16
    compute, ``output_dtype`` applied to the unit's outputs, fp32 sharded parameters, and
    FSDP2's losses."""
    results = ranks.run(_mp_worker, 2, timeout_s=TIMEOUT_S)
    for rank, r in enumerate(results):
        assert r["converted"]["losses"] == r["ours"]["losses"], rank
        for n, p in r["converted"]["params"].items():
            assert torch.equal(p, r["ours"]["params"][n]), (rank, n)
        for name in ("converted", "fsdp2"):
            assert r[name]["dtypes"] == {"block": torch.bfloat16, "root": torch.float32}, (
                rank, name, r[name]["dtypes"])
            assert r[name]["param_dtype"] == torch.float32, (rank, name)
        torch.testing.assert_close(r["converted"]["losses"], r["fsdp2"]["losses"], rtol=2e-2,
                                   atol=1e-3)


# ---------------------------------------------------------------------- explicit prefetch

def _prefetch_worker(rank: int, world: int) -> dict[str, Any]:
    model, ref = _net()
    _wrap(model)
    blocks = model.blocks
    blocks[0].set_modules_to_forward_prefetch([blocks[1], blocks[2]])  # type: ignore[operator]
    blocks[1].set_modules_to_forward_prefetch([])  # type: ignore[operator]
    blocks[2].set_modules_to_backward_prefetch([blocks[0]])  # type: ignore[operator]
    errors = []
    try:
        blocks[0].set_modules_to_forward_prefetch([model.inp])  # type: ignore[operator]
        errors.append("a module that is not a unit was accepted")
    except TypeError as e:
        if "not a fully_shard module" not in str(e):
            errors.append(f"unclear error: {e}")
    result = _train(model, ref, steps=1, micro=1)
    ctx = state_of(model).ctx  # type: ignore[union-attr]
    ctx.events = []
    second = _train(model, ref, steps=2, micro=1)
    result["losses"] += second["losses"]
    result["ref_losses"] += second["ref_losses"]
    result["errors"] += second["errors"] + errors
    result["events"] = [e for e in ctx.events if e[0] in ("unshard", "prefetch")]
    return result


def test_explicit_prefetch(ranks: RankPools) -> None:
    """Explicit lists replace the recorded-order neighbor; the numbers are unchanged."""
    results = ranks.run(_prefetch_worker, 2, timeout_s=TIMEOUT_S)
    _check_training(results)
    events = results[0]["events"]
    # One training step: forward then backward.
    one_step = events[: len(events) // 2]
    assert one_step == [
        # forward: the root prefetches blocks.0 (its recorded neighbor); blocks.0 prefetches
        # blocks.1 and blocks.2 (explicit), blocks.1 nothing (explicit empty list).
        ("unshard", "<root>"), ("prefetch", "blocks.0"),
        ("prefetch", "blocks.1"), ("prefetch", "blocks.2"),
        # backward: the root (first in forward order) has no unit before it to prefetch;
        # blocks.2 prefetches blocks.0 (explicit) instead of blocks.1, which gathers on its
        # own; blocks.1's default prefetch (blocks.0) finds it gathered already.
        ("unshard", "<root>"), ("unshard", "blocks.2"), ("prefetch", "blocks.0"),
        ("unshard", "blocks.1"),
    ], events


def _foreign_prefetch_worker(rank: int, world: int) -> dict[str, Any]:
    model, ref = _net()
    _wrap(model)
    other, _ = _net(seed=1)
    _wrap(other)
    model.blocks[1].set_modules_to_forward_prefetch([other.blocks[0]])  # type: ignore[operator]
    raised = None
    try:
        _loss(model, _batches(1, 1)[0][0]).backward()
    except ValueError as e:
        raised = str(e)
    # Every rank raised at the same point: the next step recovers and trains correctly.
    model.blocks[1].set_modules_to_forward_prefetch([])  # type: ignore[operator]
    result = _train(model, ref, steps=2, micro=1)
    result["raised"] = raised
    return result


def test_prefetch_of_a_unit_of_another_tree_raises(ranks: RankPools) -> None:
    results = ranks.run(_foreign_prefetch_worker, 2, timeout_s=TIMEOUT_S)
    _check_training(results)
    for r in results:
        assert r["raised"] is not None and "not a unit of the same fully_shard tree" in r[
            "raised"], r["raised"]


# ---------------------------------------------------------------------- torch clip_grad_norm_

class Tiny(nn.Module):
    """At world 3 rank 2's shards are all empty: every one of its grads has zero rows."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _clip_worker(rank: int, world: int, norm_type: float) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Tiny()
    ref = copy.deepcopy(model)
    fully_shard(model, timeout=30)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 2, generator=g), torch.randn(8, 1, generator=g)
    (10 * F.mse_loss(model(x), y)).backward()
    (10 * F.mse_loss(ref(x), y)).backward()
    grads_none = [n for n, p in model.named_parameters() if p.grad is None]
    empty = [n for n, p in model.named_parameters() if p.to_local().numel() == 0]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type)
    errors = []
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        lo, hi = shard_rows(p)
        if hi > lo:
            torch.testing.assert_close(p.grad.to_local(), ref_params[name].grad[lo:hi])
    # The route decides from the parameters: every rank raises, before any collective.
    raised = []
    for kwargs in ({"norm_type": 0.0}, {"error_if_nonfinite": True}):
        if "error_if_nonfinite" in kwargs:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.to_local().fill_(math.inf)
        try:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, **kwargs)
            raised.append(None)
        except (ValueError, RuntimeError) as e:
            raised.append(f"{type(e).__name__}: {e}")
    # A list without fully_shard parameters is torch's own function's business.
    plain = [nn.Parameter(torch.ones(3))]
    plain[0].grad = torch.full((3,), 2.0)
    plain_norm = torch.nn.utils.clip_grad.clip_grad_norm_(plain, 1.0, 2.0)
    return {"norm": float(norm), "ref_norm": float(ref_norm), "grads_none": grads_none,
            "empty": empty,
            "errors": errors, "raised": raised, "plain_norm": float(plain_norm),
            "plain_grad": plain[0].grad.tolist()}


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
def test_torch_clip_grad_norm_with_empty_shards(ranks: RankPools, norm_type: float) -> None:
    results = ranks.run(_clip_worker, 3, norm_type, timeout_s=TIMEOUT_S)
    # Rank 2 holds no rows, yet a (zero-row) gradient of every parameter, as with FSDP2.
    assert results[2]["empty"] == ["net.weight", "net.bias"], results[2]["empty"]
    assert all(r["grads_none"] == [] for r in results), [r["grads_none"] for r in results]
    for rank, r in enumerate(results):
        assert not r["errors"], (rank, r["errors"])
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5), (rank, r)
        assert r["raised"][0] is not None and "norm_type=0.0" in r["raised"][0], r["raised"]
        assert r["raised"][1] is not None and "error_if_nonfinite" in r["raised"][1], r["raised"]
        assert r["plain_norm"] == pytest.approx(math.sqrt(12.0))
        assert r["plain_grad"] == pytest.approx([2.0 / math.sqrt(12.0)] * 3, rel=1e-5)


# ---------------------------------------------------------------------- offload_policy accepted

def _offload_default_worker(rank: int, world: int) -> dict[str, Any]:
    model, ref = _net()
    _wrap(model, offload_policy=OffloadPolicy())
    return _train(model, ref, steps=1, micro=1)


def test_default_offload_policy_is_accepted(ranks: RankPools) -> None:
    _check_training(ranks.run(_offload_default_worker, 2, timeout_s=TIMEOUT_S))
