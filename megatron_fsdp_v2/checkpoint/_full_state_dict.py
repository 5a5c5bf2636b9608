"""Full (unsharded) state dicts: the gather of every unit's main weights into plain tensors under
the original names, and the broadcast of a full state dict from the model's first rank in which
each rank keeps only its own rows. Collectives run on the units' groups (see
``[Note: checkpoint collectives]`` in ``_group.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import _registry
from .._buffers._plan import Extent
from .._comm._backends import collective_device
from .._dtensor._chunk_metadata import is_row_sharded
from .._dtensor._local_rows import dist_param_slots, local_rows_dtensor, param_slot
from .._init._materialize import materialize
from .._runtime._flat_param_group import FlatParamGroup
from ._group import coordinator, rank_and_size

__all__ = ["broadcast_rows", "full_state_dict", "gather_full_params"]


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
        main = group.main_weight.detach()
        if is_row_sharded(group):
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
    slots = dist_param_slots(model)
    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        param = slots.get(key)
        if param is not None:
            group, index = param_slot(param)
            value = full.get((id(group), index))
        elif isinstance(value, DTensor):
            # A DTensor fully_shard does not manage (e.g. an ignored tensor-parallel weight):
            # its own gather, on its own mesh, run on every rank in the same order.
            value = value.full_tensor()
            value = value.cpu() if cpu_offload else value
        elif isinstance(value, torch.Tensor):
            value = value.detach().to("cpu", copy=True) if cpu_offload else value.detach().clone()
        out[key] = value
    return out if keep else {}


def broadcast_rows(
    model: nn.Module, full_state_dict: dict[str, Any] | None,
    process_group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """The state dict of ``process_group``'s first rank on every rank of ``process_group``, managed
    parameters reduced to each rank's rows: a header (keys, shapes, dtypes, non-tensor values) as
    one object, then one broadcast per tensor."""
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
    slots = dist_param_slots(model)
    targets = model.state_dict(keep_vars=True)
    # The device the group's collectives move natively (CUDA under NCCL, however it was named).
    device = collective_device(process_group)
    out: dict[str, Any] = {}
    for key, meta, obj in header[0]:
        if meta is None:
            out[key] = obj
            continue
        shape, dtype = meta
        if is_source:
            assert full_state_dict is not None
            tensor = full_state_dict[key].detach().to(device=device).contiguous()
        else:
            tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=src, group=process_group)
        param = slots.get(key)
        if param is not None:
            # Keep a copy of this rank's rows only, not the whole broadcast tensor.
            out[key] = local_rows_dtensor(param, tensor, copy=True)
        else:
            target = targets.get(key)
            out[key] = tensor.to(target.device) if isinstance(target, torch.Tensor) else tensor
    return out
