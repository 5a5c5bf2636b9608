"""Full (unsharded) state dicts: the gather of every unit's main weights into plain tensors under
the original names, and the broadcast of a full state dict from the model's first rank in which
each rank keeps only its own rows. Collectives run on the units' groups (see
``[Note: checkpoint collectives]`` in ``_process_group.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import _registry
from .._buffers._plan import Extent
from .._comm._backends import collective_device
from .._dtensor._local_rows import local_rows_dtensor
from .._init._materialize import materialize
from .._runtime._flat_param_group import FlatParamGroup
from ._experts import ExpertNames
from ._process_group import (
    all_gather,
    coordinator,
    gather_to_coordinator,
    raise_if_any_rank,
    rank_and_size,
)

__all__ = ["broadcast_rows", "full_state_dict", "gather_full_params", "with_all_experts"]


def _unique_groups(params: Iterator[nn.Parameter]) -> list[FlatParamGroup]:
    seen: dict[int, FlatParamGroup] = {}
    for p in params:
        group = _registry.group_of(p)
        if group is not None and id(group) not in seen:
            seen[id(group)] = group
    return list(seen.values())


def gather_full_params(
    module: nn.Module, *, keep: bool, cpu_offload: bool
) -> dict[tuple[int, int], torch.Tensor]:
    """Full main weights of every managed parameter, keyed by ``(id(group), index)``: one
    all-gather of each group's main-weight shard over its ``process_group`` (none for
    ``no_shard``; with HSDP outer ``optim`` first one over the outer axis, which completes the
    inner shard from its sub-shards), one group at a time. Every rank must call it;
    ``keep=False`` ranks take part but return nothing."""
    materialize(module)  # a model built on the meta device: values first (no collective)
    out: dict[tuple[int, int], torch.Tensor] = {}
    for group in _unique_groups(module.parameters()):
        # CPU offload keeps the main weights in host memory: gathered on the group's device.
        main = group.main_weight.detach().to(group.device)
        if group.plan.optimizer_placement is not Extent.FULL:  # rows of its own on each rank
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            shard = main.contiguous()
            if group.plan.optimizer_placement is Extent.SUB_SHARD:
                # HSDP outer optim: rank (r, s) holds sub-shard s * R + r. Gather the R
                # sub-shards of this inner shard over the outer axis (in outer-rank order),
                # then the S inner shards over the inner axis: flat-buffer order.
                assert group.outer_process_group is not None
                replicas = dist.get_world_size(group.outer_process_group)
                inner_shard = torch.empty(
                    replicas * shard.numel(), dtype=main.dtype, device=main.device
                )
                gather(inner_shard, shard, group=group.outer_process_group)
                shard = inner_shard
            flat = torch.empty(group.layout.total_numel, dtype=main.dtype, device=main.device)
            gather(flat, shard, group=group.process_group)
        else:
            flat = main
        if not keep:
            continue
        for index, item in enumerate(group.layout.items):
            full = flat[item.offset : item.end].view(item.shape)
            out[(id(group), index)] = full.to("cpu", copy=True) if cpu_offload else full.clone()
    return out


def full_state_dict(model: nn.Module, *, keep: bool, cpu_offload: bool) -> dict[str, Any]:
    """``model.state_dict()`` with every managed parameter's full main weights in place of its
    DTensor (``{}`` unless ``keep``; every rank must call it)."""
    full = gather_full_params(model, keep=keep, cpu_offload=cpu_offload)
    managed = _registry.managed_dist_params(model)
    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        param = managed.get(key)
        record = _registry.record_of(param) if param is not None else None
        if record is not None:
            value = full.get((id(record.group), record.index))
        elif isinstance(value, DTensor):
            # A DTensor fully_shard does not manage (e.g. an ignored tensor-parallel weight):
            # its own gather, on its own mesh, run on every rank in the same order.
            value = value.full_tensor()
            value = value.cpu() if cpu_offload else value
        elif isinstance(value, torch.Tensor):
            value = value.detach().to("cpu", copy=True) if cpu_offload else value.detach().clone()
        out[key] = value
    return out if keep else {}


def with_all_experts(
    full: dict[str, Any], experts: ExpertNames, *, keep: bool, leader: bool,
    process_group: dist.ProcessGroup | None, to_all: bool,
) -> dict[str, Any]:
    """``full`` (this rank's full state dict, local names) with the registered experts of every
    rank under their global names in place of this rank's (see [Note: expert names in
    checkpoints] in ``_runtime/_expert_names.py``): each ``leader`` (one rank per expert unit)
    sends its experts, on CPU, to the group's first rank (``to_all``: to every rank) by one
    object gather; the experts of each container are placed where its first one was, in global
    index order. ``{}`` unless ``keep``; every rank of ``process_group`` must call it."""
    mine: dict[str, torch.Tensor] = {}
    if leader:
        for key, value in full.items():
            if experts.container_of(key) is not None:
                mine[experts.to_global(key)] = (
                    value.detach().cpu() if isinstance(value, torch.Tensor) else value)
    parts = all_gather(mine, process_group) if to_all else gather_to_coordinator(
        mine, process_group)
    if not keep or parts is None:
        return {}
    # Per container: global name -> its entries (any leader's copy; replicas hold the same).
    by_container: dict[str, dict[str, dict[str, Any]]] = {}
    for part in parts:
        for key, value in part.items():
            path = experts.container_of(key)
            assert path is not None
            rest = key[len(path) + 1:] if path else key
            name, _, _ = rest.partition(".")
            by_container.setdefault(path, {}).setdefault(name, {}).setdefault(key, value)
    device = next((v.device for k, v in full.items()
                   if experts.container_of(k) is not None and isinstance(v, torch.Tensor)), None)
    out: dict[str, Any] = {}
    placed: set[str] = set()
    for key, value in full.items():
        path = experts.container_of(key)
        if path is None:
            out[key] = value
            continue
        if path in placed:
            continue
        placed.add(path)
        numbered = by_container.get(path, {})
        for name in sorted(numbered, key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else 0,
                                                     n)):
            for expert_key, tensor in numbered[name].items():
                moved = isinstance(tensor, torch.Tensor) and device is not None
                out[expert_key] = tensor.to(device) if moved else tensor
    return out


def broadcast_rows(
    model: nn.Module, full_state_dict: dict[str, Any] | None,
    process_group: dist.ProcessGroup | None,
    rename: Callable[[str], str | None] | None = None,
    check: Callable[[dict[str, Any]], str | None] | None = None,
) -> dict[str, Any]:
    """The state dict of ``process_group``'s first rank on every rank of ``process_group``, managed
    parameters reduced to each rank's rows: a header (keys, shapes, dtypes, non-tensor values) as
    one object, then one broadcast per tensor.

    ``rename`` maps a broadcast key to this rank's (``None``: not this rank's, e.g. another EP
    rank's expert: received, not kept); ``check`` gets this rank's ``{key: shape or None}``
    from the header and returns an error, agreed on every rank (a ``ValueError``) before any
    tensor is broadcast."""
    src = coordinator(process_group)
    is_source = rank_and_size(process_group)[0] == 0
    if is_source:
        assert full_state_dict is not None
        header: list[Any] = [[
            (k, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None,
             None if isinstance(v, torch.Tensor) else v)
            for k, v in full_state_dict.items()
        ]]
    else:
        header = [None]
    dist.broadcast_object_list(header, src=src, group=process_group)
    if check is not None:
        shapes: dict[str, Any] = {}
        for k, meta, _ in header[0]:
            local = rename(k) if rename is not None else k
            if local is not None:
                shapes[local] = None if meta is None else torch.Size(meta[0])
        raise_if_any_rank(check(shapes), process_group)
    managed = _registry.managed_dist_params(model)
    targets = model.state_dict(keep_vars=True)
    # The device the group's collectives move natively (CUDA under NCCL, however it was named).
    device = collective_device(process_group)
    out: dict[str, Any] = {}
    for broadcast_key, meta, obj in header[0]:
        key = rename(broadcast_key) if rename is not None else broadcast_key
        if meta is None:
            if key is not None:
                out[key] = obj
            continue
        shape, dtype = meta
        if is_source:
            assert full_state_dict is not None
            tensor = full_state_dict[broadcast_key].detach().to(device=device).contiguous()
        else:
            tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=src, group=process_group)
        if key is None:
            continue
        param = managed.get(key)
        record = _registry.record_of(param) if param is not None else None
        if param is not None and record is not None:
            # Keep a copy of this rank's rows only, not the whole broadcast tensor.
            out[key] = local_rows_dtensor(param, record.row_layout, tensor, copy=True)
        else:
            target = targets.get(key)
            out[key] = tensor.to(target.device) if isinstance(target, torch.Tensor) else tensor
    return out
