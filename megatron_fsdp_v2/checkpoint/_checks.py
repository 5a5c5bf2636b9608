"""Checks against the model and the checkpoint, before a checkpoint call reads or writes anything:
whether each unit's HSDP layout is one checkpoints support (``NotImplementedError``, decided from
wrap-time state, so alike on every rank), optimizer state entries against the model's parameters,
and the tensors ``checkpoint.load`` would read against a DCP checkpoint's ``.metadata``. The last
two return the first problem as a message (or ``None``); the caller agrees on it across ranks and
raises. No collectives here. The model's own keys and shapes are compared by
``_runtime/_state_dict_checks.py``, shared with the units' ``load_state_dict`` pre-hook.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

__all__ = ["MODEL_KEY", "OPTIM_KEY", "check_against_metadata", "check_optim_state_dict",
           "optim_entries"]

# Top-level keys of what checkpoint.save writes.
MODEL_KEY = "model"
OPTIM_KEY = "optim"


def optim_entries(osd: dict[str, Any]) -> Iterable[tuple[str, str, dict[str, Any], str]]:
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


def check_optim_state_dict(model: nn.Module, osd: dict[str, Any]) -> str | None:
    """The first optimizer state entry that belongs to no parameter of ``model`` or (a DTensor)
    is shaped unlike its parameter."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for fqn, name, container, key in optim_entries(osd):
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


def _check_tensors(
    flat: dict[str, Any], metadata: Metadata, prefix: str, *, strict: bool
) -> str | None:
    """Check the tensors under ``prefix`` a load would read against a checkpoint's metadata."""
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


def _missing_extra(extra: dict[str, Any], metadata: Metadata) -> str | None:
    """The error for ``extra`` keys the checkpoint lacks, listing the ones it has."""
    flat, mapping = flatten_state_dict(extra)
    saved = metadata.state_dict_metadata
    missing = sorted({str(mapping[k][0]) for k in flat if k not in saved})
    if not missing:
        return None
    # DCP's default planner stores each flattened key's path: the top-level names it had.
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    tops = {str(paths[k][0]) if k in paths else k.split(".")[0] for k in saved}
    have = sorted(tops - {MODEL_KEY, OPTIM_KEY})
    return (f"checkpoint has no extra entry {', '.join(repr(k) for k in missing)} (asked for "
            f"in extra=); its extra entries are: "
            f"{', '.join(repr(k) for k in have) if have else 'none'}")


def check_against_metadata(
    state: dict[str, Any], metadata: Metadata, *, strict: bool, extra: dict[str, Any],
    elsewhere: Callable[[str], bool] | None = None,
) -> str | None:
    """The first problem loading ``state`` (``{"model": ..., "optim": ..., **extra}``) from a
    checkpoint with ``metadata``: a shape mismatch, or with ``strict`` a missing entry, an
    extra ``model.*`` entry (other than one ``elsewhere`` says another rank loads: another EP
    rank's expert), or a missing ``extra`` key."""
    flat, _ = flatten_state_dict(state)
    error = _check_tensors(flat, metadata, MODEL_KEY + ".", strict=strict)
    if error is None:
        error = _check_tensors(flat, metadata, OPTIM_KEY + ".", strict=strict)
    if error is None and strict:
        for key in metadata.state_dict_metadata:
            if (key.startswith(MODEL_KEY + ".") and key not in flat
                    and not (elsewhere is not None and elsewhere(key))):
                return f"checkpoint has an unexpected entry '{key}' the model does not have"
    if error is None and strict and extra:
        error = _missing_extra(extra, metadata)
    return error
