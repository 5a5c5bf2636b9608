"""FSDP2's manual backward finalization (``set_manual_backward_finalization`` /
``finalize_backward``, torch 2.15's API, ours on every supported torch): see [Note: manual
backward finalization] in ``_runtime/_finalize.py``.

Training cases: 2 gloo ranks, every strategy and HSDP, 3 micro-batches per step under manual
finalization, ended by ``finalize_backward`` (synchronous or through its handle), against one
process on the same global batch, with the collectives of a step counted (the strategy contract
with N = 3: no backward ends the window, the finalization does), and FSDP2 on the same input as
the control where torch has the API. With synchronization left on during the micro-batches, the
manual mode alone keeps the window open (``no_shard``: one all-reduce per step, not three).
The error cases raise ``RuntimeError``/``TypeError`` as FSDP2 does, before any collective.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
from _fsdp2_api import TIMEOUT_S, _batches, _count, _loss, _net, _param_errors, _wrap
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import fully_shard

# private: counts the units' parameter groups (state_of(unit).groups)
from megatron_fsdp_v2._registry import state_of

from _comm_counts import CollectiveCounts
from _models import shard_rows
from _pool import RankPools

pytestmark = pytest.mark.timeout(600)

STEPS, MICRO = 3, 3
# torch 2.15 added the API to FSDP2: the control runs where it exists.
TORCH_HAS_API = hasattr(TorchFSDPModule, "finalize_backward")
# Collectives per flat group and step with N = MICRO (reshard_after_forward=True: ZeRO-3
# gathers in every forward and backward).
CONTRACT = {
    "no_shard": {"AG": 0, "RS": 0, "AR": 1},
    "optim": {"AG": 1, "RS": 1, "AR": 0},
    "optim_grads": {"AG": 1, "RS": MICRO, "AR": 0},
    "optim_grads_params": {"AG": 2 * MICRO, "RS": MICRO, "AR": 0},
}


def _collectives(comm: CollectiveCounts) -> dict[str, int]:
    return {
        "AG": _count(comm, "_allgather_base", "all_gather_into_tensor",
                     "allgather_into_tensor_coalesced"),
        "RS": _count(comm, "_reduce_scatter_base", "reduce_scatter_tensor",
                     "reduce_scatter_tensor_coalesced"),
        "AR": _count(comm, "allreduce", "all_reduce", "allreduce_coalesced"),
    }


def _train_manual(model: nn.Module, ref: nn.Module, *, sync_during: bool, async_op: bool,
                  count_step: int = 1) -> dict[str, Any]:
    """``STEPS`` steps of ``MICRO`` micro-batches under manual finalization; the reference
    trains on the same batches. Returns the losses, the collectives of ``count_step`` and
    the parameter mismatches after each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    model.set_manual_backward_finalization(True)  # type: ignore[operator]
    losses, ref_losses, errors, counts = [], [], [], None
    for step, parts in enumerate(_batches(STEPS, MICRO)):
        comm = CollectiveCounts()
        with comm:
            for batch in parts:
                model.set_requires_gradient_sync(sync_during)  # type: ignore[operator]
                loss = _loss(model, batch) / MICRO
                loss.backward()
                losses.append(loss.item())
            model.set_requires_gradient_sync(True)  # type: ignore[operator]
            handle = model.finalize_backward(async_op=async_op)  # type: ignore[operator]
            if async_op:
                handle.wait()
            else:
                assert handle is None
        opt.step()
        opt.zero_grad()
        for batch in parts:
            ref_loss = _loss(ref, batch) / MICRO
            ref_loss.backward()
            ref_losses.append(ref_loss.item())
        ref_opt.step()
        ref_opt.zero_grad()
        if step == count_step:
            counts = _collectives(comm)
        errors += [f"step {step}: {e}" for e in _param_errors(model, ref)]
    model.set_manual_backward_finalization(False)  # type: ignore[operator]
    return {"losses": losses, "ref_losses": ref_losses, "counts": counts, "errors": errors}


def _groups(model: nn.Module) -> int:
    return sum(len(s.groups) for m in model.modules() if (s := state_of(m)) is not None)


def _training_worker(rank: int, world: int, variant: str, sync_during: bool,
                     async_op: bool) -> list[str]:
    found: list[str] = []
    if variant == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        kw: dict[str, Any] = {"sharding_strategy": "optim_grads_params",
                              "outer_dp_sharding_strategy": "no_shard"}
    else:
        mesh = init_device_mesh("cpu", (world,))
        kw = {"sharding_strategy": variant}
    model, ref = _net()
    if variant == "fsdp2":
        _wrap(model, torch_fully_shard, mesh=mesh)
    else:
        _wrap(model, fully_shard, mesh=mesh, **kw)
    r = _train_manual(model, ref, sync_during=sync_during, async_op=async_op)
    found += r["errors"][:5]
    try:
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-5, atol=1e-7)
    except AssertionError as e:
        found.append(f"losses: {e}")
    if variant in CONTRACT:
        groups = _groups(model)
        want = {op: k * groups for op, k in CONTRACT[variant].items()}
        if r["counts"] != want:
            found.append(f"collectives of step 1: {r['counts']}, want {want} "
                         f"({groups} groups, N = {MICRO})")
    return found


CASES = [(v, sync, a) for v in ("no_shard", "optim", "optim_grads", "optim_grads_params")
         for sync, a in ((False, True), (True, False))]


@pytest.mark.parametrize("variant,sync_during,async_op", CASES)
def test_manual_finalization_matches_one_process(
        ranks: RankPools, variant: str, sync_during: bool, async_op: bool) -> None:
    """Losses and parameters equal one process; the step's collectives are the contract's
    with N micro-batches, synchronization on or off during them."""
    results = ranks.run(_training_worker, 2, variant, sync_during, async_op, timeout_s=TIMEOUT_S)
    for rank, found in enumerate(results):
        assert not found, f"rank {rank}: " + "\n".join(found)


@pytest.mark.parametrize("async_op", [False, True])
def test_manual_finalization_hsdp(ranks: RankPools, async_op: bool) -> None:
    """HSDP (inner ZeRO-3, outer no_shard) on 2 x 2 ranks: the outer reduction runs at the
    finalization."""
    results = ranks.run(_training_worker, 4, "hsdp", False, async_op, timeout_s=TIMEOUT_S)
    for rank, found in enumerate(results):
        assert not found, f"rank {rank}: " + "\n".join(found)


@pytest.mark.skipif(not TORCH_HAS_API, reason="FSDP2 has manual finalization from torch 2.15")
def test_fsdp2_control(ranks: RankPools) -> None:
    """The same loop on FSDP2 trains to the same reference (the control of the cases above)."""
    results = ranks.run(_training_worker, 2, "fsdp2", False, True, timeout_s=TIMEOUT_S)
    for rank, found in enumerate(results):
        assert not found, f"rank {rank}: " + "\n".join(found)


# ---------------------------------------------------------------------- errors and edge cases

def _expect(found: list[str], what: str, exc: type[BaseException], match: str,
            fn: Any) -> None:
    try:
        fn()
        found.append(f"{what}: no error")
    except exc as e:
        if match not in str(e):
            found.append(f"{what}: message {e!r}")


def _errors_worker(rank: int, world: int) -> list[str]:
    found: list[str] = []
    mesh = init_device_mesh("cpu", (world,))
    model, ref = _net()
    _wrap(model, fully_shard, mesh=mesh, sharding_strategy="optim_grads_params")
    batch = _batches(1, 1)[0][0]
    # Before the first forward: a no-op (FSDP2's rule), handle included.
    if model.finalize_backward() is not None:
        found.append("finalize before the first forward returned something")
    model.finalize_backward(async_op=True).wait()
    _expect(found, "non-bool", TypeError, "must be a bool",
            lambda: model.set_manual_backward_finalization(1))
    _expect(found, "non-bool async_op", TypeError, "must be a bool",
            lambda: model.finalize_backward(async_op="yes"))
    _loss(model, batch).backward()  # automatic: the window ended
    model.zero_grad()
    _expect(found, "finalize without manual mode", RuntimeError,
            "requires manual backward finalization", model.finalize_backward)
    _expect(found, "manual mode below the root", RuntimeError, "root",
            lambda: model.blocks[0].set_manual_backward_finalization(True))
    model.set_manual_backward_finalization(True)
    _expect(found, "finalize below the root", RuntimeError, "root",
            lambda: model.blocks[0].finalize_backward())

    # Changing the mode inside a backward.
    def hook(grad: torch.Tensor) -> torch.Tensor:
        _expect(found, "mode change in backward", RuntimeError, "during backward",
                lambda: model.set_manual_backward_finalization(False))
        _expect(found, "finalize in backward", RuntimeError, "after backward completes",
                model.finalize_backward)
        return grad

    out = model(batch[0])
    out.register_hook(hook)
    torch.nn.functional.mse_loss(out, batch[1]).backward()
    # A backward ran under manual mode: no gradient installed yet, and the mode stays.
    if any(p.grad is not None for p in model.parameters()):
        found.append("a gradient was installed before finalize_backward")
    _expect(found, "mode off before finalizing", RuntimeError, "call finalize_backward() first",
            lambda: model.set_manual_backward_finalization(False))
    handle = model.finalize_backward(async_op=True)
    _expect(found, "finalize with a handle pending", RuntimeError, "must be waited on",
            model.finalize_backward)
    handle.wait()
    handle.wait()  # a second wait does nothing
    if any(p.grad is None for p in model.parameters()):
        found.append("gradients missing after the handle's wait")
    ref_loss = torch.nn.functional.mse_loss(ref(batch[0]), batch[1])
    ref_loss.backward()
    found += [f"grads: {e}" for e in _grad_errors(model, ref)]
    model.zero_grad()
    ref.zero_grad()

    # A handle not waited on: the next forward finishes it; the gradients are those of the
    # finalized backward plus nothing else (zero_grad after reading them).
    _loss(model, batch).backward()
    handle = model.finalize_backward(async_op=True)
    model(batch[0])  # the next forward waits for it
    handle.wait()  # then the handle does nothing
    ref_loss = _loss(ref, batch)
    ref_loss.backward()
    found += [f"grads after a forward finished the handle: {e}" for e in _grad_errors(model, ref)]
    model.zero_grad()
    ref.zero_grad()

    # A handle not waited on before the optimizer step (or clipping): the step finishes it
    # and sees every gradient; one not waited on before zero_grad installs nothing later.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to finalize "unsynchronized": the handle's
        for parts in _batches(2, 2):
            for micro in parts:
                (_loss(model, micro) / 2).backward()
                (_loss(ref, micro) / 2).backward()
            handle = model.finalize_backward(async_op=True)
            opt.step()
            handle.wait()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
    found += [f"step before wait: {e}" for e in _param_errors(model, ref)]
    _loss(model, batch).backward()
    handle = model.finalize_backward(async_op=True)
    model.zero_grad()
    handle.wait()
    if any(p.grad is not None for p in model.parameters()):
        found.append("a handle waited on after zero_grad installed gradients")

    # reset_iter_state drops a pending finalization: its handle's wait raises (FSDP2's rule).
    _loss(model, batch).backward()
    handle = model.finalize_backward(async_op=True)
    model.reset_iter_state()
    _expect(found, "wait after reset", RuntimeError, "invalidated", handle.wait)
    if any(p.grad is not None for p in model.parameters()):
        found.append("the gradients of a finalization reset_iter_state dropped were installed")
    model.set_manual_backward_finalization(False)  # nothing awaits finalization any more
    # Training goes on, automatic again.
    _loss(model, batch).backward()
    ref_loss = _loss(ref, batch)
    ref_loss.backward()
    found += [f"grads after reset: {e}" for e in _grad_errors(model, ref)]
    return found


def _grad_errors(model: nn.Module, ref: nn.Module) -> list[str]:
    """This rank's gradient rows against the reference's (same global batch on every rank)."""
    errors = []
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = ref_params[name].grad
        if p.grad is None or want is None:
            errors.append(f"{name}: grad {p.grad is not None} reference {want is not None}")
            continue
        if isinstance(p, DTensor):
            lo, hi = shard_rows(p)
            local, want = p.grad.to_local(), want[lo:hi]
        else:
            local = p.grad
        try:
            torch.testing.assert_close(local, want, rtol=1e-5, atol=1e-6)
        except AssertionError as e:
            errors.append(f"{name}: {e}")
    return errors


def test_manual_finalization_errors_and_handles(ranks: RankPools) -> None:
    """FSDP2's errors (root only, manual mode required, not inside a backward, one handle at a
    time, a reset handle), the no-op before the first forward, and a handle the next forward
    finishes; gradients equal the reference's where they are read."""
    results = ranks.run(_errors_worker, 2, timeout_s=TIMEOUT_S)
    for rank, found in enumerate(results):
        assert not found, f"rank {rank}: " + "\n".join(found)
