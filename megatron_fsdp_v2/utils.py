"""Training helpers that understand sharded DTensor gradients."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from . import _registry, ops
from ._backends import collective_device
from ._comm_groups import library_comm_groups
from ._flat_param_group import FlatParamGroup, ParamRecord
from ._grads import finalize_unsynchronized
from .api import SUPPORTED_DTYPES

__all__ = ["clip_grad_norm_"]


# [Note: clipping collectives]
# Every rank must issue the same all-reduces, in the same order, whatever its parameter list
# holds: a rank whose local shards are all empty has no gradients (``grad=None``), so a list
# filtered with ``p.grad is not None`` can be empty on that rank only. Participation is therefore
# decided from the parameters and from wrap-time state, never from gradients:
#
# * each process group of a sharded (``Shard``) DTensor parameter in the list (the unit's
#   communication group for fully_shard parameters, the 1-D mesh's group otherwise);
# * when the list holds no fully_shard parameter at all (empty, or only plain tensors) and this
#   process has exactly one live library communication group (``library_comm_groups()``: every
#   fully_shard call used one 1-D mesh and one timeout), that group, so a rank whose list was
#   filtered down to nothing joins the all-reduce its peers issue. ``_comm_groups`` is the same
#   on every rank (of a mesh) because every rank makes the same fully_shard calls.
#
# A list that holds replicated (``no_shard``) fully_shard parameters but no sharded one
# all-reduces nothing: replicated gradients are identical on every rank, so a ``no_shard``
# model clips without a collective. Groups are all-reduced in an order every rank agrees on
# (ranks, then group name), one all-reduce per group, the dtypes of a group summed locally
# first. No rank returns before its all-reduces.


def _process_group(p: DTensor, record: ParamRecord | None) -> dist.ProcessGroup:
    # The library's own group for fully_shard parameters (it carries the collective timeout,
    # see fully_shard's ``timeout``); the mesh's group otherwise.
    # On an HSDP mesh with outer optim it spans the whole mesh (every rank holds a distinct
    # sub-shard); otherwise the inner group (outer replicas hold the same gradients).
    return record.group.norm_process_group if record is not None else p.device_mesh.get_group()


def _group_key(group: dist.ProcessGroup) -> tuple[tuple[int, ...], str]:
    return tuple(dist.get_process_group_ranks(group)), str(getattr(group, "group_name", ""))


def _group_device(group: dist.ProcessGroup) -> torch.device:
    """Where a scalar for ``group``'s all-reduce lives when this rank has no tensor to copy."""
    return collective_device(group)


def _by_device_and_dtype(
    tensors: list[torch.Tensor],
) -> list[tuple[tuple[torch.device, torch.dtype], list[torch.Tensor]]]:
    """Non-empty tensors grouped by (device, dtype), groups in a rank-independent order."""
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            buckets.setdefault((t.device, t.dtype), []).append(t)
    return sorted(buckets.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1])))


def _local_norm_part(tensors: list[torch.Tensor], norm_type: float,
                     device: torch.device) -> torch.Tensor:
    """This rank's share of the norm as a 0-dim fp32 tensor on ``device``: the sum of squares
    (2-norm) or the largest magnitude (inf-norm), over tensors of any dtypes and devices."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (_, dtype), group in _by_device_and_dtype(tensors):
        if norm_type == 2.0:
            if dtype in SUPPORTED_DTYPES:
                # One fused kernel per dtype (it takes one dtype), accumulating in fp32 or wider.
                part = ops.multi_tensor_sum_of_squares([t.contiguous() for t in group])
            else:
                part = torch.stack([t.float().square().sum() for t in group]).sum()
            total = total + part.to(device=device, dtype=torch.float32)
        else:
            norms = torch._foreach_norm(group, math.inf)
            part = torch.stack(norms).max().to(device=device, dtype=torch.float32)
            total = torch.maximum(total, part)
    return total


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0,
    *, error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients to a global norm, like ``torch.nn.utils.clip_grad_norm_``, with one
    fused sum of squares per gradient dtype and one all-reduce per process group of sharded
    gradients.

    Works on the DTensor parameters of :func:`fully_shard` modules (uneven and empty shards
    included), on replicated ones (``no_shard``) and on plain parameters, which are taken to be
    replicated (identical gradients on every rank). Gradients may have several dtypes (e.g. fp32
    main grads and a bf16 ignored parameter): the norm is accumulated in fp32 and each dtype is
    scaled by the coefficient cast to that dtype. Returns the total norm as a 0-dim fp32
    tensor, identical on every rank. Only the 2-norm and the inf-norm are supported.

    Every rank must issue the same collectives, so they are decided from the parameters and
    from wrap-time state, never from which gradients this rank holds:

    * one all-reduce on each process group of a sharded DTensor parameter in the list;
    * if the list holds no fully_shard parameter at all (e.g. it is empty because it was
      filtered with ``p.grad is not None`` on a rank whose shards are all empty) and every
      ``fully_shard`` call of the process used one 1-D mesh and one ``timeout`` (one library
      communication group), one all-reduce on that group, so the rank joins its peers'.

    So the lists may differ across ranks (filtered by gradient, or ``model.parameters()`` on
    some ranks only) when the job has one library group. With several (several meshes or
    timeouts, or ``timeout=None``, whose units use the mesh's own group, which the second rule
    does not see) every rank's list must hold a sharded parameter of each group that any rank
    all-reduces on: pass ``model.parameters()`` unfiltered, or filter with
    ``p.requires_grad``, which is the same on every rank. A list of replicated (``no_shard``)
    parameters without a sharded one needs and issues no collective; in a tree that mixes
    ``no_shard`` and sharded units, filter with ``p.requires_grad`` rather than by gradient.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = list(parameters)
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"clip_grad_norm_ supports norm_type 2.0 or inf, got {norm_type}")
    norm_type = float(norm_type)
    # A window no backward marked last is reduced now, so the norm sees every gradient. The
    # groups come from the parameters, in list order (the same on every rank for the lists the
    # note below allows).
    # One registry look-up per parameter (a weak-key dictionary: microseconds each, which adds
    # up on many small parameters).
    records = [_registry.record_of(p) for p in params]
    unsynchronized: dict[int, FlatParamGroup] = {}
    for record in records:
        if record is not None:
            unsynchronized.setdefault(id(record.group), record.group)
    finalize_unsynchronized(unsynchronized.values(), "clip_grad_norm_")
    # See [Note: clipping collectives].
    groups: dict[int, dist.ProcessGroup] = {}
    sharded: dict[int, list[torch.Tensor]] = {}
    replicated: list[torch.Tensor] = []
    library_param_seen = False
    device: torch.device | None = None
    for p, record in zip(params, records):
        grad = p.grad
        if record is not None:
            library_param_seen = True
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements):
            group = _process_group(p, record)
            groups.setdefault(id(group), group)
            if grad is not None:
                sharded.setdefault(id(group), []).append(grad.to_local())
            device = device or p.to_local().device
        elif grad is not None:
            replicated.append(grad.to_local() if isinstance(grad, DTensor) else grad)
            device = device or grad.device
    if not groups and not library_param_seen and dist.is_available() and dist.is_initialized():
        library = library_comm_groups()
        if len(library) == 1:
            groups[id(library[0])] = library[0]
    ordered = sorted(groups.items(), key=lambda kv: _group_key(kv[1]))
    if device is None:
        if not ordered:
            return torch.zeros(())
        device = _group_device(ordered[0][1])

    total_norm = _local_norm_part(replicated, norm_type, device)
    op = dist.ReduceOp.SUM if norm_type == 2.0 else dist.ReduceOp.MAX
    for key, group in ordered:
        partial = _local_norm_part(sharded.get(key, []), norm_type, device)
        dist.all_reduce(partial, op=op, group=group)
        if norm_type == 2.0:
            total_norm = total_norm + partial
        else:
            total_norm = torch.maximum(total_norm, partial)
    if norm_type == 2.0:
        total_norm = total_norm.sqrt()
    if error_if_nonfinite and not bool(torch.isfinite(total_norm)):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
            f"{float(total_norm)}, so they cannot be clipped; nothing was changed. Pass "
            "error_if_nonfinite=False to scale them by it anyway"
        )

    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    local = replicated + [g for gs in sharded.values() for g in gs]
    for (grad_device, dtype), grads in _by_device_and_dtype(local):
        torch._foreach_mul_(grads, clip_coef.to(device=grad_device, dtype=dtype))
    return total_norm
