"""Wrap-time helpers: the default mesh, collecting and validating the parameters a unit manages,
and the cross-rank consistency check. Runs before any buffer is built, so a bad call leaves the
module untouched."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from .api import SUPPORTED_DTYPES, MixedPrecisionPolicy, ShardingStrategy

__all__ = ["ManagedParam", "default_mesh", "collect_managed_params", "check_ranks_agree"]

# Attribute set on a module's original parameters once a unit manages them (they become the
# compute parameters, views into the unit's flat buffers).
COMPUTE_PARAM_ATTR = "_mfsdp_compute_param_of"

_LAUNCH_HINT = (
    "launch with torchrun (e.g. `torchrun --nproc_per_node=2 train.py`) and call "
    "torch.distributed.init_process_group('nccl' on GPUs or 'gloo' on CPU) before fully_shard"
)

_default_meshes: dict[str, DeviceMesh] = {}


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the whole world: ``cuda`` for NCCL, ``cpu`` otherwise (gloo)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"fully_shard needs an initialized default process group: {_LAUNCH_HINT}")
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = _default_meshes.get(device_type)
    if mesh is None:
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        _default_meshes[device_type] = mesh
    return mesh


def validate_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    if mesh is None:
        return default_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"mesh must be 1-D (the data-parallel dimension), got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)}; pass mesh['dp'] or a 1-D init_device_mesh(...)"
        )
    return mesh


@dataclass
class ManagedParam:
    fqn: str
    param: nn.Parameter


def _is_wrapped(module: nn.Module) -> bool:
    return hasattr(module, "_mfsdp_state")


def collect_managed_params(
    module: nn.Module,
    mesh: DeviceMesh,
    ignored_params: Iterable[nn.Parameter] | None,
) -> list[ManagedParam]:
    """The parameters ``module``'s unit will manage: its own and those of its submodules, minus
    ignored ones and those of already-wrapped submodules. Raises on anything unsupported."""
    ignored = set(ignored_params or ())
    for p in ignored:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"ignored_params must contain parameters, got {type(p).__name__}")
    all_params = {id(p) for p in module.parameters()}
    for p in ignored:
        if id(p) not in all_params:
            raise ValueError(
                f"ignored_params contains a parameter of shape {tuple(p.shape)} that is not in "
                f"{type(module).__name__}; pass only parameters of the module being wrapped"
            )
    ignored_ids = {id(p) for p in ignored}
    wrapped_children: list[str] = []
    managed: list[ManagedParam] = []
    seen: set[int] = set()
    for prefix, submodule in module.named_modules():
        if submodule is not module and any(prefix.startswith(w + ".") or prefix == w for w in wrapped_children):
            continue
        if submodule is not module and _is_wrapped(submodule):
            wrapped_children.append(prefix)
            continue
        for name, param in submodule._parameters.items():
            if param is None or id(param) in ignored_ids or id(param) in seen:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            seen.add(id(param))
            owner = getattr(param, COMPUTE_PARAM_ATTR, None)
            if owner is not None or isinstance(param, DTensor):
                raise ValueError(
                    f"parameter '{fqn}' is already managed by another fully_shard unit"
                    f"{f' ({owner})' if owner else ''}; a parameter shared between modules "
                    "(e.g. tied weights) must be managed by one unit: wrap a common ancestor "
                    "instead, or pass it in ignored_params"
                )
            managed.append(ManagedParam(fqn, param))
    for m in managed:
        p = m.param
        if p.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"parameter '{m.fqn}' has dtype {p.dtype}; fully_shard supports "
                f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}. Pass it in ignored_params"
            )
        if p.dim() == 0:
            raise ValueError(
                f"parameter '{m.fqn}' is 0-dimensional, which cannot be sharded on dim 0; "
                "give it shape (1,) or pass it in ignored_params"
            )
        if p.device.type != mesh.device_type:
            raise ValueError(
                f"parameter '{m.fqn}' is on {p.device} but the mesh is on '{mesh.device_type}'; "
                f"move the module to {mesh.device_type} before fully_shard (or pass a mesh of "
                "the parameters' device type)"
            )
    devices = {m.param.device for m in managed}
    if len(devices) > 1:
        raise ValueError(
            f"the parameters of one fully_shard unit must be on one device, found "
            f"{sorted(str(d) for d in devices)}; move the module with .to(device) first"
        )
    return managed


def unit_signature(
    module: nn.Module, managed: list[ManagedParam], strategy: ShardingStrategy,
    mp_policy: MixedPrecisionPolicy, scaling: float | None,
) -> list[str]:
    """What every rank must agree on, one line per item, for :func:`check_ranks_agree`."""
    lines = [
        f"module class: {type(module).__name__}",
        f"sharding_strategy: {strategy.value}",
        f"mp_policy: {mp_policy}",
        f"gradient_scaling_factor: {scaling}",
    ]
    lines += [
        f"parameter {m.fqn}: shape={tuple(m.param.shape)} dtype={m.param.dtype} "
        f"requires_grad={m.param.requires_grad}"
        for m in managed
    ]
    return lines


def check_ranks_agree(lines: list[str], mesh: DeviceMesh) -> None:
    """One 8-byte all-gather of a digest; on a mismatch, name the first differing line."""
    group = mesh.get_group()
    world = mesh.size()
    if world == 1:
        return
    digest = int.from_bytes(hashlib.sha256("\n".join(lines).encode()).digest()[:7], "little")
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    everyone = torch.empty(world, dtype=torch.int64, device=device)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(everyone, mine, group=group)
    if bool((everyone == mine).all()):
        return
    all_lines: list[list[str] | None] = [None] * world
    dist.all_gather_object(all_lines, lines, group=group)
    reference = all_lines[0] or []
    for rank, other in enumerate(all_lines):
        other = other or []
        for i in range(max(len(reference), len(other))):
            a = reference[i] if i < len(reference) else "<missing>"
            b = other[i] if i < len(other) else "<missing>"
            if a != b:
                raise ValueError(
                    f"ranks disagree on what fully_shard wraps: rank 0 has '{a}' but rank "
                    f"{rank} has '{b}'; every rank must wrap the same model with the same "
                    "arguments"
                )
