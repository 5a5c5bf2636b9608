"""torch's full-state-dict loads into fully_shard models: ``set_model_state_dict`` /
``set_optimizer_state_dict`` with ``StateDictOptions(full_state_dict=True)``, with or without
``broadcast_from_rank0`` (torchtitan's seed checkpoint). Installed with the other torch
patches (``_torch_patches/_full_state_dict.py`` wraps torch's two functions with the two here);
entries on other meshes take torch's path untouched. It looks up the records and unit states of
the model torch hands it, hence its place in the runtime (the DTensor layer below reads none).

[Note: torch's full-state-dict loads]
torch cuts each full tensor to the target DTensor's layout itself, before any module or
optimizer hook runs, with DTensor's offset math (``torch.chunk`` rows), which is not our layout
(see [Note: uneven shards in state dicts]):

* without broadcast, ``_state_dict_utils._distribute_state_dict`` turns every full tensor into
  ``distribute_tensor(full, mesh, placements)`` (a scatter from rank 0 per tensor): a DTensor
  of ``torch.chunk`` rows. The optimizer adopts those by assignment, so its states would hold
  the wrong rows (a shape error at the next step, or silently wrong where sizes agree); and a
  rank without state for a parameter (an empty shard of an optimizer that stepped) skips the
  scatter its peers issue.
* with broadcast, every rank receives each full tensor and ``_distribute_tensors`` copies its
  ``torch.chunk`` rows into the target's local tensor: a size mismatch, or wrong rows
  silently where the sizes agree by chance.

Both functions are wrapped: for an entry whose target is ours (a managed ``Shard`` parameter,
or a state-dict DTensor carrying our rows marker, which every optimizer state alias of a
row-sharded parameter does), the entry becomes a copy of our rows of the full tensor, as a
DTensor marked with them (the full tensor is freed, as torch intends), which the units' load
pre-hook, DTensor ``copy_`` and the optimizer take as they are; every other entry goes to
torch's function, in torch's order. No collective is added, and the ones for our entries are
dropped: each rank keeps its rows of its own copy (the same file on every rank, or rank 0's
broadcast), where ``distribute_tensor`` would take rank 0's. A wrong shape still reaches the
units' load pre-hook, which rejects it on every rank before any parameter is written. A hook
could not do this: nothing of ours runs before torch's cut, and after it the optimizer cannot
tell a ``distribute_tensor`` state from one ``torch.load`` gave back without our marker.

torch's combined ``set_state_dict(model, optims, ..., broadcast_from_rank0=True)`` decides on
each rank whether to load the model from whether that rank's model dict is empty
(``optim_only=not model_state_dict``), and with broadcast only rank 0's is not: rank 0 then
broadcasts the model's tensors to ranks that skipped the model, and waits until the group's
timeout (FSDP2 alike; the separate ``set_model_state_dict`` / ``set_optimizer_state_dict`` calls
are fine). :func:`load_model_state_dict` wraps torch's ``_load_model_state_dict``, which every
rank reaches in that call: for a model with units of ours, it broadcasts rank 0's decision (one
object, from global rank 0 over the default group, as torch's broadcast of the tensors) and
every rank follows it, so the model is loaded on all ranks or on none. Only that call has
``broadcast_from_rank0`` and optimizers in ``info`` here; every other call passes through.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import _registry
from .._dtensor import _chunk_metadata as _sd
from .._dtensor._uneven_meshes import mesh_is_registered, tp_dims_of

__all__ = ["distribute_state_dict", "distribute_tensors", "load_model_state_dict"]


def _our_rows(target: Any) -> tuple[int, int] | None:
    """The global rows ``target`` holds if it is one of our row-sharded DTensors, else None."""
    if not isinstance(target, DTensor) or not mesh_is_registered(target.device_mesh):
        return None
    if not any(isinstance(p, Shard) for p in target.placements):
        return None  # Replicate(): torch.chunk and ours agree (the whole tensor)
    rows = getattr(target._local_tensor, _sd.ROWS_ATTR, None)
    if rows is not None:
        return tuple(rows)
    record = _registry.record_of(target)
    if record is not None and target is record.dist_param:
        return record.local_rows
    return None


def _own_rows(target: DTensor, full: torch.Tensor, rows: tuple[int, int],
              device: torch.device) -> DTensor:
    """A copy of rows ``rows`` of ``full`` on ``device``, as a DTensor shaped like ``full`` with
    ``target``'s placements, marked with its rows."""
    lo, hi = rows
    local = _tp_local(target, full.detach())[lo:hi].to(device=device, copy=True)
    out = DTensor.from_local(local, target.device_mesh, target.placements, run_check=False,
                             shape=full.shape, stride=full.stride())
    _sd.mark_rows(out._local_tensor, (lo, hi))
    return out


def _tp_local(target: DTensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` itself, or for a DTensor on a dp x TP mesh ([Note: 2-D parameters] in
    ``_tp_params.py``) this rank's TP-local piece of it (TP's own ``torch.chunk`` offsets), whose
    rows our rows then index."""
    mesh = target.device_mesh
    tp_dims = tp_dims_of(mesh)
    if not tp_dims:
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = [p if i in tp_dims else Replicate() for i, p in enumerate(target.placements)]
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def distribute_state_dict(torch_fn: Callable[..., None], full_state_dict: dict[str, Any],
                          local_state_dict: dict[str, Any], device: torch.device,
                          process_group: Any = None) -> None:
    """torch's ``_distribute_state_dict`` (``torch_fn``; every rank holds the full dict), our
    entries cut at our rows without a collective."""
    ours: dict[str, DTensor] = {}
    for key, value in full_state_dict.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            rows = _our_rows(local_state_dict.get(key))
            if rows is not None:
                ours[key] = _own_rows(local_state_dict[key], value, rows, device)
    rest = {k: v for k, v in full_state_dict.items() if k not in ours}
    torch_fn(rest, local_state_dict, device, process_group)
    local_state_dict.update(ours)


def distribute_tensors(torch_fn: Callable[..., None], local_state_dict: dict[str, Any],
                       keys: list[str], device: torch.device, process_group: Any = None) -> None:
    """torch's ``_distribute_tensors`` (``torch_fn``; after a broadcast each entry is
    ``(target, full)``), our entries cut at our rows."""
    rest = []
    for key in keys:
        entry = local_state_dict.get(key)
        if not (isinstance(entry, tuple) and len(entry) == 2):
            rest.append(key)
            continue
        rows = _our_rows(entry[0])
        if rows is None:
            rest.append(key)
            continue
        local_state_dict[key] = _own_rows(entry[0], entry[1], rows, device)
    if rest:
        torch_fn(local_state_dict, rest, device, process_group)


def load_model_state_dict(torch_fn: Callable[..., Any], model: Any, state_dict: dict[str, Any],
                          info: Any) -> Any:
    """torch's ``_load_model_state_dict`` (``torch_fn``); in the combined ``set_state_dict``
    with ``broadcast_from_rank0`` every rank loads the model exactly when rank 0 does (see the
    note at the top)."""
    combined_broadcast = getattr(info, "broadcast_from_rank0", False) and getattr(
        info, "handle_optim", False)
    if not combined_broadcast or not dist.is_initialized() or not any(
            _registry.state_of(m) is not None for m in model.modules()):
        return torch_fn(model, state_dict, info)
    decision = [bool(info.handle_model)]
    dist.broadcast_object_list(decision, src=0)
    if decision[0] != info.handle_model:
        info = dataclasses.replace(info, handle_model=decision[0])
    return torch_fn(model, state_dict, info)
