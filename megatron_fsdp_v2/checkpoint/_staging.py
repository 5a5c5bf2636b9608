"""The staging copy ``checkpoint.load`` reads a checkpoint into, so that a load that fails
halfway (a corrupted or truncated file, a file that vanished, a read error) changes nothing.

[Note: loads that change nothing until they succeeded]
``dcp.load`` copies every item into the state dict's tensors as it reads it, and the state dict
of ``get_state_dict`` aliases the model's main weights and the optimizers' states: an item that
fails to read after others were read would leave the model half loaded (and a checkpoint
without ``checksums.json`` cannot be verified before reading). So ``load`` hands DCP a staging
copy instead: the same nested containers, every tensor replaced by a host (CPU) copy of this
rank's local data carrying the same chunk metadata (so DCP plans the same reads), every other
value as is. Only when ``dcp.load`` succeeded on every rank (DCP raises on all ranks otherwise)
are the staged values copied into the aliases, one tensor at a time, and the usual
``set_state_dict`` runs on them.

Cost: host memory for this rank's share of the loaded state for the duration of the load (the
model and optimizer shards, not the whole model), and one extra copy per tensor; no extra file
I/O and no device memory. A strict load reads every entry whole (checked against the metadata
first), so its staged tensors start empty; for a non-strict one they start as copies of the
current values, so entries the checkpoint lacks keep their values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._dtensor._chunk_metadata import ROWS_ATTR

__all__ = ["apply_staged", "staging_copy"]

# What DCP and the load hooks read from a state-dict tensor besides its data (see
# [Note: uneven shards in state dicts]); the staged tensor carries the same.
_PLANNING_ATTRS = ("__create_chunk_list__", "__create_write_items__", ROWS_ATTR)


def _stage_local(tensor: torch.Tensor, keep_values: bool) -> torch.Tensor:
    if keep_values:
        staged = tensor.detach().to("cpu", copy=True)
    else:
        staged = torch.empty_like(tensor, device="cpu")
    for name in _PLANNING_ATTRS:
        if name in tensor.__dict__:
            setattr(staged, name, tensor.__dict__[name])
    return staged


def _stage(value: Any, keep: bool) -> Any:
    if isinstance(value, DTensor):
        # The same spec (mesh, placements, global shape): DCP plans the same chunks.
        return DTensor(_stage_local(value._local_tensor, keep), value._spec, requires_grad=False)
    if isinstance(value, torch.Tensor):
        return _stage_local(value, keep)
    if isinstance(value, dict):
        return {k: _stage(v, keep) for k, v in value.items()}
    if isinstance(value, list):
        return [_stage(v, keep) for v in value]
    return value  # DCP replaces non-tensor values in the container, never in place


def staging_copy(state: dict[str, Any], complete: bool) -> dict[str, Any]:
    """A copy of ``state`` for ``dcp.load`` to read into (see the note at the top).
    ``complete``: the load reads every entry whole (a strict load, checked against the
    checkpoint's metadata), so the staged tensors need no initial values."""
    staged = _stage(state, not complete)
    assert isinstance(staged, dict)
    return staged


@torch.no_grad()
def _apply(target: Any, staged: Any) -> Any:
    """``staged``'s values in ``target`` (in place for tensors); returns the value to store."""
    if isinstance(target, DTensor):
        target._local_tensor.copy_(staged._local_tensor)
        return target
    if isinstance(target, torch.Tensor):
        target.copy_(staged)
        return target
    if isinstance(target, dict):
        for k in target:
            target[k] = _apply(target[k], staged[k])
        return target
    if isinstance(target, list) and len(target) == len(staged):
        for i, v in enumerate(target):
            target[i] = _apply(v, staged[i])
        return target
    # A non-tensor DCP replaced as a whole: e.g. a param group's ``params`` names, whose number
    # differs with the number of experts a rank holds.
    return staged


def apply_staged(state: dict[str, Any], staged: dict[str, Any]) -> None:
    """Copy what ``dcp.load`` read into ``staged`` into ``state``'s tensors (the model's and
    optimizers' aliases) and containers."""
    _apply(state, staged)
