"""Gradient clipping of fully_shard parameters (``clip_grad_norm_``, ``get_total_norm``): the
norms of sharded DTensor gradients, all-reduced over the library's process groups. Public as
``megatron_fsdp_v2.utils``; torch's own functions reach it through ``_clip_route.py``."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .. import _registry
from .._comm._backends import collective_device
from .._comm._process_groups import library_process_groups
from .._dtensor import _grad_norm
from ._flat_param_group import FlatParamGroup
from ._grads import finalize_unsynchronized
from ._param_record import ParamRecord

__all__ = ["clip_grad_norm_", "get_total_norm"]


# [Note: clipping collectives]
# Every rank must issue the same all-reduces, in the same order, whatever its parameter list
# holds. A rank holds a gradient of every parameter it used, zero rows where its shard is empty
# ([Note: gradients the optimizer sees] in _runtime/_grad_views.py), so a list filtered with
# ``p.grad is not None`` is the same on every rank when every rank used the same parameters
# (FSDP2's own requirement); it can still differ for a parameter some ranks did not use, on a
# rank holding no rows of it, and a list filtered by something rank-local (rows held) can be
# empty on some ranks only. Participation is therefore decided from the parameters and from
# wrap-time state, never from gradients:
#
# * each process group of a sharded (``Shard``) DTensor parameter in the list (the unit's
#   communication group for fully_shard parameters, the 1-D mesh's group otherwise);
# * when the list holds no fully_shard parameter at all (empty, or only plain tensors) and this
#   process has exactly one live library communication group (``library_process_groups()``: every
#   fully_shard call used one 1-D mesh and one timeout), that group, so a rank whose list was
#   filtered down to nothing joins the all-reduce its peers issue. ``_process_groups`` is the same
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
    # A tensor-parallel parameter sharded by TP too: the dp x TP ranks (see [Note: 2-D
    # parameters] in _dtensor/_tp_params.py).
    if record is not None:
        tp_process_group = record.group.tp_norm_process_groups[record.index]
        if tp_process_group is not None:
            return tp_process_group
    return record.group.norm_process_group if record is not None else p.device_mesh.get_group()


def _group_key(process_group: dist.ProcessGroup) -> tuple[tuple[int, ...], str]:
    ranks = tuple(dist.get_process_group_ranks(process_group))
    return ranks, str(getattr(process_group, "group_name", ""))


def _group_device(process_group: dist.ProcessGroup) -> torch.device:
    """Where a scalar for ``process_group``'s all-reduce lives when this rank has no tensor to
    copy."""
    return collective_device(process_group)


def _all_reduce_parts(
    replicated: list[torch.Tensor], sharded: dict[int, list[torch.Tensor]],
    process_groups: dict[int, dist.ProcessGroup], p: float, device: torch.device | None,
    foreach: bool | None,
) -> torch.Tensor | None:
    """The p-norm of ``replicated`` (local) and ``sharded`` (per group key, one all-reduce on
    each of ``process_groups``, in an order every rank agrees on). None when there is nothing to
    reduce and no gradient (no device to put the result on)."""
    ordered = sorted(process_groups.items(), key=lambda kv: _group_key(kv[1]))
    if device is None:
        if not ordered:
            return None
        device = _group_device(ordered[0][1])
    total = _grad_norm.local_norm_part(replicated, p, device, foreach)
    for key, process_group in ordered:
        part = _grad_norm.local_norm_part(sharded.get(key, []), p, device, foreach)
        if part.device.type == "cpu":  # CPU offload: host gradients; NCCL wants the device
            part = part.to(_group_device(process_group))
        dist.all_reduce(part, op=_grad_norm.reduce_op(p), group=process_group)
        part = part.to(device)
        total = _grad_norm.combine(total, part, p)
    return _grad_norm.finish(total, p)


def _check_finite(total_norm: torch.Tensor, p: float, what: str) -> None:
    if not bool(torch.isfinite(total_norm)):
        raise RuntimeError(
            f"{what}: the total norm of order {p} of the gradients is "
            f"{float(total_norm)}, so they cannot be clipped; nothing was changed. Pass "
            "error_if_nonfinite=False to scale them by it anyway"
        )


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
    norm_type: float | str = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None,
) -> torch.Tensor:
    """Clip gradients to a global norm, like ``torch.nn.utils.clip_grad_norm_`` (same arguments),
    with one all-reduce per process group of sharded gradients.

    Works on the DTensor parameters of :func:`fully_shard` modules (uneven and empty shards
    included), on replicated ones (``no_shard``) and on plain parameters, which are taken to be
    replicated (identical gradients on every rank). ``norm_type``: any p-norm with ``p > 0``
    (1.0, 2.0, 3.0, ...; the 2-norm takes one fused sum of squares per gradient dtype) or
    ``inf``; ``p = 0`` and negative ``p`` raise ``ValueError`` (see [Note: p-norms of sharded
    gradients] in ``_grad_norm.py``). ``foreach``: torch's meaning (which kernels; never which
    collectives). Gradients may have several dtypes (e.g. fp32 main grads and a bf16 ignored
    parameter): the norm is accumulated in fp32 and each dtype is scaled by the coefficient
    cast to that dtype. Returns the total norm as a 0-dim fp32 tensor, identical on every rank.

    Every rank must issue the same collectives, so they are decided from the parameters and
    from wrap-time state, never from which gradients this rank holds:

    * one all-reduce on each process group of a sharded DTensor parameter in the list;
    * if the list holds no fully_shard parameter at all (e.g. empty on a rank that filtered
      it by something rank-local) and every ``fully_shard`` call of the process used one 1-D
      mesh and one ``timeout`` (one library communication group), one all-reduce on that
      group, so the rank joins its peers'.

    A list filtered with ``p.grad is not None`` is the same on every rank that used the same
    parameters (a rank holding no rows of a parameter holds a zero-row gradient of it). Other
    lists may differ across ranks (``model.parameters()`` on some ranks only, or a parameter
    some ranks did not use) when the job has one library group. With several (several meshes or
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
    p = _grad_norm.check_norm_type(norm_type)
    _grad_norm.check_foreach(foreach, {param.device for param in params})
    # A window no backward marked last is reduced now, so the norm sees every gradient. The
    # groups come from the parameters, in list order (the same on every rank for the lists the
    # note below allows).
    # One registry look-up per parameter (a weak-key dictionary: microseconds each, which adds
    # up on many small parameters).
    records = [_registry.record_of(param) for param in params]
    unsynchronized: dict[int, FlatParamGroup] = {}
    for record in records:
        if record is not None:
            unsynchronized.setdefault(id(record.group), record.group)
    finalize_unsynchronized(unsynchronized.values(), "clip_grad_norm_")
    # See [Note: clipping collectives].
    process_groups: dict[int, dist.ProcessGroup] = {}
    sharded: dict[int, list[torch.Tensor]] = {}
    replicated: list[torch.Tensor] = []
    library_param_seen = False
    device: torch.device | None = None
    for param, record in zip(params, records):
        grad = param.grad
        if record is not None:
            library_param_seen = True
        if isinstance(param, DTensor) and any(isinstance(pl, Shard) for pl in param.placements):
            process_group = _process_group(param, record)
            process_groups.setdefault(id(process_group), process_group)
            if grad is not None:
                sharded.setdefault(id(process_group), []).append(grad.to_local())
            device = device or param.to_local().device
        elif grad is not None:
            replicated.append(grad.to_local() if isinstance(grad, DTensor) else grad)
            device = device or grad.device
    if (not process_groups and not library_param_seen and dist.is_available()
            and dist.is_initialized()):
        library = library_process_groups()
        if len(library) == 1:
            process_groups[id(library[0])] = library[0]
    total_norm = _all_reduce_parts(replicated, sharded, process_groups, p, device, foreach)
    if total_norm is None:
        return torch.zeros(())
    if error_if_nonfinite:
        _check_finite(total_norm, p, "clip_grad_norm_")
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    _grad_norm.scale_(replicated + [g for gs in sharded.values() for g in gs], clip_coef,
                      foreach)
    return total_norm


# [Note: total norm of gradient lists]
# ``get_total_norm`` takes gradients, not parameters (torch's ``get_total_norm``, which
# torchtitan's clipping calls with ``[p.grad for p in params if p.grad is not None]``): a rank
# whose shards are all empty passes ``[]``, and ranks hold gradients of different parameters. So
# the collectives cannot follow the list: every call all-reduces once on each library
# communication group of this process (``library_process_groups()``, the same on every rank of a
# mesh), in the agreed order, whatever the list holds; a gradient's part goes to the group over
# the ranks its ``Shard`` placements span (a mesh group where no library group has those ranks,
# e.g. ``timeout=None``, which an empty list cannot see: there every rank's list must hold a
# gradient of it). ``Replicate()`` DTensors and plain tensors are taken to be identical on every
# rank and add their local norm. Cost: one scalar all-reduce per library group.


def _shard_ranks(t: DTensor) -> tuple[int, ...]:
    """The global ranks across which ``t``'s ``Shard`` placements split it (this rank's slice
    of the mesh along its sharded dimensions)."""
    mesh = t.device_mesh
    index: list[int | slice] = []
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, (Shard, _StridedShard)):  # FSDP x TP: a strided dp shard
            index.append(slice(None))
        else:
            index.append(mesh.get_local_rank(dim) if mesh.ndim > 1 else 0)
    return tuple(sorted(int(r) for r in mesh.mesh[tuple(index)].flatten().tolist()))


def _shard_process_group(t: DTensor, library: list[dist.ProcessGroup]) -> dist.ProcessGroup:
    ranks = _shard_ranks(t)
    for group in sorted(library, key=_group_key):
        if tuple(sorted(dist.get_process_group_ranks(group))) == ranks:
            return group
    sharded = [dim for dim, pl in enumerate(t.placements) if isinstance(pl, Shard)]
    mesh = t.device_mesh
    return mesh.get_group(sharded[0]) if len(sharded) == 1 else mesh._flatten().get_group()


@torch.no_grad()
def get_total_norm(
    tensors: Iterable[torch.Tensor] | torch.Tensor, norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False, foreach: bool | None = None,
) -> torch.Tensor:
    """The p-norm of a list of gradients (``torch.nn.utils.get_total_norm``'s arguments), where
    ``fully_shard`` gradients are ``Shard`` DTensors whose parts live on several ranks, and
    some ranks may pass fewer gradients or none (see [Note: total norm of gradient lists]).
    Returns a 0-dim fp32 tensor, identical on every rank; ``norm_type`` and ``foreach`` as in
    :func:`clip_grad_norm_`. Follow with ``torch.nn.utils.clip_grads_with_norm_``."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    p = _grad_norm.check_norm_type(norm_type, "get_total_norm")
    _grad_norm.check_foreach(foreach, {t.device for t in tensors})
    library = library_process_groups() if dist.is_available() and dist.is_initialized() else []
    process_groups = {id(g): g for g in library}
    sharded: dict[int, list[torch.Tensor]] = {}
    replicated: list[torch.Tensor] = []
    device: torch.device | None = None
    for t in tensors:
        if isinstance(t, DTensor) and any(isinstance(pl, Shard) for pl in t.placements):
            process_group = _shard_process_group(t, library)
            process_groups.setdefault(id(process_group), process_group)
            sharded.setdefault(id(process_group), []).append(t.to_local())
        else:
            replicated.append(t.to_local() if isinstance(t, DTensor) else t)
        device = device or t.device
    total_norm = _all_reduce_parts(replicated, sharded, process_groups, p, device, foreach)
    if total_norm is None:
        return torch.zeros(())
    if error_if_nonfinite:
        _check_finite(total_norm, p, "get_total_norm")
    return total_norm
