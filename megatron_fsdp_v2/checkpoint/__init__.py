"""Checkpointing ``fully_shard`` models: sharded state dicts for ``torch.distributed.checkpoint``
(DCP) that reshard across world sizes and strategies, and full (unsharded) state dicts for a
single-file ``torch.save`` or inference hand-off.

Sharded (every rank, no gather)::

    from megatron_fsdp_v2 import checkpoint as mckpt

    mckpt.save(model, optimizer, checkpoint_id="ckpt/step100")   # dcp.save, checksums, commit
    mckpt.load(model, optimizer, checkpoint_id="ckpt/step100")   # validate, verify, dcp.load, apply

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

See ``design.md`` (§7 Checkpoints) for the format. The model entries are the optimizer-facing
main weights (fp32 when a separate main buffer exists), under the original parameter names.

This module is the public API only. Where the pieces live: ``_files.py`` (atomic save and
commit, ``[Note: atomic saves and checksums]``), ``_checksums.py`` (per-item CRC32), ``_checks.py``
(checks against the model and DCP metadata), ``_full_state_dict.py`` (full-state-dict gather and
broadcast), ``_process_group.py`` (the process group every checkpoint collective runs on,
``[Note: checkpoint collectives]``), ``_experts.py`` (expert parallelism: experts under global
names, see :func:`register_experts`), ``_staging.py`` (the copy a load reads into); outside the
package, ``_dtensor/_chunk_metadata.py`` (chunk metadata at the true row offsets, ``[Note: uneven
shards in state dicts]``), ``_runtime/_state_dict_hooks.py`` (the units' and optimizers'
state-dict hooks) and ``_runtime/_expert_names.py`` (``[Note: expert names in checkpoints]``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import state_dict as _dsd
from torch.distributed.checkpoint.api import CheckpointException

from .. import _registry
from .._comm._arrival import await_every_rank
from .._runtime._expert_names import register, renamed_by_caller
from .._runtime._optimizer_hooks import install_state_dict_hooks
from .._runtime._state_dict_checks import expected_entries, first_mismatch
from .._runtime._state_dict_hooks import mark_all_loaded
from . import _full_state_dict as _full
from . import _process_group
from ._checks import (
    MODEL_KEY,
    OPTIM_KEY,
    check_against_metadata,
    check_optim_state_dict,
)
from ._checksums import find_unreadable_item, verify_checksums
from ._experts import ExpertNames
from ._files import atomic_save, interrupted_commit_hint, local_dir, pinned_directory
from ._staging import apply_staged, staging_copy

__all__ = [
    "register_experts",
    "get_state_dict",
    "set_state_dict",
    "save",
    "load",
    "get_full_state_dict",
    "load_full_state_dict",
]

Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None


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


# ---------------------------------------------------------------------- expert parallelism

def register_experts(experts: nn.Module, global_indices: Iterable[int] | None = None) -> None:
    """Declare that the children of ``experts`` (e.g. the ``nn.ModuleList`` of the experts this
    rank holds under expert parallelism) are experts with global indices ``global_indices``, in
    child order; checkpoints then store child ``j`` as ``<experts>.<global_indices[j]>.*``.

    Call it on every rank, each with its own indices (the example's contiguous numbering:
    ``range(ep_rank * local, (ep_rank + 1) * local)``), before or after ``fully_shard``, before
    the first checkpoint call. ``global_indices=None``: the children's names already are global
    (an ``nn.ModuleDict`` keyed by global index), nothing is renamed.

    Checkpoints then hold every expert under its global name, as one process holding every
    expert would: :func:`save` / :func:`load` (and :func:`get_state_dict` /
    :func:`set_state_dict`, the full-state-dict functions) of a model whose expert units sit on
    a part of its ranks (the ``edp`` sub-mesh) and dense units on all of them reshard across EP
    sizes, and load into a model without expert parallelism. Without the declaration those
    functions raise a ``ValueError`` for such a model, and torch's ``dcp.save`` of torch's
    ``get_state_dict`` (which keeps local names, so DCP would keep one EP rank's experts)
    raises naming this fix (see [Note: expert names in checkpoints] in
    ``_runtime/_expert_names.py``); experts declared with global names pass there too.

    Raises ``TypeError`` / ``ValueError`` (before storing anything) for a module without
    children, indices that are not non-negative integers, repeat, or do not match the number of
    children. Indices that collide across ranks are reported by the next checkpoint call, on
    every rank, before anything is read or written.
    """
    register(experts, global_indices)


# ---------------------------------------------------------------------- sharded state dicts

def _hook_optimizers(optims: tuple[torch.optim.Optimizer, ...]) -> None:
    # Usually there already (the first step installs them); not when an optimizer got its
    # state from a plain load_state_dict and never stepped.
    for optim in optims:
        install_state_dict_hooks(optim)


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

    A thin wrapper: the units' ``state_dict`` hooks and the optimizers' (see
    ``_optimizer_hooks.py``) do the marking, so torch's own ``get_state_dict`` gives the same
    result; this adds only the option checks, and the experts' global names: experts declared
    with :func:`register_experts` appear under their global names (model keys, optimizer state
    keys and param-group members), so the result of every EP rank goes to one ``dcp.save``
    without losing experts (torch's own ``get_state_dict`` keeps local names, which
    ``dcp.save`` refuses, see :func:`register_experts`).
    """
    options = _check_options(options, "get_state_dict")
    optims = _as_tuple(optimizers)
    experts = ExpertNames(model)
    with renamed_by_caller() if experts else contextlib.nullcontext():
        if not optims:
            return experts.model_to_global(_dsd.get_model_state_dict(model, options=options)), {}
        _hook_optimizers(optims)
        msd, osd = _dsd.get_state_dict(model, optims, options=options)
    return experts.model_to_global(msd), experts.optim_to_global(osd)


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
    written (agreed on the units' communication group, with ``fully_shard``'s timeout).
    Afterwards every unit refreshes its compute weights from the loaded main weights before the
    next forward. Returns ``(missing_keys, unexpected_keys)`` like torch.

    Experts declared with :func:`register_experts` are expected under their global names (as
    :func:`get_state_dict` gives them); entries of experts other ranks hold (a state dict of
    another EP size, or a full one) are left out.
    """
    options = _check_options(options, "set_state_dict")
    optims = _as_tuple(optimizers)
    experts = ExpertNames(model)
    model_state_dict = experts.model_to_local(model_state_dict)
    if optim_state_dict:
        optim_state_dict = experts.optim_to_local(optim_state_dict)
    found = {
        k: (v.shape if isinstance(v, torch.Tensor) else None) for k, v in model_state_dict.items()
    }
    error = first_mismatch(expected_entries(model), found, strict=options.strict)
    if error is None and optims and optim_state_dict:
        error = check_optim_state_dict(model, optim_state_dict)
    _process_group.raise_if_any_rank(error, _process_group.model_process_group(model, experts=True))
    if optims and optim_state_dict:
        # The optimizers' load_state_dict post-hook unmarks the tensors they adopt.
        _hook_optimizers(optims)
        # Non-strict: a rank that holds no rows of a parameter never gives it a gradient, so
        # its optimizer may have no state for it. Entries were checked against the model above.
        _dsd.set_optimizer_state_dict(
            model, optims, optim_state_dict, options=dataclasses.replace(options, strict=False)
        )
    result = _dsd.set_model_state_dict(model, model_state_dict, options=options)
    # load_state_dict's post-hooks already marked every unit; this also covers entries DCP
    # wrote in place into the main weights.
    mark_all_loaded(model)
    return result


def _build_state(
    model: nn.Module, optimizers: Optimizers, extra: dict[str, Any] | None
) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optimizers)
    state: dict[str, Any] = {MODEL_KEY: msd}
    if _as_tuple(optimizers):
        state[OPTIM_KEY] = osd
    if extra:
        state.update(extra)
    return state


# ---------------------------------------------------------------------- DCP save and load

def save(
    model: nn.Module,
    optimizers: Optimizers = None,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer: Any = None,
    process_group: dist.ProcessGroup | None = None,
    extra: dict[str, Any] | None = None,
    checksums: bool = True,
) -> Any:
    """``dcp.save({"model": ..., "optim": ...})`` of :func:`get_state_dict`'s result (plus any
    ``extra`` entries, e.g. ``{"step": 100}``). Every rank of ``process_group`` (default: all)
    calls it and writes its own rows; returns DCP's metadata. Without ``process_group``, DCP
    and the agreement run on the units' communication group when it spans every rank (so a
    missing rank fails the others after ``fully_shard``'s ``timeout``), else on the default
    group (see ``[Note: checkpoint collectives]``).

    To a local directory (a path ``checkpoint_id``, or a ``dcp.FileSystemWriter``) the save is
    atomic: the ranks write into ``<path>.incomplete``, agree on success, and one rank then
    replaces ``<path>`` as a whole. If any rank fails, every rank raises a ``RuntimeError`` and
    ``<path>`` still holds the complete previous checkpoint (or nothing); never a mix. With
    ``checksums`` (the default) a ``checksums.json`` with the CRC32 of every stored item is
    committed with it, which :func:`load` verifies. A ``checkpoint_id`` that is an existing
    regular file raises a ``ValueError`` on every rank before anything is written. Other
    storage (URLs, custom writers) is written by plain ``dcp.save``, with DCP's
    ``CheckpointException`` turned into a ``RuntimeError``. Assumes that every rank sees the
    same filesystem, as a later load does.
    """
    # DCP's coordination group: the caller's, else the units' group if it covers the job
    # (see [Note: checkpoint collectives] in _process_group.py).
    _process_group.widest_unit(model)  # the layout checks, also with a caller's process_group
    process_group = _process_group.dcp_process_group(model, process_group)
    root = local_dir(checkpoint_id, storage_writer)
    # Before anything is built or written: every rank names the same checkpoint, and the
    # registered experts' global names fit together.
    _process_group.check_same_path(root if root is not None else checkpoint_id, process_group,
                                   "checkpoint.save", ExpertNames(model))
    if root is not None:
        return atomic_save(lambda: _build_state(model, optimizers, extra), root, storage_writer,
                           process_group, checksums)
    state = _build_state(model, optimizers, extra)
    with _process_group.no_checkpoint_exception(f"checkpoint.save to {checkpoint_id!r}"):
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
    checksums: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save`, from any world size and sharding strategy.

    First reads the checkpoint's metadata and checks every model (and optimizer) tensor the
    load would read: a shape mismatch, or with ``strict`` a missing entry or an extra model
    entry, makes every rank raise a ``ValueError`` naming the first mismatching key, before
    anything is read into the model. (``strict=False`` keeps the current values of entries the
    checkpoint lacks.) ``extra`` holds entries to read back (e.g. ``{"step": 0}``); with
    ``strict`` a key the checkpoint lacks raises a ``ValueError`` naming it and listing the
    extra entries the checkpoint has (without, the given value is returned). With ``checksums``
    (the default) and a local checkpoint that has a ``checksums.json`` (see :func:`save`),
    every stored item is verified too, the files split across ranks: a corrupted item raises a
    ``ValueError`` naming its key and file, before anything is read into the model. Then
    ``dcp.load`` into a host-memory staging copy of this rank's share, and only after every
    rank read everything are the values copied into the model and optimizers and
    :func:`set_state_dict` runs; the next forward uses the loaded weights. Returns ``extra``
    updated. A failure inside ``dcp.load`` (a damaged or truncated file, with or without
    ``checksums.json``) raises a ``RuntimeError`` naming the file where it can be found
    (chained to DCP's ``CheckpointException``) and changes nothing. A local checkpoint is read
    through the directory as opened at the start, so a save committing to the same path
    meanwhile cannot make the load mix two checkpoints (see ``[Note: atomic saves and
    checksums]``). Every rank of ``process_group`` (default: all) calls it;
    the checks, DCP and the agreement use the same group as :func:`save`.
    """
    _process_group.widest_unit(model)  # as in save
    process_group = _process_group.dcp_process_group(model, process_group)
    root = local_dir(checkpoint_id, storage_reader)
    experts = ExpertNames(model)
    held = _process_group.check_same_path(root if root is not None else checkpoint_id,
                                          process_group, "checkpoint.load", experts)
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError("load needs a checkpoint_id or a storage_reader")
        storage_reader = dcp.FileSystemReader(checkpoint_id)
    extra = dict(extra or {})
    state = _build_state(model, optimizers, extra)
    elsewhere = experts.held_elsewhere(held, MODEL_KEY)
    if root is None:
        _load_into(state, storage_reader, checkpoint_id, None, None, process_group, strict, extra,
                   checksums=False, elsewhere=elsewhere)
    else:
        # Every read goes through one opened directory: a save that commits to this path
        # meanwhile cannot make this load read some files of each checkpoint.
        with pinned_directory(root) as pinned:
            try:
                _load_into(state, storage_reader, pinned, root, pinned, process_group, strict,
                           extra, checksums, elsewhere=elsewhere)
            finally:
                storage_reader.reset(root)  # the caller's reader points at the checkpoint again
    set_state_dict(
        model, optimizers, model_state_dict=state[MODEL_KEY],
        optim_state_dict=state.get(OPTIM_KEY),
        options=_dsd.StateDictOptions(strict=strict),
    )
    return {k: state[k] for k in extra}


def _load_into(
    state: dict[str, Any], storage_reader: Any, read_id: Any, root: Any, pinned: Any,
    process_group: dist.ProcessGroup | None, strict: bool, extra: dict[str, Any], checksums: bool,
    elsewhere: Callable[[str], bool] | None = None,
) -> None:
    """``load``'s checks and ``dcp.load`` from ``read_id`` (a local checkpoint's pinned path,
    else the caller's ``checkpoint_id``) into ``state``; ``state``'s tensors change only when
    every rank read everything."""
    shown = root if root is not None else read_id  # what messages name
    if read_id is not None:
        storage_reader.reset(read_id)
    error: str | None
    save_id = None
    try:
        metadata = storage_reader.read_metadata()
        save_id = getattr(metadata.storage_meta, "save_id", None)
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        metadata, error = None, f"cannot read checkpoint metadata of {str(shown)!r}: {exc}"
        if root is not None:
            error += interrupted_commit_hint(root)
    if metadata is not None:
        error = check_against_metadata(state, metadata, strict=strict, extra=extra,
                                       elsewhere=elsewhere)
        if error is None and checksums:
            error = verify_checksums(root, metadata, process_group, read_from=pinned)
    # One agreement: the first rank's error, else whether every rank opened the same save (a
    # commit between two ranks' opens would make them read different ones).
    found = _process_group.all_gather((error, save_id), process_group)
    error = next((e for e, _ in found if e is not None), None)
    if error is None and root is not None and any(i != found[0][1] for _, i in found):
        error = (f"checkpoint '{root}' was replaced by another save while this load opened "
                 "it (the ranks opened different saves); nothing was loaded, retry")
    if error is not None:
        raise ValueError(error)
    assert metadata is not None
    # DCP reads into a staging copy; the model and optimizers change only once every rank read
    # everything (see [Note: loads that change nothing until they succeeded] in _staging.py).
    staged = staging_copy(state, complete=strict)
    try:
        dcp.load(staged, checkpoint_id=read_id, storage_reader=storage_reader,
                 process_group=process_group,
                 planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
    except CheckpointException as exc:  # raised on every rank alike: the diagnosis is agreed
        damage = (find_unreadable_item(root, metadata, process_group, read_from=pinned)
                  if root is not None else None)
        damage = next((d for d in _process_group.all_gather(damage, process_group)
                       if d is not None), None)
        raise RuntimeError(
            f"checkpoint.load of {str(shown)!r} failed, nothing was loaded (the model and "
            f"optimizers are unchanged): {damage + '; ' if damage else ''}"
            f"{_process_group.describe(exc, -1)}") from exc
    apply_staged(state, staged)


# ---------------------------------------------------------------------- full state dicts

@torch.no_grad()
def get_full_state_dict(
    model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True
) -> dict[str, Any]:
    """The unsharded state dict: plain tensors under the original names (tied parameters under
    each of theirs, as ``nn.Module.state_dict`` does), managed parameters as their main weights
    (fp32 when a separate main buffer exists). Loadable into the unwrapped model class.

    Every rank must call it (one all-gather per flat group over the units' communication
    group, one group at a time). With ``rank0_only`` (default) only the first rank of the
    model's mesh (global rank 0 when the mesh spans the job) gets the tensors and the others
    return ``{}``; ``cpu_offload`` (default) moves them to CPU as they are gathered. On a 2-D
    (HSDP) mesh the all-gathers run over the inner group (every replica gathers its own copy of
    the same rows; with outer ``optim`` an all-gather over the outer group comes first, which
    completes each inner shard from its sub-shards) and "the first rank" is the whole mesh's
    lowest rank.

    Experts declared with :func:`register_experts` appear under their global names, every EP
    rank's: the lowest rank of each expert unit also keeps its gathered state dict and sends
    its experts (on CPU) to the receiving rank (to every rank without ``rank0_only``) in one
    object gather over the model's group. The result is the state dict of one process
    holding every expert.
    """
    # Every rank of each gather's group must be here: name the one that is not, instead of
    # waiting in the transport (see [Note: arrival check]).
    await_every_rank("checkpoint.get_full_state_dict", _first_unit_group(model))
    process_group = _process_group.model_process_group(model, experts=True)
    keep = not rank0_only or _process_group.rank_and_size(process_group)[0] == 0
    experts = ExpertNames(model)
    if not experts:
        return _full.full_state_dict(model, keep=keep, cpu_offload=cpu_offload)
    leader = experts.leads()
    full = _full.full_state_dict(model, keep=keep or leader, cpu_offload=cpu_offload)
    return _full.with_all_experts(full, experts, keep=keep, leader=leader,
                                  process_group=process_group, to_all=not rank0_only)


def _first_unit_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The communication group of the model's first managed parameter (the ranks its first
    gather runs over; no group is created), ``None`` (the default group) without one."""
    for p in model.parameters():
        group = _registry.group_of(p)
        if group is not None:
            return group.process_group
    return None


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
    collective besides the agreement on errors). With ``broadcast_from_rank0=True`` only rank 0
    needs it (others may pass ``None``); it is broadcast one tensor at a time and each rank
    keeps only its rows, so no rank but 0 ever holds the whole model. Collectives run on the
    units' communication group (``fully_shard``'s timeout); "rank 0" is its first rank, global
    rank 0 when the model's mesh spans the job. On a 2-D (HSDP) mesh that group is the one over
    the whole mesh (see ``[Note: checkpoint collectives]``), so "rank 0" is the mesh's lowest
    rank and the broadcast reaches every rank of both axes.

    Keys (``strict``) and shapes are checked first; a mismatch raises a ``ValueError`` naming
    the first mismatching key on every rank before anything is written. The next forward uses
    the loaded weights. Returns ``(missing_keys, unexpected_keys)``.

    Experts declared with :func:`register_experts` are read under their global names (the state
    dict of one process holding every expert, as :func:`get_full_state_dict` gives it); each
    rank keeps its own experts and skips the others'. With ``broadcast_from_rank0`` every rank
    checks its own entries against the broadcast header (one more agreement) before any tensor
    is broadcast.
    """
    expected = expected_entries(model)
    process_group = _process_group.model_process_group(model, experts=True)
    experts = ExpertNames(model)
    rank, size = _process_group.rank_and_size(process_group)
    distributed = size > 1
    is_source = not broadcast_from_rank0 or not distributed or rank == 0
    error: str | None = None
    if is_source:
        if full_state_dict is None:
            error = "load_full_state_dict got no state dict" + (
                " on rank 0" if broadcast_from_rank0 else ""
            )
        else:
            found = {
                k: (v.shape if isinstance(v, torch.Tensor) else None)
                for k, v in experts.model_to_local(full_state_dict).items()
            }
            error = first_mismatch(expected, found, strict=strict)
    _process_group.raise_if_any_rank(error, process_group)
    if broadcast_from_rank0 and distributed:
        full_state_dict = _full.broadcast_rows(
            model, full_state_dict, process_group, rename=experts.to_local if experts else None,
            # rank 0 checked its own experts only: every rank checks its own from the header
            check=(lambda found: first_mismatch(expected, found, strict=strict))
            if experts else None)
    else:
        assert full_state_dict is not None
        full_state_dict = experts.model_to_local(full_state_dict)
    assert full_state_dict is not None
    # load_state_dict's pre-hooks turn full tensors into each rank's rows; its post-hooks mark
    # the units for a compute-weight refresh.
    result = model.load_state_dict(full_state_dict, strict=strict)
    mark_all_loaded(model)
    return result
