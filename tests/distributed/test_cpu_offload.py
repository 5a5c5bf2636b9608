"""``offload_policy=CPUOffloadPolicy(...)`` (FSDP2's argument; see [Note: CPU offload] in
``megatron_fsdp_v2/_frontend/_fsdp2_compat.py``).

On a CPU mesh every flat buffer already is host memory, so the policy is accepted and must change
nothing: the same losses as one process and as FSDP2 with the same policy, bitwise the same as
without the policy, no copy (the optimizer's parameters and gradients view the flat buffers,
which never move) and the same memory report and collectives. Strategies other than
``optim_grads_params`` and CUDA meshes are refused before anything changes (see
``_fsdp2_api.py`` for how the distributed cases run).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.nn as nn
from _fsdp2_api import TIMEOUT_S, Net, _net, _train, _wrap
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import FSDPModule, MixedPrecisionPolicy, fully_shard, memory_report
from megatron_fsdp_v2._registry import state_of

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


def test_cuda_meshes_are_refused_by_name() -> None:
    """The device check itself (a CUDA mesh cannot be built here; the GPU test below wraps
    on one): accepted on CPU, refused naming the device and what to do elsewhere."""
    from megatron_fsdp_v2._frontend._fsdp2_compat import check_offload_device

    check_offload_device("cpu")
    with pytest.raises(NotImplementedError) as info:
        check_offload_device("cuda")
    message = str(info.value)
    for needle in ("on a 'cuda' mesh", "not implemented", "accepted on CPU meshes",
                   "Leave offload_policy unset"):
        assert needle in message, message


def _cuda_refusal_worker(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (world,))
    model = Net().cuda()
    try:
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
    except NotImplementedError as e:
        assert _untouched(model)
        return str(e)
    return "accepted"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_mesh_is_refused_before_any_change(ranks: RankPools) -> None:
    """On a CUDA mesh the host copies are not implemented: refused, module untouched."""
    [message] = ranks.run(_cuda_refusal_worker, 1, timeout_s=TIMEOUT_S)
    assert "on a 'cuda' mesh" in message, message


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
