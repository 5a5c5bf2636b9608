"""Checkpointing ``fully_shard`` models: sharded state dicts for ``torch.distributed.checkpoint``
(DCP) that reshard across world sizes and strategies, and full (unsharded) state dicts for a
single-file ``torch.save`` or inference hand-off.

Sharded (every rank, no gather)::

    from megatron_fsdp_v2 import checkpoint as mckpt

    mckpt.save(model, optimizer, checkpoint_id="ckpt/step100")   # dcp.save
    mckpt.load(model, optimizer, checkpoint_id="ckpt/step100")   # validate, dcp.load, apply

or, with DCP directly::

    msd, osd = mckpt.get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    ...
    msd, osd = mckpt.get_state_dict(model, optimizer)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    mckpt.set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)

Full::

    sd = mckpt.get_full_state_dict(model)              # rank 0: plain fp32 CPU tensors
    if rank == 0: torch.save(sd, "model.pt")
    mckpt.load_full_state_dict(model, torch.load("model.pt"))   # every rank passes it, or
    mckpt.load_full_state_dict(model, sd if rank == 0 else None, broadcast_from_rank0=True)

See ``notes/checkpoint_design.md`` for the format. The model entries are the optimizer-facing
main weights (fp32 when a separate main buffer exists), under the original parameter names.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import state_dict as _dsd
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from . import _state_dict as _sd

__all__ = [
    "get_state_dict",
    "set_state_dict",
    "save",
    "load",
    "get_full_state_dict",
    "load_full_state_dict",
]

Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None

_MODEL_KEY = "model"
_OPTIM_KEY = "optim"


def _as_tuple(optimizers: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    if optimizers is None:
        return ()
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    return tuple(optimizers)


def _check_options(options: _dsd.StateDictOptions | None, api: str) -> _dsd.StateDictOptions:
    options = options if options is not None else _dsd.StateDictOptions()
    bad = [
        name for name in ("full_state_dict", "cpu_offload", "broadcast_from_rank0")
        if getattr(options, name)
    ]
    if bad:
        raise ValueError(
            f"megatron_fsdp_v2.checkpoint.{api} does not support StateDictOptions({bad[0]}=True): "
            "torch's gather and CPU offload assume torch.chunk shards, which fully_shard's "
            "uneven shards are not. Use get_full_state_dict / load_full_state_dict for full "
            "state dicts"
        )
    return options


# ---------------------------------------------------------------------- optimizer entries

def _optim_entries(osd: dict[str, Any]) -> Iterable[tuple[str, str, dict[str, Any], str]]:
    """``(param_fqn, state_name, container, container_key)`` of every per-parameter optimizer
    state entry, in the nested (``osd["state"][fqn][name]``) or the flattened
    (``osd["state.<fqn>.<name>"]``) layout."""
    state = osd.get("state")
    if isinstance(state, dict):
        for fqn, entries in state.items():
            if isinstance(entries, dict):
                for name in list(entries):
                    yield fqn, name, entries, name
        return
    for key in list(osd):
        if key.startswith("state."):
            fqn, _, name = key[len("state.") :].rpartition(".")
            yield fqn, name, osd, key


def _prepare_optim_state_dict(model: nn.Module, osd: dict[str, Any]) -> None:
    """Replace each state tensor by a detached alias (same storage, so ``dcp.load`` still writes
    into the optimizer's state; the optimizer's own tensors stay unmarked) and attach true-row
    chunk metadata to the DTensor states of sharded parameters. Plain tensor states (e.g. Adam's
    ``step``) of parameters this rank holds no rows of are marked not to be written by this
    rank (they still load).

    A rank with an empty shard never steps that parameter, so its copy of such a state may be
    stale (e.g. after resuming at another world size); every rank that holds rows has the same,
    current value, and DCP's de-duplication of plain tensors then only picks a current copy."""
    slots = _sd.dist_param_slots(model)
    for fqn, name, container, key in list(_optim_entries(osd)):
        param = slots.get(fqn)
        if param is None:
            continue
        group, index = _sd.param_slot(param)
        value = container[key]
        if not isinstance(value, torch.Tensor):
            continue
        value = container[key] = value.detach()
        if isinstance(value, DTensor):
            _sd.attach_chunk_metadata(value, group, index, f"state.{fqn}.{name}")
        elif group.strategy.shards_main_weights:
            lo, hi = group.local_row_range(index)
            if hi == lo:
                _sd.skip_on_save(value)


def _validate_optim_state_dict(model: nn.Module, osd: dict[str, Any]) -> str | None:
    params = dict(model.named_parameters(remove_duplicate=False))
    for fqn, name, container, key in _optim_entries(osd):
        if fqn not in params:
            return (
                f"optimizer state dict has state '{name}' for '{fqn}', which is not a parameter "
                "of the model; it was saved from a different model"
            )
        value, shape = container[key], params[fqn].shape
        if isinstance(value, DTensor) and tuple(value.shape) != tuple(shape):
            return (
                f"optimizer state entry 'state.{fqn}.{name}' has shape {tuple(value.shape)} but "
                f"the parameter has shape {tuple(shape)}"
            )
    return None


# ---------------------------------------------------------------------- sharded state dicts

def get_state_dict(
    model: nn.Module,
    optimizers: Optimizers = None,
    *,
    options: _dsd.StateDictOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``torch.distributed.checkpoint.state_dict.get_state_dict`` for ``fully_shard`` models,
    ready for ``dcp.save`` / ``dcp.load``.

    Returns ``(model_state_dict, optim_state_dict)`` (the latter ``{}`` without optimizers),
    keyed by the original parameter names. Values of managed parameters are DTensors viewing
    the main weights (no copy; fp32 when a separate main buffer exists); optimizer states
    shaped like their parameter are DTensors sharded the same way. Every sharded DTensor carries
    chunk metadata at its true global row offset (shards are uneven and may be empty), so DCP
    writes and reads the right rows. Plain optimizer states (Adam's ``step``) of a parameter
    this rank holds no rows of are not written by this rank (see the design notes).
    ``options`` may set ``ignore_frozen_params``, ``strict``, ``flatten_optimizer_state_dict``;
    full/CPU-offloaded state dicts come from :func:`get_full_state_dict`. No collectives; an
    optimizer whose state is still empty is first initialized by a zero-learning-rate step
    (torch's behaviour), so that every state entry exists to load into.
    """
    options = _check_options(options, "get_state_dict")
    optims = _as_tuple(optimizers)
    if optims:
        msd, osd = _dsd.get_state_dict(model, optims, options=options)
        _prepare_optim_state_dict(model, osd)
    else:
        msd, osd = _dsd.get_model_state_dict(model, options=options), {}
    # model.state_dict() already attached chunk metadata (the unit's state_dict post-hook);
    # attach again in case a hook-less path built these DTensors.
    slots = _sd.dist_param_slots(model)
    for key, value in msd.items():
        param = slots.get(key)
        if param is not None and isinstance(value, DTensor):
            _sd.attach_chunk_metadata(value, *_sd.param_slot(param), key)
    return msd, osd


def set_state_dict(
    model: nn.Module,
    optimizers: Optimizers = None,
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any] | None = None,
    options: _dsd.StateDictOptions | None = None,
) -> Any:
    """Load what :func:`get_state_dict` returned (typically filled by ``dcp.load``) into the
    model and optimizers, through ``torch.distributed.checkpoint.state_dict.set_state_dict``.

    Keys and shapes are checked first, on every rank, and a ``ValueError`` naming the first
    mismatching key (expected vs found shape) is raised on all ranks before anything is
    written. Afterwards every unit refreshes its compute weights from the loaded main weights
    before the next forward. Returns ``(missing_keys, unexpected_keys)`` like torch.
    """
    options = _check_options(options, "set_state_dict")
    optims = _as_tuple(optimizers)
    found = {
        k: (v.shape if isinstance(v, torch.Tensor) else None) for k, v in model_state_dict.items()
    }
    error = _sd.first_mismatch(_sd.expected_entries(model), found, strict=options.strict)
    if error is None and optims and optim_state_dict:
        error = _validate_optim_state_dict(model, optim_state_dict)
    _sd.raise_if_any_rank(error)
    if optims and optim_state_dict:
        # Non-strict: a rank that holds no rows of a parameter never gives it a gradient, so
        # its optimizer may have no state for it. Entries were checked against the model above.
        _dsd.set_optimizer_state_dict(
            model, optims, optim_state_dict, options=dataclasses.replace(options, strict=False)
        )
        for optim in optims:  # it may have adopted the (marked) tensors it was given
            _sd.strip_metadata(optim.state)
    result = _dsd.set_model_state_dict(model, model_state_dict, options=options)
    # load_state_dict's post-hooks already marked every unit; this also covers entries DCP
    # wrote in place into the main weights.
    _sd.mark_all_loaded(model)
    return result


def _validate_against_metadata(
    flat: dict[str, Any], metadata: Any, prefix: str, *, strict: bool
) -> str | None:
    """Check the tensors a load would read against a DCP checkpoint's metadata."""
    saved = metadata.state_dict_metadata
    for key, value in flat.items():
        if not key.startswith(prefix) or not isinstance(value, torch.Tensor):
            continue
        md = saved.get(key)
        if md is None:
            if strict:
                return (
                    f"checkpoint has no entry '{key}' (the model expects shape "
                    f"{tuple(value.shape)}); it was saved from a different model or without "
                    "this state"
                )
            continue
        if not isinstance(md, TensorStorageMetadata):
            return f"checkpoint entry '{key}' is not a tensor; expected shape {tuple(value.shape)}"
        if tuple(md.size) != tuple(value.shape):
            return (
                f"checkpoint entry '{key}' has shape {tuple(md.size)} but the model expects "
                f"{tuple(value.shape)}"
            )
    return None


def save(
    model: nn.Module,
    optimizers: Optimizers = None,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer: Any = None,
    process_group: dist.ProcessGroup | None = None,
    extra: dict[str, Any] | None = None,
) -> Any:
    """``dcp.save({"model": ..., "optim": ...})`` of :func:`get_state_dict`'s result (plus any
    ``extra`` entries, e.g. ``{"step": 100}``). Every rank writes its own rows."""
    msd, osd = get_state_dict(model, optimizers)
    state: dict[str, Any] = {_MODEL_KEY: msd}
    if _as_tuple(optimizers):
        state[_OPTIM_KEY] = osd
    if extra:
        state.update(extra)
    return dcp.save(
        state, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
        process_group=process_group,
    )


def load(
    model: nn.Module,
    optimizers: Optimizers = None,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_reader: Any = None,
    process_group: dist.ProcessGroup | None = None,
    strict: bool = True,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save`, from any world size and sharding strategy.

    First reads the checkpoint's metadata and checks every model (and optimizer) tensor the
    load would read: a shape mismatch, or with ``strict`` a missing entry or an extra model
    entry, makes every rank raise a ``ValueError`` naming the first mismatching key, before
    anything is read into the model. (``strict=False`` keeps the current values of entries the
    checkpoint lacks.) Then ``dcp.load`` and :func:`set_state_dict`; the next forward uses the
    loaded weights. ``extra`` holds entries to read back (e.g. ``{"step": 0}``); returns it
    updated. Every rank of ``process_group`` (default: all) calls it.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError("load needs a checkpoint_id or a storage_reader")
        storage_reader = dcp.FileSystemReader(checkpoint_id)
    msd, osd = get_state_dict(model, optimizers)
    state: dict[str, Any] = {_MODEL_KEY: msd}
    if _as_tuple(optimizers):
        state[_OPTIM_KEY] = osd
    extra = dict(extra or {})
    state.update(extra)
    error: str | None
    try:
        metadata = storage_reader.read_metadata()
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        metadata, error = None, f"cannot read checkpoint metadata of {checkpoint_id!r}: {exc}"
    if metadata is not None:
        flat, _ = flatten_state_dict(state)
        error = _validate_against_metadata(flat, metadata, _MODEL_KEY + ".", strict=strict)
        if error is None:
            error = _validate_against_metadata(flat, metadata, _OPTIM_KEY + ".", strict=strict)
        if error is None and strict:
            for key in metadata.state_dict_metadata:
                if key.startswith(_MODEL_KEY + ".") and key not in flat:
                    error = f"checkpoint has an unexpected entry '{key}' the model does not have"
                    break
    _sd.raise_if_any_rank(error, process_group)
    dcp.load(state, checkpoint_id=checkpoint_id, storage_reader=storage_reader,
             process_group=process_group,
             planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
    set_state_dict(
        model, optimizers, model_state_dict=state[_MODEL_KEY],
        optim_state_dict=state.get(_OPTIM_KEY),
        options=_dsd.StateDictOptions(strict=strict),
    )
    return {k: state[k] for k in extra}


# ---------------------------------------------------------------------- full state dicts

@torch.no_grad()
def get_full_state_dict(
    model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True
) -> dict[str, Any]:
    """The unsharded state dict: plain tensors under the original names (tied parameters under
    each of theirs, as ``nn.Module.state_dict`` does), managed parameters as their main weights
    (fp32 when a separate main buffer exists). Loadable into the unwrapped model class.

    Every rank must call it (one all-gather per parameter group, one group at a time). With
    ``rank0_only`` (default) only global rank 0 gets the tensors and the others return ``{}``;
    ``cpu_offload`` (default) moves them to CPU as they are gathered.
    """
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    full = _sd.gather_full_params(model, keep=keep, cpu_offload=cpu_offload)
    slots = _sd.dist_param_slots(model)
    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        param = slots.get(key)
        if param is not None:
            group, index = _sd.param_slot(param)
            value = full.get((id(group), index))
        elif isinstance(value, DTensor):
            # A DTensor fully_shard does not manage (e.g. an ignored tensor-parallel weight):
            # its own gather, run on every rank in the same order.
            value = value.full_tensor()
            value = value.cpu() if cpu_offload else value
        elif isinstance(value, torch.Tensor):
            value = value.detach().to("cpu", copy=True) if cpu_offload else value.detach().clone()
        out[key] = value
    return out if keep else {}


@torch.no_grad()
def load_full_state_dict(
    model: nn.Module,
    full_state_dict: dict[str, Any] | None,
    *,
    strict: bool = True,
    broadcast_from_rank0: bool = False,
) -> Any:
    """Load an unsharded state dict (e.g. from :func:`get_full_state_dict`, or an unwrapped
    model's ``state_dict()``) into a wrapped model of any world size and strategy.

    By default every rank passes the full state dict and keeps only its own rows (no
    collective besides the agreement on errors). With ``broadcast_from_rank0=True`` only global
    rank 0 needs it (others may pass ``None``); it is broadcast one tensor at a time and each
    rank keeps only its rows, so no rank but 0 ever holds the whole model.

    Keys (``strict``) and shapes are checked first; a mismatch raises a ``ValueError`` naming
    the first mismatching key on every rank before anything is written. The next forward uses
    the loaded weights. Returns ``(missing_keys, unexpected_keys)``.
    """
    expected = _sd.expected_entries(model)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    is_source = not broadcast_from_rank0 or not distributed or dist.get_rank() == 0
    error: str | None = None
    if is_source:
        if full_state_dict is None:
            error = "load_full_state_dict got no state dict" + (
                " on rank 0" if broadcast_from_rank0 else ""
            )
        else:
            found = {
                k: (v.shape if isinstance(v, torch.Tensor) else None)
                for k, v in full_state_dict.items()
            }
            error = _sd.first_mismatch(expected, found, strict=strict)
    _sd.raise_if_any_rank(error)
    if broadcast_from_rank0 and distributed:
        full_state_dict = _broadcast_rows(model, full_state_dict)
    assert full_state_dict is not None
    # load_state_dict's pre-hooks turn full tensors into each rank's rows; its post-hooks mark
    # the units for a compute-weight refresh.
    result = model.load_state_dict(full_state_dict, strict=strict)
    _sd.mark_all_loaded(model)
    return result


def _broadcast_rows(model: nn.Module, full_state_dict: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's state dict on every rank, managed parameters reduced to each rank's rows."""
    is_source = dist.get_rank() == 0
    if is_source:
        assert full_state_dict is not None
        header: list[Any] = [[
            (k, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None,
             None if isinstance(v, torch.Tensor) else v)
            for k, v in full_state_dict.items()
        ]]
    else:
        header = [None]
    dist.broadcast_object_list(header, src=0)
    slots = _sd.dist_param_slots(model)
    targets = model.state_dict(keep_vars=True)
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
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
        dist.broadcast(tensor, src=0)
        param = slots.get(key)
        if param is not None:
            # Keep a copy of this rank's rows only, not the whole broadcast tensor.
            out[key] = _sd.local_rows_dtensor(param, tensor, copy=True)
        else:
            target = targets.get(key)
            out[key] = tensor.to(target.device) if isinstance(target, torch.Tensor) else tensor
    return out
