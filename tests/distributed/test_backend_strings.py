"""Every way of naming the backend in ``init_process_group`` (issue 23, item 1): ``fully_shard``
with the default mesh trains like single-process PyTorch, ``collective_impl="auto"`` applies
gloo's rules, ``load_full_state_dict(broadcast_from_rank0=True)`` loads, and the default mesh
goes on CUDA exactly when the group has a CUDA backend of its own and CUDA is available.

``init_process_group()`` with no backend stores ``"undefined"`` and ``"cpu:gloo,cuda:nccl"`` is
kept verbatim, so a check of ``dist.get_backend() == "nccl"`` misses both (see
``[Note: backend detection]``). NCCL cannot be created without a GPU, so ``"cpu:gloo,cuda:fake"``
stands in for ``"cpu:gloo,cuda:nccl"`` here: gloo does the CPU work, and torch's fake backend
(registered by importing ``fake_pg`` below, before the ranks initialize) is a CUDA backend that is
not gloo, as NCCL is. The default-mesh case pretends CUDA is available (``torch.cuda.is_available``
patched in the rank) and records the device type the mesh would be built on.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

# private: saves and clears the process-wide default meshes (_registry.default_meshes)
from megatron_fsdp_v2 import _registry, fully_shard

# private: the backend a group resolves to (impl.backend_of) and the collective-kind names
from megatron_fsdp_v2._comm import _collective_impl as impl

# private: intercepts the mesh default_mesh() builds (_process_groups.init_device_mesh)
from megatron_fsdp_v2._comm import _process_groups

# private: the device type the library's collectives run on
from megatron_fsdp_v2._comm._backends import collective_device_type
from megatron_fsdp_v2.checkpoint import load_full_state_dict
from megatron_fsdp_v2.testing import run_distributed

from _models import agree, assert_close_to_reference, make_batches, reference_copy

TIMEOUT_S = 240
_CUDA_HERE = torch.cuda.is_available()

# (backend passed to init_process_group, the config torch stores, the default mesh's device type
# when CUDA is available)
CASES = [
    pytest.param(None, "cpu:gloo", "cpu", id="none",
                 marks=pytest.mark.skipif(_CUDA_HERE, reason="no backend means NCCL on a GPU "
                                          "machine; this case is the CPU meaning")),
    pytest.param("cpu:gloo", "cpu:gloo", "cpu", id="cpu:gloo"),
    pytest.param("cpu:gloo,cuda:fake", "cpu:gloo,cuda:fake", "cuda", id="cpu:gloo,cuda:fake",
                 marks=pytest.mark.skipif(_CUDA_HERE, reason="the default mesh would be a CUDA "
                                          "mesh of the fake backend on a GPU machine")),
    pytest.param("gloo", "cpu:gloo,cuda:gloo", "cpu", id="gloo"),
]


class Wide(nn.Module):
    """A unit (``big``) whose flat buffer exceeds gloo's 1 MiB reduce-scatter threshold, so
    ``collective_impl="auto"`` substitutes its reduce-scatter when the backend is known."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(15, 512)
        self.big = nn.Linear(512, 512)
        self.out = nn.Linear(512, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.big(F.gelu(self.inp(x)))))


def _default_mesh_device_with_cuda() -> tuple[str, str]:
    """(the device type ``default_mesh`` builds on, ``collective_device_type()``) with
    ``torch.cuda.is_available`` pretending True; the mesh itself is not built."""
    saved_meshes = dict(_registry.default_meshes)
    saved_init, saved_available = _process_groups.init_device_mesh, torch.cuda.is_available
    seen: list[str] = []

    def record(device_type: str, shape: tuple[int, ...], **_: Any) -> Any:
        seen.append(device_type)
        return object()

    _registry.default_meshes.clear()
    _process_groups.init_device_mesh = record  # type: ignore[assignment]
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    try:
        _process_groups.default_mesh()
        return seen[0], collective_device_type()
    finally:
        torch.cuda.is_available = saved_available  # type: ignore[assignment]
        _process_groups.init_device_mesh = saved_init  # type: ignore[assignment]
        _registry.default_meshes.clear()
        _registry.default_meshes.update(saved_meshes)


def _backend_worker(rank: int, world: int, config: str, cuda_mesh_type: str) -> None:
    def check_config() -> None:
        assert dist.get_backend_config() == config, dist.get_backend_config()
        # The backend that runs CPU collectives, whatever string named it.
        assert impl.backend_of(dist.group.WORLD, "cpu") == "gloo", (
            impl.backend_of(dist.group.WORLD, "cpu"))
    agree("backend config", check_config)

    torch.manual_seed(0)
    model = Wide()
    ref = reference_copy(model)
    fully_shard(model.big, collective_impl="auto")
    fully_shard(model, collective_impl="auto")
    agree("default mesh on CPU", lambda: _assert(
        all(p.device_mesh.device_type == "cpu" for p in model.parameters()),
        "a parameter is not on a CPU mesh"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in make_batches("mlp", steps=2, micro=1, world=world, per_rank=2):
        x, y = step[0][rank]
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_x = torch.cat([b[0] for b in step[0]])
        ref_y = torch.cat([b[1] for b in step[0]])
        F.mse_loss(ref(ref_x), ref_y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
    agree("parameters match single-process PyTorch",
          lambda: assert_close_to_reference(model, ref, rtol=1e-5, atol=1e-6))
    stats = model.big.collective_stats()  # type: ignore[operator]
    agree("auto substitutes the big reduce-scatter (gloo's rule applies)", lambda: _assert(
        (impl.REDUCE_SCATTER, impl.ALL_REDUCE) in stats, f"collective_stats {stats}"))

    # Rank 0 alone holds a different state dict; every rank must end up with its rows.
    torch.manual_seed(1)
    other = Wide()
    load_full_state_dict(model, other.state_dict() if rank == 0 else None,
                         broadcast_from_rank0=True)
    agree("load_full_state_dict(broadcast_from_rank0=True)",
          lambda: assert_close_to_reference(model, other, rtol=0, atol=0, what="loaded"))

    mesh_type, scalar_type = _default_mesh_device_with_cuda()
    agree("default mesh when CUDA is available", lambda: _assert(
        (mesh_type, scalar_type) == (cuda_mesh_type, cuda_mesh_type),
        f"config {config}: default mesh {mesh_type!r}, library tensors {scalar_type!r}, "
        f"expected {cuda_mesh_type!r}"))


def _assert(ok: bool, message: str) -> None:
    assert ok, message


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("backend,config,cuda_mesh_type", CASES)
def test_backend_strings(backend: str | None, config: str, cuda_mesh_type: str) -> None:
    run_distributed(_backend_worker, 2, config, cuda_mesh_type, backend=backend,
                    timeout_s=TIMEOUT_S)
