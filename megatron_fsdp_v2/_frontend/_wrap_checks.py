"""Wrap-time checks: argument validation, collecting and validating the parameters a unit
manages, the cross-rank consistency check, and the padding warning. Everything that can reject
a call runs before any collective (except the cross-rank check, which shares a failure) and
before any buffer is built, so a bad call leaves the module untouched (see design.md §8)."""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .. import _registry
from .._buffers._layout import BufferLayout
from .._dtensor._tp_params import SpmdMesh, TPFace, tp_face_of
from .._runtime._subclass_gather import has_all_gather_extensions
from ..api import SUPPORTED_DTYPES, MixedPrecisionPolicy, ShardingStrategy
from ._param_classes import check_param_class
from ._spmd_types import spmd_types_face

__all__ = [
    "ManagedParam",
    "check_param_init_fn",
    "check_module",
    "check_ranks_agree",
    "collect_managed_params",
    "raise_on_every_rank",
    "validate_options",
    "warn_if_padded",
]


def validate_options(
    gradient_scaling_factor: Any, max_padding_ratio: Any, timeout: Any
) -> timedelta | None:
    """Check the scalar arguments of ``fully_shard``; returns the timeout as a ``timedelta``
    (``None``: the mesh's own process group and its timeout)."""
    if gradient_scaling_factor is not None:
        if isinstance(gradient_scaling_factor, bool) or not isinstance(
            gradient_scaling_factor, (int, float)
        ):
            raise TypeError(
                "gradient_scaling_factor must be a number or None (None averages gradients over "
                f"the mesh), got {type(gradient_scaling_factor).__name__}"
            )
        if not math.isfinite(gradient_scaling_factor) or gradient_scaling_factor <= 0:
            raise ValueError(
                f"gradient_scaling_factor must be a positive finite number, got "
                f"{gradient_scaling_factor}; use None to average gradients over the mesh"
            )
    if isinstance(max_padding_ratio, bool) or not isinstance(max_padding_ratio, (int, float)):
        raise TypeError(
            f"max_padding_ratio must be a number, got {type(max_padding_ratio).__name__}"
        )
    if not (0 <= max_padding_ratio < math.inf):
        raise ValueError(
            f"max_padding_ratio must be a finite number >= 0 (a fraction, e.g. 0.01), got "
            f"{max_padding_ratio}"
        )
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (timedelta, int, float)):
        raise TypeError(
            "timeout must be a datetime.timedelta, a number of seconds, or None (the mesh's own "
            f"process group and its timeout), got {type(timeout).__name__}"
        )
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not (0 < seconds < math.inf):
        raise ValueError(
            f"timeout must be positive and finite, got {seconds} s; pass e.g. "
            "timeout=timedelta(minutes=5), or None for the process group's own timeout"
        )
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)


def check_module(module: Any) -> None:
    """Reject what ``fully_shard`` cannot wrap, before looking at its parameters."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    from torch.nn.parallel import DistributedDataParallel

    wrappers: list[tuple[type, str, str]] = [
        (DistributedDataParallel, "DistributedDataParallel", "its .module"),
    ]
    try:
        from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers += [
            (TorchFSDPModule, "torch.distributed.fsdp.fully_shard", "a fresh, unwrapped module"),
            (FullyShardedDataParallel, "torch.distributed.fsdp.FullyShardedDataParallel",
             "its .module before wrapping"),
        ]
    except ImportError:  # pragma: no cover - torch built without FSDP
        pass
    for cls, name, fix in wrappers:
        if isinstance(module, cls):
            raise ValueError(
                f"fully_shard got a module already wrapped by {name} ({type(module).__name__}); "
                f"use one data-parallel wrapper per module: pass {fix} instead"
            )


# ---------------------------------------------------------------------- parameters

@dataclass
class ManagedParam:
    fqn: str
    param: nn.Parameter
    tp: TPFace | None = None  # a tensor-parallel DTensor parameter (see [Note: 2-D parameters])

    @property
    def local(self) -> torch.Tensor:
        """What the flat buffers hold: the parameter, or its TP-local tensor."""
        return self.param if self.tp is None else self.tp.local_of(self.param)


def _is_wrapped(module: nn.Module) -> bool:
    return _registry.state_of(module) is not None


def _check_ignored(module: nn.Module, ignored_params: Any) -> set[int]:
    if ignored_params is None:
        return set()
    if isinstance(ignored_params, torch.Tensor):
        raise TypeError(
            "ignored_params must be an iterable of parameters (e.g. [model.norm.weight]), got a "
            "single tensor"
        )
    if isinstance(ignored_params, (str, bytes)) or not isinstance(ignored_params, Iterable):
        raise TypeError(
            "ignored_params must be an iterable of parameters (e.g. [model.norm.weight]), got "
            f"{type(ignored_params).__name__}"
        )
    ignored = list(ignored_params)
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    for p in ignored:
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"ignored_params must contain parameters (tensors), got {type(p).__name__}"
                + ("; pass module.get_parameter(name), not the name" if isinstance(p, str) else "")
            )
        if id(p) not in names:
            raise ValueError(
                f"ignored_params contains a parameter of shape {tuple(p.shape)} that is not in "
                f"{type(module).__name__}; pass only parameters of the module being wrapped"
            )
    return {id(p) for p in ignored}


def collect_managed_params(
    module: nn.Module,
    mesh: DeviceMesh,
    ignored_params: Iterable[nn.Parameter] | None,
    spmd: SpmdMesh | None = None,
) -> list[ManagedParam]:
    """The parameters ``module``'s unit will manage: its own and those of its submodules, minus
    ignored ones and those of already-wrapped submodules. Raises on anything unsupported.
    ``spmd``: the SPMD mesh of ``dp_mesh_dims`` (see [Note: SPMD parameters])."""
    ignored_ids = _check_ignored(module, ignored_params)
    wrapped_children: list[str] = []
    managed: list[ManagedParam] = []
    seen: set[int] = set()
    for prefix, submodule in module.named_modules():
        if submodule is not module and any(
            prefix.startswith(w + ".") or prefix == w for w in wrapped_children
        ):
            continue
        if submodule is not module and _is_wrapped(submodule):
            wrapped_children.append(prefix)
            continue
        for name, param in submodule._parameters.items():
            if param is None or id(param) in ignored_ids or id(param) in seen:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            seen.add(id(param))
            record = _registry.record_of(param)
            if record is not None:
                owner = f"'{record.fqn}' of {record.group.owner}"
                raise ValueError(
                    f"parameter '{fqn}' is already managed by another fully_shard unit ({owner}). "
                    "A parameter shared between modules (e.g. tied embedding and output "
                    "weights) must be managed by one unit: do not wrap the modules that share it "
                    "separately, wrap a common ancestor (it manages the shared parameter once). "
                    "Also wrap children before their parents: a parent's unit already manages "
                    "its children's parameters"
                )
            # None for a plain tensor; raises if unusable. A plain one annotated by spmd_types
            # is read as the DTensor it denotes ([Note: spmd_types parameters]).
            tp = spmd_types_face(fqn, param, mesh, spmd) or tp_face_of(fqn, param, mesh, spmd)
            local = param if tp is None else tp.local_of(param)
            check_param_class(fqn, local)
            if tp is not None and has_all_gather_extensions(local):
                raise NotImplementedError(
                    f"parameter '{fqn}' is a tensor-parallel DTensor whose local tensor is a "
                    f"{type(param._local_tensor).__name__} with FSDP2 all-gather extensions: FP8 "
                    "(or other extension) all-gathers are supported on a data-parallel mesh "
                    "only; convert the model without FP8 all-gathers (e.g. torchao's "
                    "enable_fsdp_float8_all_gather=False) or drop tensor parallelism"
                )
            _check_dense_gradients(submodule, name, fqn)
            managed.append(ManagedParam(fqn, param, tp))
    for m in managed:
        p = m.param
        if p.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"parameter '{m.fqn}' has dtype {p.dtype}; fully_shard supports "
                f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}. Cast it (module.to(dtype)) or "
                "pass it in ignored_params"
            )
        if p.layout is not torch.strided:
            raise TypeError(
                f"parameter '{m.fqn}' has layout {p.layout}; fully_shard supports dense "
                "(strided) parameters only. Pass it in ignored_params"
            )
        if p.dim() == 0:
            raise ValueError(
                f"parameter '{m.fqn}' is 0-dimensional, which cannot be sharded on dim 0; "
                "give it shape (1,) or pass it in ignored_params"
            )
    devices = {m.param.device for m in managed}
    if len(devices) > 1:
        first: dict[str, str] = {}
        for m in managed:
            first.setdefault(str(m.param.device), m.fqn)
        found = ", ".join(f"'{fqn}' on {device}" for device, fqn in sorted(first.items()))
        raise ValueError(
            f"the parameters of one fully_shard unit must be on one device, found {found}; "
            "move the module with module.to(device) before fully_shard"
        )
    for m in managed:
        p = m.param
        if p.device.type == "meta":
            break  # allocated on the mesh's device, materialized later (_materialize.py)
        if p.device.type != mesh.device_type:
            raise ValueError(
                f"parameter '{m.fqn}' is on {p.device} but the mesh is on '{mesh.device_type}'; "
                f"move the module to {mesh.device_type} before fully_shard (or pass a mesh of "
                "the parameters' device type)"
            )
        break  # one device (checked above): the first parameter speaks for all
    return managed


def _check_dense_gradients(owner: nn.Module, name: str, fqn: str) -> None:
    """An embedding with ``sparse=True`` gives its weight sparse gradients, which cannot be
    staged into, reduced through or viewed from flat gradient buffers."""
    if isinstance(owner, (nn.Embedding, nn.EmbeddingBag)) and owner.sparse and name == "weight":
        raise ValueError(
            f"parameter '{fqn}' belongs to an {type(owner).__name__} with sparse=True: its "
            "sparse gradients cannot go into fully_shard's flat gradient buffers. Build it with "
            "sparse=False (dense gradients, the same training result), or pass its weight in "
            "ignored_params (then fully_shard neither shards nor reduces it: average its "
            "gradient across ranks yourself)"
        )


def check_param_init_fn(param_init_fn: Any) -> None:
    """``fully_shard``'s ``param_init_fn`` argument (no collective)."""
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(
            "param_init_fn must be a callable taking a module (it initializes that module's "
            f"own parameters and buffers in place), got {type(param_init_fn).__name__}"
        )


# ---------------------------------------------------------------------- cross-rank agreement

def unit_signature(
    module: nn.Module, managed: list[ManagedParam], strategy: ShardingStrategy,
    mp_policy: MixedPrecisionPolicy, scaling: float | None, *,
    timeout: timedelta | None = None, max_padding_ratio: float | None = None, **extra: Any,
) -> list[str]:
    """What every rank must agree on, one line per item, for :func:`check_ranks_agree`.
    ``extra``: further ``fully_shard`` arguments that change which collectives run, or when.

    Every argument that changes the collectives or the numbers is here, directly or through
    what it resolves to: the mesh (its shape on a 2-D mesh; ``dp_mesh_dims`` resolves to it),
    both strategies, ``reshard_after_forward``, the dtypes, the scaling, the padding (the
    layouts), ``timeout``, ``overlap``, ``sync_module_states``, ``collective_impl``, the bucket
    sizes, meta initialization, ``offload_policy=CPUOffloadPolicy()`` (in ``extra``), and the
    managed parameters (``ignored_params``, ``shard_placement_fn``). Not here:
    ``enable_trace_pool`` (where scratch buffers live, not which collectives run) and
    ``check_ranks`` itself (a rank that skips the check cannot report that it skipped it).
    Groups that only some values create (HSDP outer ``optim``'s whole-mesh group) are created
    after this check, so a disagreement on them is reported, not waited out."""
    lines = [
        f"module class: {type(module).__name__}",
        f"sharding_strategy: {strategy.value}",
        f"mp_policy: {mp_policy}",
        f"gradient_scaling_factor: {scaling}",
        f"max_padding_ratio: {max_padding_ratio}",
        f"timeout: {None if timeout is None else timeout.total_seconds()}",
        *(f"{name}: {value}" for name, value in sorted(extra.items())),
        f"number of managed parameters: {len(managed)}",
    ]
    lines += [
        f"parameter {m.fqn}: shape={tuple(m.param.shape)} dtype={m.param.dtype} "
        f"requires_grad={m.param.requires_grad}"
        + ("" if m.tp is None else f" local={tuple(m.local.shape)} tp={m.tp.tp_placements}")
        for m in managed
    ]
    return lines


_RAISED_ON = "[fully_shard: raised on rank"

# A signature line that carries a wrap-time error instead of a description (see
# raise_on_every_rank): "<marker><exception class name>: <message>".
_ERROR_MARKER = "\x00fully_shard error on this rank\x00"


Axes = Sequence[tuple[DeviceMesh, "dist.ProcessGroup | None"]]


def raise_on_every_rank(error: TypeError | ValueError, axes: Axes) -> None:
    """A check failed on this rank: take part in the cross-rank check with the error instead of
    a signature, so that every rank (this one included) raises it at once. Never returns.
    ``axes``: (1-D mesh, its group) of each mesh axis, as for :func:`check_mesh_agrees`."""
    check_mesh_agrees([f"{_ERROR_MARKER}{type(error).__name__}: {error}"], axes)
    raise error  # only reached on a 1-rank mesh


def check_mesh_agrees(lines: list[str], axes: Axes) -> None:
    """:func:`check_ranks_agree` over each axis of the mesh in turn (a 2-D mesh: inner, then
    outer), which covers every rank of it. A mismatch or error found on one axis is carried
    into the checks of the later axes instead of the lines, so every rank of the whole mesh
    raises, not only those of the axis that saw it."""
    error: TypeError | ValueError | None = None
    for mesh, group in axes:
        try:
            check_ranks_agree(
                lines if error is None else [f"{_ERROR_MARKER}{type(error).__name__}: {error}"],
                mesh, group,
            )
        except (TypeError, ValueError) as e:
            error = error or e
    if error is not None:
        raise error


def check_ranks_agree(
    lines: list[str], mesh: DeviceMesh, process_group: dist.ProcessGroup | None = None
) -> None:
    """One 8-byte all-gather of a digest over ``process_group`` (default: the mesh's); on a
    mismatch, name the first differing line, or raise the error a rank reported instead of its
    lines."""
    process_group = process_group if process_group is not None else mesh.get_group()
    world = mesh.size()
    if world == 1:
        return
    digest = int.from_bytes(hashlib.sha256("\n".join(lines).encode()).digest()[:7], "little")
    device = (
        torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda"
        else torch.device("cpu")
    )
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    everyone = torch.empty(world, dtype=torch.int64, device=device)
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather_single(everyone, mine, group=process_group)
    if bool((everyone == mine).all()):
        return
    all_lines: list[list[str] | None] = [None] * world
    dist.all_gather_object(all_lines, lines, group=process_group)
    for rank, other in enumerate(all_lines):
        if other and other[0].startswith(_ERROR_MARKER):
            kind, _, message = other[0][len(_ERROR_MARKER):].partition(": ")
            exc_type = TypeError if kind == "TypeError" else ValueError
            if _RAISED_ON not in message:  # not already carried over from another axis
                message += f" {_RAISED_ON} {rank}; every rank raises this error]"
            raise exc_type(message)
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
                    "arguments, in the same order"
                )
    raise ValueError(  # digests differ but the lines agree: a hash collision cannot do this
        "ranks disagree on what fully_shard wraps (digest mismatch); every rank must wrap the "
        "same model with the same arguments, in the same order"
    )


# ---------------------------------------------------------------------- padding

# Below this many padding elements a flat group is not worth a warning (tiny groups, e.g. a bias
# smaller than the world size, always pad by a large ratio and a few elements).
_PADDING_WARNING_MIN_ELEMENTS = 1 << 16


def warn_if_padded(layout: BufferLayout, fqns: list[str], max_padding_ratio: float) -> None:
    """Warn, naming the parameter, when a flat group pads by more than ``max_padding_ratio``
    (a parameter whose rows are so large that splitting groups cannot help, e.g. (1, 100000))."""
    if (
        layout.padding_ratio <= max_padding_ratio
        or layout.padding_numel < _PADDING_WARNING_MIN_ELEMENTS
    ):
        return
    worst = max(range(len(layout.items)), key=lambda i: layout.items[i].row_numel)
    item = layout.items[worst]
    warnings.warn(
        f"fully_shard: parameter '{fqns[worst]}' of shape {tuple(item.shape)} has rows of "
        f"{item.row_numel} elements and no shard boundary may cut a row, so its flat group is "
        f"padded by {layout.padding_ratio:.0%} ({layout.padding_numel} elements) at world size "
        f"{layout.world_size}, although max_padding_ratio is {max_padding_ratio:g}. Give it "
        "more, smaller rows (e.g. store a (1, N) parameter as (N,)), pass it in "
        "ignored_params, or raise max_padding_ratio to accept the padding",
        UserWarning,
        stacklevel=4,  # the caller of fully_shard (through _wiring.build_groups)
    )
