"""Training parity against a single-process reference on the same global batch.

One test id per case (e.g. ``test_parity_all_strategies[w3-optim_grads-micro3-nested]``), so a
failure names its case and can be rerun alone. The cases of a module run on one pool of spawned
ranks per world size (``_pool.RankPools``), restarted after any failure, instead of paying a
spawn per case.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist

from megatron_fsdp_v2 import MixedPrecisionPolicy, clip_grad_norm_, fully_shard

from _models import (
    OddMLP,
    TinyGPT,
    all_ranks_ok,
    assert_close_to_reference,
    cat_batch,
    lm_loss,
    make_batches,
    mlp_loss,
    reference_copy,
)
from _pool import RankPools

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TIMEOUT_S = 240  # per case; below pytest's 300 s so that the ranks' tracebacks are reported


def wrap(model: torch.nn.Module, strategy: str, nested: bool, **kw) -> torch.nn.Module:
    if nested:
        for block in getattr(model, "blocks", []):
            fully_shard(block, sharding_strategy=strategy, **kw)
    return fully_shard(model, sharding_strategy=strategy, **kw)


def train_and_compare(rank: int, world: int, *, kind: str, strategy: str, micro: int,
                      nested: bool, steps: int = 5, mp: MixedPrecisionPolicy | None = None,
                      ref_dtype: torch.dtype | None = None, rtol: float = 1e-5, atol: float = 1e-6,
                      loss_tol: float = 1e-5, checkpoint: str | None = None, mark: bool = True,
                      seed: int = 0) -> None:
    case = (f"{kind} {strategy} world={world} micro={micro} nested={nested} mark={mark} "
            f"checkpoint={checkpoint} mp={mp}")
    torch.manual_seed(seed)
    model = TinyGPT(checkpoint=checkpoint) if kind == "lm" else OddMLP()
    ref = reference_copy(model)
    kw = {"mp_policy": mp} if mp is not None else {}
    model = wrap(model, strategy, nested, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    loss_fn = lm_loss if kind == "lm" else mlp_loss
    batches = make_batches(kind, steps, micro, world, per_rank=2, seed=seed)
    for step in range(steps):
        total = torch.zeros(())
        ref_total = torch.zeros(())
        for i in range(micro):
            if mark:
                model.set_is_last_backward(i == micro - 1)
            loss = loss_fn(model, batches[step][i][rank]) / micro
            loss.backward()
            total += loss.detach().float()
            ref_model_in = cat_batch(kind, batches[step][i])
            ref_compute = _cast_ref(ref, ref_dtype) if ref_dtype else ref
            ref_loss = loss_fn(ref_compute, ref_model_in) / micro
            ref_loss.backward()
            ref_total += ref_loss.detach().float()
        if ref_dtype:
            _fold_ref_grads(ref)
        clip_grad_norm_(model.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        dist.all_reduce(total)
        total /= world
        ok = abs(total.item() - ref_total.item()) <= loss_tol * max(1.0, abs(ref_total.item()))
        assert all_ranks_ok(ok), (
            f"{case} step {step}: loss {total.item()} vs reference {ref_total.item()}"
        )
    try:
        assert_close_to_reference(model, ref, rtol=rtol, atol=atol)
        ok = True
    except AssertionError as e:
        err, ok = e, False
    if not all_ranks_ok(ok):
        raise AssertionError(f"{case}: parameters differ: "
                             f"{err if not ok else 'on another rank'}")


# fp32 reference -> its compute copy in the low-precision dtype.
_REF_COMPUTE: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = (
    weakref.WeakKeyDictionary()
)


def _cast_ref(ref: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A compute copy of the fp32 reference in ``dtype`` (the casts the FSDP run does)."""
    compute = _REF_COMPUTE.get(ref)
    if compute is None:
        compute = reference_copy(ref).to(dtype)
        _REF_COMPUTE[ref] = compute
    with torch.no_grad():
        for (_, p), (_, c) in zip(ref.named_parameters(), compute.named_parameters()):
            c.copy_(p)
    return compute


def _fold_ref_grads(ref: torch.nn.Module) -> None:
    compute = _REF_COMPUTE[ref]
    for (_, p), (_, c) in zip(ref.named_parameters(), compute.named_parameters()):
        p.grad = None if c.grad is None else c.grad.float()
        c.grad = None


def _bf16_worker(rank: int, world: int, strategy: str) -> None:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=torch.float32,
                              reduce_dtype=torch.float32)
    train_and_compare(rank, world, kind="lm", strategy=strategy, micro=2, nested=True,
                      mp=mp, ref_dtype=torch.bfloat16, rtol=2e-2, atol=2e-3, loss_tol=2e-2)


# Cases are ordered by world size (2, then 3, then 4) so that the module starts few pools.


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", [2], ids=lambda w: f"w{w}")
def test_parity_bf16_compute_fp32_main(ranks: RankPools, world_size: int, strategy: str) -> None:
    ranks.run(_bf16_worker, world_size, strategy, timeout_s=TIMEOUT_S)


def _parity_worker(rank: int, world: int, strategy: str, micro: int, nested: bool) -> None:
    train_and_compare(rank, world, kind="lm", strategy=strategy, micro=micro, nested=nested)


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("micro", [1, 3], ids=lambda m: f"micro{m}")
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", [2, 3, 4], ids=lambda w: f"w{w}")
def test_parity_all_strategies(ranks: RankPools, world_size: int, strategy: str, micro: int,
                               nested: bool) -> None:
    ranks.run(_parity_worker, world_size, strategy, micro, nested, timeout_s=TIMEOUT_S)


def _odd_worker(rank: int, world: int, strategy: str, variant: str) -> None:
    if variant == "mlp-marked":
        train_and_compare(rank, world, kind="mlp", strategy=strategy, micro=2, nested=False)
    elif variant == "mlp-unmarked":
        # An unmarked loop (every backward is "last") must stay correct.
        train_and_compare(rank, world, kind="mlp", strategy=strategy, micro=2, nested=False,
                          mark=False)
    else:
        mode = variant.removeprefix("lm-checkpoint-")
        train_and_compare(rank, world, kind="lm", strategy=strategy, micro=2, nested=True,
                          checkpoint=mode)


ODD_VARIANTS = ["mlp-marked", "mlp-unmarked", "lm-checkpoint-inner", "lm-checkpoint-outer"]


@pytest.mark.parametrize("variant", ODD_VARIANTS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", [4], ids=lambda w: f"w{w}")
def test_parity_odd_shapes_frozen_shared_checkpointing(ranks: RankPools, world_size: int,
                                                       strategy: str, variant: str) -> None:
    ranks.run(_odd_worker, world_size, strategy, variant, timeout_s=TIMEOUT_S)
