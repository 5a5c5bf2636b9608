"""Training parity against a single-process reference on the same global batch."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_fsdp_v2 import MixedPrecisionPolicy, clip_grad_norm_, fully_shard
from megatron_fsdp_v2.testing import run_distributed

from _models import (
    OddMLP, TinyGPT, all_ranks_ok, assert_close_to_reference, cat_batch, lm_loss, make_batches,
    mlp_loss, reference_copy,
)

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


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
            ref_loss = loss_fn(_cast_ref(ref, ref_dtype), ref_model_in) / micro if ref_dtype else loss_fn(ref, ref_model_in) / micro
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
            f"{strategy} micro={micro} nested={nested} step {step}: loss {total.item()} vs "
            f"reference {ref_total.item()}"
        )
    try:
        assert_close_to_reference(model, ref, rtol=rtol, atol=atol)
        ok = True
    except AssertionError as e:
        err, ok = e, False
    if not all_ranks_ok(ok):
        raise AssertionError(f"{strategy} micro={micro} nested={nested}: parameters differ: "
                             f"{err if not ok else 'on another rank'}")


_REF_COMPUTE: dict[int, torch.nn.Module] = {}


def _cast_ref(ref: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A compute copy of the fp32 reference in ``dtype`` (the casts the FSDP run does)."""
    compute = _REF_COMPUTE.get(id(ref))
    if compute is None:
        compute = reference_copy(ref).to(dtype)
        _REF_COMPUTE[id(ref)] = compute
    with torch.no_grad():
        for (_, p), (_, c) in zip(ref.named_parameters(), compute.named_parameters()):
            c.copy_(p)
    return compute


def _fold_ref_grads(ref: torch.nn.Module) -> None:
    compute = _REF_COMPUTE[id(ref)]
    for (_, p), (_, c) in zip(ref.named_parameters(), compute.named_parameters()):
        p.grad = None if c.grad is None else c.grad.float()
        c.grad = None


def _parity_sweep(rank: int, world: int) -> None:
    for strategy, micro, nested in itertools.product(STRATEGIES, (1, 3), (True, False)):
        train_and_compare(rank, world, kind="lm", strategy=strategy, micro=micro, nested=nested)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_parity_all_strategies(world_size: int) -> None:
    run_distributed(_parity_sweep, world_size, timeout_s=300)


def _odd_sweep(rank: int, world: int) -> None:
    for strategy in STRATEGIES:
        train_and_compare(rank, world, kind="mlp", strategy=strategy, micro=2, nested=False)
        # An unmarked loop (every backward is "last") must stay correct.
        train_and_compare(rank, world, kind="mlp", strategy=strategy, micro=2, nested=False, mark=False)
        for mode in ("inner", "outer"):
            train_and_compare(rank, world, kind="lm", strategy=strategy, micro=2, nested=True,
                              checkpoint=mode)


@pytest.mark.parametrize("world_size", [4])
def test_parity_odd_shapes_frozen_shared_checkpointing(world_size: int) -> None:
    run_distributed(_odd_sweep, world_size, timeout_s=300)


def _bf16_sweep(rank: int, world: int) -> None:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=torch.float32,
                              reduce_dtype=torch.float32)
    for strategy in STRATEGIES:
        train_and_compare(rank, world, kind="lm", strategy=strategy, micro=2, nested=True,
                          mp=mp, ref_dtype=torch.bfloat16, rtol=2e-2, atol=2e-3, loss_tol=2e-2)


@pytest.mark.parametrize("world_size", [2])
def test_parity_bf16_compute_fp32_main(world_size: int) -> None:
    run_distributed(_bf16_sweep, world_size, timeout_s=300)
