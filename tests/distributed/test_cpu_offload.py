"""``offload_policy=CPUOffloadPolicy(...)`` (FSDP2's argument; see [Note: CPU offload] in
``megatron_fsdp_v2/_frontend/_fsdp2_compat.py`` and [Note: host offload] in
``megatron_fsdp_v2/_runtime/_offload.py``).

On a CPU mesh every flat buffer already is host memory, so the policy is accepted and must change
nothing: the same losses as one process and as FSDP2 with the same policy, bitwise the same as
without the policy, no copy (the optimizer's parameters and gradients view the flat buffers,
which never move) and the same memory report and collectives. Strategies other than
``optim_grads_params`` are refused before anything changes.

The copying path (accelerator meshes) is tested here on CPU through the test-only switch
``FORCE_COPIES_ENV``, which makes a CPU mesh take it: main weights and gradients in buffers of
their own (the "host" side), each gather's input copied from them and each reduced gradient
shard copied back. Against the run without the policy (bitwise), one process and FSDP2 with the
policy: losses, parameters, collective counts, the memory report and the estimator, checkpoints
(ours and torch DCP). The CUDA path itself (pinned memory, non-blocking copies, events) runs in
the GPU test at the end (``scripts/gpu_check.sh``). See ``_fsdp2_api.py`` for how the
distributed cases run.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
from _fsdp2_api import (
    TIMEOUT_S,
    Net,
    _batches,
    _gathers,
    _loss,
    _net,
    _reduce_scatters,
    _train,
    _wrap,
)
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import (
    FSDPModule,
    MixedPrecisionPolicy,
    estimate,
    fully_shard,
    iter_full_weights,
    memory_report,
)
from megatron_fsdp_v2 import checkpoint as mckpt

# private: the unit's flat groups (state_of(m).groups), to check that the optimizer's parameters
#   and gradients view the groups' host buffers (no copy on a CPU mesh; their own buffers on the
#   copying path)
from megatron_fsdp_v2._registry import state_of

# private: the test-only switch that sends a CPU mesh down the copying path, and the path
#   decision's result (no public API chooses or reports the path)
from megatron_fsdp_v2._runtime._offload import FORCE_COPIES_ENV, OffloadConfig
from megatron_fsdp_v2.testing import run_distributed
from megatron_fsdp_v2.utils import clip_grad_norm_

from _comm_counts import CollectiveCounts
from _pool import RankPools

pytestmark = pytest.mark.timeout(600)


def _untouched(model: nn.Module) -> bool:
    return not isinstance(model, FSDPModule) and not any(
        isinstance(p, DTensor) for p in model.parameters()
    )


# ---------------------------------------------------------------------- refusals (no collective)

@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_strategies_without_sharded_weights_are_refused(strategy: str) -> None:
    """Raised before any collective (no process group exists here), module untouched."""
    model = Net()
    with pytest.raises(NotImplementedError) as info:
        fully_shard(model, sharding_strategy=strategy, offload_policy=CPUOffloadPolicy())
    message = str(info.value)
    for needle in (f"sharding_strategy={strategy!r}", "sharding_strategy='optim_grads_params'",
                   "leave offload_policy unset"):
        assert needle in message, message
    assert _untouched(model)


@pytest.mark.parametrize("policy, needle", [
    (CPUOffloadPolicy(pin_memory="yes"), "pin_memory=...) must be a bool, got str"),  # type: ignore[arg-type]
    ("cpu", "offload_policy must be None, torch.distributed.fsdp.OffloadPolicy()"),
], ids=["pin-memory-type", "policy-type"])
def test_bad_policies_are_type_errors(policy: Any, needle: str) -> None:
    model = Net()
    with pytest.raises(TypeError) as info:
        fully_shard(model, offload_policy=policy)
    assert needle in str(info.value), str(info.value)
    assert _untouched(model)


def test_which_path_each_mesh_takes() -> None:
    """The path decision itself (no mesh needed): no copies on a CPU mesh, the copying path
    with the policy's pin_memory on CUDA (or on CPU with the test switch), HSDP refused on the
    copying path naming what to do."""
    # private: the path decision itself (which mesh copies), checked without a mesh
    from megatron_fsdp_v2._frontend._fsdp2_compat import host_offload_config

    assert os.environ.get(FORCE_COPIES_ENV) is None
    assert host_offload_config(CPUOffloadPolicy(), "cpu", False) is None
    assert host_offload_config(CPUOffloadPolicy(), "cpu", True) is None  # HSDP, no copies
    assert host_offload_config(CPUOffloadPolicy(), "cuda", False) == OffloadConfig(True)
    assert host_offload_config(CPUOffloadPolicy(pin_memory=False), "cuda", False) == \
        OffloadConfig(False)
    with _forced_copies():
        assert host_offload_config(CPUOffloadPolicy(), "cpu", False) == OffloadConfig(True)
    with pytest.raises(NotImplementedError) as info:
        host_offload_config(CPUOffloadPolicy(), "cuda", True)
    for needle in ("2-D (HSDP) 'cuda' mesh", "Use a 1-D mesh", "leave offload_policy unset"):
        assert needle in str(info.value), str(info.value)


@contextlib.contextmanager
def _forced_copies() -> Iterator[None]:
    """CPUOffloadPolicy on a CPU mesh takes the copying path while wrapping inside this."""
    os.environ[FORCE_COPIES_ENV] = "1"
    try:
        yield
    finally:
        del os.environ[FORCE_COPIES_ENV]


# ---------------------------------------------------------------------- parity on CPU meshes

_CASES = {
    # name: (our kwargs, FSDP2's kwargs, tolerance against one process and FSDP2)
    "fp32": ({}, {}, 1e-5),
    "fp32-keep-gathered": ({"reshard_after_forward": False},
                           {"reshard_after_forward": False}, 1e-5),
    "bf16-fp32-main": (
        {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                           reduce_dtype=torch.float32)},
        {"mp_policy": TorchMixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.float32)},
        2e-2),
}


def _parity_worker(rank: int, world: int, case: str) -> dict[str, Any]:
    ours_kw, fsdp2_kw, _ = _CASES[case]
    runs = {}
    for name, wrap, kw in [
        # CPUOffloadPolicy()'s default pin_memory=True: nothing to pin on a CPU mesh.
        ("offload", fully_shard, {**ours_kw, "offload_policy": CPUOffloadPolicy()}),
        ("plain", fully_shard, {**ours_kw, "offload_policy": OffloadPolicy()}),
        # FSDP2 pins with pin_memory=True, which needs a CUDA driver.
        ("fsdp2", torch_fully_shard,
         {**fsdp2_kw, "offload_policy": CPUOffloadPolicy(pin_memory=False)}),
    ]:
        model, ref = _net()
        _wrap(model, wrap, **kw)
        runs[name] = _train(model, ref, steps=3, micro=2)
    return runs


@pytest.mark.parametrize("case", list(_CASES))
def test_parity_with_fsdp2_and_one_process(ranks: RankPools, case: str) -> None:
    """optim_grads_params with CPUOffloadPolicy: bitwise the run without it, and within the
    case's tolerance of one process and of FSDP2 with the same policy, every step."""
    tol = _CASES[case][2]
    results = ranks.run(_parity_worker, 2, case, timeout_s=TIMEOUT_S)
    for rank, runs in enumerate(results):
        offload, plain, fsdp2 = runs["offload"], runs["plain"], runs["fsdp2"]
        assert offload["losses"] == plain["losses"], (rank, offload["losses"], plain["losses"])
        torch.testing.assert_close(offload["losses"], fsdp2["losses"], rtol=tol, atol=1e-6)
        torch.testing.assert_close(offload["losses"], offload["ref_losses"], rtol=tol, atol=1e-6)
        if tol <= 1e-5:  # bf16 compute: the parameters drift apart within the losses' bound
            assert not offload["errors"], (rank, offload["errors"][:3])
            assert not fsdp2["errors"], (rank, fsdp2["errors"][:3])


# ---------------------------------------------------------------------- no copy on CPU meshes

def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _views_of_buffers(model: nn.Module) -> list[str]:
    """Every optimizer-facing parameter (and gradient, when there is one) of ``model``'s units
    views its group's flat buffer in host memory: nothing was copied out of it."""
    problems = []
    for module in model.modules():
        state = state_of(module)
        if state is None:
            continue
        for group in state.groups:
            for p in group.dist_params:
                local = p.to_local()
                if local.device.type != "cpu" or _storage(local) != _storage(group.main_weight):
                    problems.append(f"parameter {tuple(local.shape)} is not a view of main_weight")
                if p.grad is not None:
                    grad = p.grad.to_local()
                    main_grad = group.grads.ensure_main_grad()
                    if grad.device.type != "cpu" or _storage(grad) != _storage(main_grad):
                        problems.append(f"gradient {tuple(grad.shape)} is not a view of main_grad")
    return problems


def _no_copy_worker(rank: int, world: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, policy in [("offload", CPUOffloadPolicy()), ("plain", None)]:
        model, ref = _net()
        _wrap(model, offload_policy=policy)
        params = list(model.parameters())
        pointers = [p.to_local().data_ptr() for p in params]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
        model(x).square().mean().backward()
        problems = _views_of_buffers(model)  # gradients installed, before the step
        opt.step()
        problems += _views_of_buffers(model)
        state_devices = {t.device.type for s in opt.state.values() for t in s.values()}
        report = memory_report(model, optimizer=opt)
        found[name] = {
            "problems": problems,
            "moved": [i for i, p in enumerate(params) if p.to_local().data_ptr() != pointers[i]],
            "state_devices": sorted(state_devices),
            "report": dataclasses.asdict(report),
            "total": report.total,
            "host_bytes": report.host_bytes,
            "device_bytes": report.device_bytes,
            "counts": _train(model, copy.deepcopy(ref), steps=2, micro=1, count_step=1)["counts"],
        }
    return found


def test_no_copy_on_cpu_meshes(ranks: RankPools) -> None:
    """The optimizer's parameters and gradients view the flat buffers before and after the step
    (no copy, nothing moved), optimizer state is on the CPU, and the memory report (every byte
    in host memory), the scratch peak and the collectives equal those without the policy."""
    for rank, found in enumerate(ranks.run(_no_copy_worker, 2, timeout_s=TIMEOUT_S)):
        offload, plain = found["offload"], found["plain"]
        assert not offload["problems"], (rank, offload["problems"])
        assert offload["moved"] == [], (rank, offload["moved"])
        assert offload["state_devices"] == ["cpu"], (rank, offload["state_devices"])
        assert offload["report"] == plain["report"], (rank, offload["report"], plain["report"])
        for run in (offload, plain):  # a CPU mesh: every byte in host memory
            assert run["host_bytes"] == run["total"] > 0, (rank, run)
            assert run["device_bytes"] == 0, (rank, run)
        assert offload["counts"] == plain["counts"], (rank, offload["counts"], plain["counts"])
        assert offload["counts"][0] > 0, (rank, offload["counts"])


# ---------------------------------------------------------------------- HSDP, and ranks that differ

def _hsdp_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    runs = {}
    for name, wrap, kw in [
        ("offload", fully_shard, {"offload_policy": CPUOffloadPolicy()}),
        ("plain", fully_shard, {}),
        ("fsdp2", torch_fully_shard, {"offload_policy": CPUOffloadPolicy(pin_memory=False)}),
    ]:
        model, ref = _net()
        _wrap(model, wrap, mesh=mesh, **kw)
        runs[name] = _train(model, ref, steps=2, micro=2)
    return runs


def test_hsdp_parity_with_fsdp2_and_one_process(ranks: RankPools) -> None:
    """A (2, 2) HSDP mesh, inner optim_grads_params: the same checks as on a 1-D mesh."""
    for rank, runs in enumerate(ranks.run(_hsdp_worker, 4, timeout_s=TIMEOUT_S)):
        offload, plain, fsdp2 = runs["offload"], runs["plain"], runs["fsdp2"]
        assert offload["losses"] == plain["losses"], (rank, offload["losses"], plain["losses"])
        torch.testing.assert_close(offload["losses"], fsdp2["losses"], rtol=1e-5, atol=1e-6)
        assert not offload["errors"], (rank, offload["errors"][:3])
        assert not fsdp2["errors"], (rank, fsdp2["errors"][:3])


def _differing_ranks_worker(rank: int, world: int) -> str:
    model = Net()
    try:
        fully_shard(model, offload_policy=CPUOffloadPolicy() if rank == 0 else None)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_ranks_that_differ_fail_together(ranks: RankPools) -> None:
    """The policy is part of what every rank must agree on: one rank offloading and the other
    not is an error on both (the cross-rank check), not a silent difference."""
    for rank, message in enumerate(ranks.run(_differing_ranks_worker, 2, timeout_s=TIMEOUT_S)):
        for needle in ("ranks disagree", "rank 0 has 'offload_policy: CPUOffloadPolicy'"):
            assert needle in message, (rank, message)


# ---------------------------------------------------------------------- the copying path, on CPU

def _host_layout_problems(model: nn.Module) -> list[str]:
    """The copying path's buffers: every group offloads, keeps no device shard
    (``model_weight`` empty), its main weights are a buffer of their own that the optimizer's
    parameters (and gradients, where installed: ``main_grad``) view."""
    problems = []
    for module in model.modules():
        state = state_of(module)
        if state is None:
            continue
        for group in state.groups:
            if group.host_offload is None or group.model_weight.numel() != 0:
                problems.append(f"{group.name}: not on the copying path")
            if not group.plan.main_weight_separate:
                problems.append(f"{group.name}: main weights alias the device buffer")
            for p in group.dist_params:
                if _storage(p.to_local()) != _storage(group.main_weight):
                    problems.append(f"{group.name}: a parameter does not view main_weight")
                if p.grad is not None and \
                        _storage(p.grad.to_local()) != _storage(group.grads.ensure_main_grad()):
                    problems.append(f"{group.name}: a gradient does not view main_grad")
    return problems


def _final_params(model: nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def _full_weights(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """The full weights on the host, through get_full_state_dict and iter_full_weights (both
    gather the main weights, which the copying path keeps in host memory)."""
    full = mckpt.get_full_state_dict(model, rank0_only=False)
    streamed = {n: t.detach().to("cpu", copy=True)
                for n, t in iter_full_weights(model, bucket_size_mb=1)}
    return {"full": {n: t.detach().cpu() for n, t in full.items()}, "streamed": streamed}


def _same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                  tol: float = 0.0) -> list[str]:
    if list(got) != list(want):
        return [f"names {list(got)} != {list(want)}"]
    return [name for name in got if not torch.allclose(got[name], want[name], rtol=tol,
                                                       atol=tol and 1e-6)]


def _copies_worker(rank: int, world: int, case: str) -> dict[str, Any]:
    ours_kw, fsdp2_kw, _ = _CASES[case]
    runs: dict[str, Any] = {}
    for name, wrap, kw, forced in [
        ("copies", fully_shard, {**ours_kw, "offload_policy": CPUOffloadPolicy()}, True),
        ("plain", fully_shard, ours_kw, False),
        ("fsdp2", torch_fully_shard,
         {**fsdp2_kw, "offload_policy": CPUOffloadPolicy(pin_memory=False)}, False),
    ]:
        model, ref = _net()
        with _forced_copies() if forced else contextlib.nullcontext():
            _wrap(model, wrap, **kw)
        runs[name] = _train(model, ref, steps=3, micro=2, count_step=1)
        runs[name]["params"] = _final_params(model)
        if name != "fsdp2":
            runs[name].update(_full_weights(model))
        if name == "copies":
            runs[name]["problems"] = _host_layout_problems(model)
    return runs


@pytest.mark.parametrize("case", list(_CASES))
def test_copying_path_equals_no_offload_fsdp2_and_one_process(ranks: RankPools,
                                                              case: str) -> None:
    """The copying path forced on CPU: every group keeps its main weights and gradients in
    buffers of its own, and training is bitwise the run without the policy (losses and final
    parameters) with the same all-gathers and reduce-scatters per step, and within the case's
    tolerance of one process and of FSDP2 with the policy."""
    tol = _CASES[case][2]
    for rank, runs in enumerate(ranks.run(_copies_worker, 2, case, timeout_s=TIMEOUT_S)):
        copies, plain, fsdp2 = runs["copies"], runs["plain"], runs["fsdp2"]
        assert not copies["problems"], (rank, copies["problems"])
        assert copies["losses"] == plain["losses"], (rank, copies["losses"], plain["losses"])
        for got, want in zip(copies["params"], plain["params"]):
            assert torch.equal(got, want), (rank, got, want)
        for how in ("full", "streamed"):  # the full weights, gathered from the host buffers
            assert not _same_weights(copies[how], plain[how]), (rank, how)
        torch.testing.assert_close(copies["losses"], fsdp2["losses"], rtol=tol, atol=1e-6)
        torch.testing.assert_close(copies["losses"], copies["ref_losses"], rtol=tol, atol=1e-6)
        if tol <= 1e-5:
            assert not copies["errors"], (rank, copies["errors"][:3])
        # FSDP2's own counts differ by schedule (its root keeps gathered weights, it reduces
        # once per window under set_requires_gradient_sync(False)), with or without the policy.
        assert copies["counts"] == plain["counts"], (rank, copies["counts"], plain["counts"])
        assert copies["counts"][0] > 0 and copies["counts"][1] > 0, (rank, copies["counts"])


def _measured(model: nn.Module, micro: int) -> dict[str, Any]:
    """Two iterations marked with set_is_last_backward; the memory report (with the
    optimizer) after the second one's last backward, before its step: the estimator's
    moment."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    report = None
    for step, parts in enumerate(_batches(2, micro)):
        for i, batch in enumerate(parts):
            model.set_is_last_backward(i == micro - 1)  # type: ignore[operator]
            (_loss(model, batch) / micro).backward()
        if step == 1:
            report = memory_report(model, optimizer=opt)
        opt.step()
        opt.zero_grad()
    assert report is not None
    return {"fields": dataclasses.asdict(report), "total": report.total,
            "offloaded": report.offloaded_bytes, "host": report.host_bytes}


def _memory_worker(rank: int, world: int, precision: str) -> dict[str, Any]:
    mp = {} if precision == "fp32" else {"mp_policy": _CASES["bf16-fp32-main"][0]["mp_policy"]}
    found = {}
    for name, kw, forced in [("copies", {"offload_policy": CPUOffloadPolicy()}, True),
                             ("plain", {}, False)]:
        model, _ = _net()
        with _forced_copies() if forced else contextlib.nullcontext():
            _wrap(model, **mp, **kw)
        found[name] = _measured(model, micro=2)
    return found


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_memory_report_and_estimate_of_the_copying_path(ranks: RankPools,
                                                        precision: str) -> None:
    """``memory_report``: the offloaded bytes are the main weights, main gradients and
    optimizer state, no device shard is kept (``model_weights`` 0), and the total equals the
    run without the policy (the shard moved, nothing added). The estimator with
    ``cpu_offload=True`` gives each rank's report exactly, offloaded bytes included."""
    mp = None if precision == "fp32" else _CASES["bf16-fp32-main"][0]["mp_policy"]
    for rank, found in enumerate(ranks.run(_memory_worker, 2, precision, timeout_s=TIMEOUT_S)):
        copies, plain = found["copies"], found["plain"]
        fields = copies["fields"]
        assert fields["model_weights"] == 0, (rank, fields)
        assert fields["main_weights"] > 0 and fields["main_grads"] > 0, (rank, fields)
        assert copies["offloaded"] == (fields["main_weights"] + fields["main_grads"]
                                       + fields["optimizer_state"]), (rank, copies)
        assert plain["offloaded"] == 0, (rank, plain)
        assert copies["total"] == plain["total"], (rank, copies, plain)
        assert copies["host"] == copies["total"], (rank, copies)  # a CPU mesh: all host
        est = estimate(Net, world_size=2, rank=rank, wrap=(nn.Sequential,), micro_batches=2,
                       mp_policy=mp, cpu_offload=True)
        assert dataclasses.asdict(est.memory) == fields, (rank, est.memory, fields)
        assert est.memory.offloaded_bytes == copies["offloaded"], (rank, est.memory)
        assert est.memory.host_bytes == copies["offloaded"], (rank, est.memory)
        plain_est = estimate(Net, world_size=2, rank=rank, wrap=(nn.Sequential,),
                             micro_batches=2, mp_policy=mp)
        assert dataclasses.asdict(plain_est.memory) == plain["fields"], (rank, plain_est.memory)
        assert plain_est.memory.offloaded_bytes == plain_est.memory.host_bytes == 0


def _checkpoint_worker(rank: int, world: int, root: str, api: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        model, _ = _net()
        with _forced_copies():
            _wrap(model, offload_policy=CPUOffloadPolicy())
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
        losses = []
        batches = _batches(4, 1)
        for step in steps:
            loss = _loss(model, batches[step][0])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    path = os.path.join(root, api)
    model, opt = make()
    train(model, opt, range(2))
    if api == "ours":
        mckpt.save(model, opt, checkpoint_id=path)
    else:
        msd, osd = mckpt.get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    expected = train(model, opt, range(2, 4))
    expected_params = _final_params(model)

    fresh, fresh_opt = make()
    train(fresh, fresh_opt, range(1))  # moved away from the checkpoint, state created
    if api == "ours":
        mckpt.load(fresh, fresh_opt, checkpoint_id=path)
    else:
        msd, osd = mckpt.get_state_dict(fresh, fresh_opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        mckpt.set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    resumed = train(fresh, fresh_opt, range(2, 4))
    same = all(torch.equal(a, b) for a, b in zip(_final_params(fresh), expected_params))
    return {"expected": expected, "resumed": resumed, "same_params": same,
            "problems": _host_layout_problems(fresh)}


@pytest.mark.parametrize("api", ["ours", "dcp"])
def test_checkpoints_round_trip_on_the_copying_path(ranks: RankPools, tmp_path: Any,
                                                    api: str) -> None:
    """Saved after two steps (our ``checkpoint.save``, or torch DCP over ``get_state_dict``)
    and loaded into a model that trained elsewhere: the next two steps' losses and the final
    parameters are bitwise those of the run that went on, and the loaded model still trains
    from its host buffers."""
    results = ranks.run(_checkpoint_worker, 2, str(tmp_path), api, timeout_s=TIMEOUT_S)
    for rank, r in enumerate(results):
        assert r["resumed"] == r["expected"], (rank, r)
        assert r["same_params"], rank
        assert not r["problems"], (rank, r["problems"])


# ---------------------------------------------------------------------- the CUDA path (GPU set)

def _cuda_train(model: nn.Module, ref: nn.Module, steps: int, micro: int) -> dict[str, Any]:
    """``_train``'s loop with the batches on the current CUDA device, the last step clipped
    (our clip_grad_norm_ on the host gradients, torch's on the reference)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    losses, ref_losses, norms, counts = [], [], [], None
    for step, parts in enumerate(_batches(steps, micro)):
        comm = CollectiveCounts()
        with comm if step == 1 else contextlib.nullcontext():
            for i, (x, y) in enumerate(parts):
                model.set_is_last_backward(i == micro - 1)  # type: ignore[operator]
                batch = (x.cuda(), y.cuda())
                loss = _loss(model, batch) / micro
                loss.backward()
                ref_loss = _loss(ref, batch) / micro
                ref_loss.backward()
                losses.append(loss.item())
                ref_losses.append(ref_loss.item())
        if step == steps - 1:
            norms = [clip_grad_norm_(list(model.parameters()), 0.5).item(),
                     torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item()]
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == 1:
            counts = (_gathers(comm), _reduce_scatters(comm))
    state_devices = sorted({t.device.type for s in opt.state.values() for t in s.values()})
    return {"losses": losses, "ref_losses": ref_losses, "norms": norms, "counts": counts,
            "state_devices": state_devices}


def _cuda_worker(rank: int, world: int, case: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world,))
    ours_kw, _, _ = _CASES[case]
    runs: dict[str, Any] = {}
    for name, kw in [("offload", {"offload_policy": CPUOffloadPolicy()}),
                     ("unpinned", {"offload_policy": CPUOffloadPolicy(pin_memory=False)}),
                     ("plain", {})]:
        model, ref = _net()
        model, ref = model.cuda(), ref.cuda()
        _wrap(model, mesh=mesh, **ours_kw, **kw)
        where = {}
        for module in model.modules():
            state = state_of(module)
            for group in state.groups if state is not None else ():
                where[group.name] = (group.main_weight.device.type,
                                     group.main_weight.is_pinned(),
                                     group.model_weight.numel())
        runs[name] = _cuda_train(model, ref, steps=3, micro=2)
        runs[name]["params"] = [t.cpu() for t in _final_params(model)]
        runs[name]["ref_params"] = [t.detach().cpu() for t in ref.parameters()]
        runs[name]["param_devices"] = sorted({p.to_local().device.type
                                              for p in model.parameters()})
        runs[name]["where"] = where
        runs[name]["offloaded"] = memory_report(model).offloaded_bytes
        runs[name].update(_full_weights(model))
    return runs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", ["fp32", "bf16-fp32-main"])
def test_cuda_path_equals_no_offload(world: int, case: str) -> None:
    """On CUDA (NCCL): main weights in pinned host memory (``pin_memory=True``; pageable with
    ``False``), no device shard, the optimizer's parameters and state on the CPU, and training
    (the last step clipped) equal to the run without offload and to one process within the
    case's tolerance (the copies move bits, but the step runs on the CPU, whose AdamW kernels
    may round differently from CUDA's); the same collectives."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    tol = _CASES[case][2]
    results = run_distributed(_cuda_worker, world, case, backend="nccl", timeout_s=TIMEOUT_S)
    for rank, runs in enumerate(results):
        plain = runs["plain"]
        for name, pinned in (("offload", True), ("unpinned", False)):
            run = runs[name]
            assert run["param_devices"] == ["cpu"], (rank, name, run["param_devices"])
            assert run["state_devices"] == ["cpu"], (rank, name, run["state_devices"])
            assert all(w == ("cpu", pinned, 0) for w in run["where"].values()), (
                rank, name, run["where"])
            assert run["offloaded"] > 0, (rank, name)
            assert run["counts"] == plain["counts"], (rank, name, run["counts"], plain["counts"])
            torch.testing.assert_close(run["losses"], plain["losses"], rtol=tol, atol=1e-6)
            torch.testing.assert_close(run["losses"], run["ref_losses"], rtol=tol, atol=1e-6)
            torch.testing.assert_close(run["norms"][0], plain["norms"][0], rtol=tol, atol=1e-6)
            torch.testing.assert_close(run["norms"][0], run["norms"][1], rtol=tol, atol=1e-6)
            for got, want in zip(run["params"], plain["params"]):
                torch.testing.assert_close(got, want, rtol=tol, atol=1e-6)
            for how in ("full", "streamed"):  # gathered from the host buffers over NCCL
                assert not _same_weights(run[how], plain[how], tol), (rank, name, how)
        assert plain["param_devices"] == ["cuda"], (rank, plain["param_devices"])


def _hook_refusal_worker(rank: int, world: int) -> str:
    model, _ = _net()
    with _forced_copies():
        _wrap(model, offload_policy=CPUOffloadPolicy())
    try:
        model.set_all_reduce_hook(lambda reduced: None)  # type: ignore[operator]
    except NotImplementedError as e:
        return str(e)
    return "accepted"


def test_all_reduce_hook_is_refused_on_the_copying_path(ranks: RankPools) -> None:
    """FSDP2's all-reduce hook would get the reduced gradients in host memory, where its
    collective cannot run on NCCL: refused naming the policy, on every rank."""
    for rank, message in enumerate(ranks.run(_hook_refusal_worker, 2, timeout_s=TIMEOUT_S)):
        for needle in ("set_all_reduce_hook", "CPUOffloadPolicy()", "host memory",
                       "Leave offload_policy unset"):
            assert needle in message, (rank, message)


def _muon_refusal_worker(rank: int, world: int) -> dict[str, Any]:
    model, _ = _net()
    with _forced_copies():
        _wrap(model, offload_policy=CPUOffloadPolicy())
    _loss(model, _batches(1, 1)[0][0]).backward()
    matrices = [p for p in model.parameters() if p.ndim == 2]
    before = [p.to_local().detach().clone() for p in matrices]
    muon = torch.optim.Muon(matrices, lr=0.02)
    try:
        muon.step()
    except NotImplementedError as e:
        message = str(e)
    else:
        message = "accepted"
    unchanged = all(torch.equal(p.to_local(), b) for p, b in zip(matrices, before))
    return {"message": message, "unchanged": unchanged and not muon.state}


def test_muon_is_refused_on_the_copying_path(ranks: RankPools) -> None:
    """torch.optim.Muon's whole-matrix exchange would run its collectives on host buffers:
    refused at its first step, before any collective, nothing changed."""
    for rank, found in enumerate(ranks.run(_muon_refusal_worker, 2, timeout_s=TIMEOUT_S)):
        for needle in ("torch.optim.Muon", "CPUOffloadPolicy()", "host memory",
                       "Leave offload_policy unset", "Nothing was changed"):
            assert needle in found["message"], (rank, found["message"])
        assert found["unchanged"], rank
