"""The ``state_dict`` / ``load_state_dict`` hooks behind this library's checkpoints: the post-hook
every unit registers on ``state_dict`` (chunk metadata on its DTensor entries), its
``load_state_dict`` pre-hook (shape checks, then each entry converted to this rank's rows), the
``state_dict``/``load_state_dict`` post-hooks of every optimizer that holds managed parameters,
and the refresh mark after a load. The marks themselves are ``_dtensor/_chunk_metadata.py``'s
(see [Note: uneven shards in state dicts] there); no collectives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from .. import _registry
from .._dtensor._chunk_metadata import (
    ROWS_ATTR,
    attach_chunk_metadata,
    make_picklable,
    mark_unsupported,
    row_mismatch,
    skip_on_save,
    strip_metadata,
)
from .._dtensor._local_rows import convert_for_load
from .._dtensor._row_layout import RowLayout
from ._expert_names import lost_on_dcp, lost_on_dcp_params
from ._state_dict_checks import expected_entries, first_mismatch, tensor_shape

__all__ = [
    "load_state_dict_pre_hook",
    "mark_all_loaded",
    "optimizer_load_state_dict_post_hook",
    "optimizer_state_dict_post_hook",
    "state_dict_post_hook",
]


# ---------------------------------------------------------------------- module hooks

def state_dict_post_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """``module.state_dict()`` holds detached DTensor views of the main weights: attach the chunk
    metadata of this unit's parameters, so the result can go straight to ``dcp.save``."""
    state = _registry.state_of(module)
    if state is None:
        return
    own = {id(g) for g in state.groups}
    for name, param in _registry.managed_dist_params(module).items():
        record = _registry.record_of(param)
        assert record is not None
        value = state_dict.get(prefix + name)
        # keep_vars=True returns the live parameters: leave them alone (see strip_metadata).
        if (id(record.group) in own and isinstance(value, DTensor)
                and not isinstance(value, nn.Parameter)):
            attach_chunk_metadata(value, record.row_layout, prefix + name)
            make_picklable(value)
            rows = value._local_tensor.__dict__.get(ROWS_ATTR)
            if rows is not None:
                # On the DTensor itself too, where pickling keeps it (a tuple of ints): an entry
                # saved with torch.save and loaded on the same layout is recognized as the
                # model's own rows (``_dtensor/_local_rows.py``).
                setattr(value, ROWS_ATTR, rows)
    # Experts under local names (expert parallelism): DCP would keep one EP rank's copy; it
    # raises instead (see [Note: expert names in checkpoints] in _expert_names.py).
    for name, message in lost_on_dcp(module).items():
        value = state_dict.get(prefix + name)
        if isinstance(value, DTensor) and not isinstance(value, nn.Parameter):
            mark_unsupported(value, message)


# ---------------------------------------------------------------------- optimizer hooks

def _optimizer_state_alias(value: Any, layout: RowLayout, key: str) -> Any:
    """A detached alias of one optimizer state value, marked for DCP (see
    :func:`optimizer_state_dict_post_hook`); non-tensors as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    alias = value.detach()  # same storage: dcp.load writes into the live state
    if isinstance(alias, DTensor):
        if not layout.row_sharded or not any(isinstance(p, Shard) for p in alias.placements):
            return alias
        error = row_mismatch(alias, layout, key)
        if error is None:
            attach_chunk_metadata(alias, layout, key)
        else:
            mark_unsupported(alias, error)
    elif layout.row_sharded:
        lo, hi = layout.rows
        if hi == lo:
            skip_on_save(alias)
    return alias


def optimizer_state_dict_post_hook(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> dict[str, Any]:
    """``optimizer.state_dict()`` of an optimizer that holds managed parameters: the state of
    each such parameter becomes a new dict of detached aliases (same storage, so ``dcp.load``
    through ``torch.distributed.checkpoint.state_dict`` still writes the live state; the live
    tensors stay unmarked), with chunk metadata at the true row offset on the DTensor states of
    row-sharded parameters. A plain tensor state (Adam's ``step``) of a parameter this rank
    holds no rows of is marked not to be written by this rank: such a rank never steps that
    parameter, so its copy may be stale, while every rank with rows has the current value
    (DCP keeps one copy of a plain tensor). Pickling drops all marks
    (``_chunk_metadata._PickleWithout``)."""
    state = state_dict.get("state")
    if not isinstance(state, dict):
        return state_dict
    lost = lost_on_dcp_params([p for g in optimizer.param_groups for p in g["params"]])
    for group_live, group_packed in zip(optimizer.param_groups, state_dict["param_groups"]):
        for param, pid in zip(group_live["params"], group_packed["params"]):
            record = _registry.record_of(param)
            entries = state.get(pid)
            # The compute parameter of a stale optimizer has no rows to mark.
            if record is None or param is record.compute_param or not isinstance(entries, dict):
                continue
            state[pid] = {
                name: _optimizer_state_alias(
                    value, record.row_layout, f"state.{record.fqn}.{name}"
                )
                for name, value in entries.items()
            }
            message = lost.get(id(param))
            if message is not None:  # an expert's state under its local name (see above)
                for value in state[pid].values():
                    if isinstance(value, DTensor):
                        mark_unsupported(value, message)
    return state_dict


def optimizer_load_state_dict_post_hook(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.load_state_dict``: the optimizer may have adopted marked aliases (a
    state dict from :func:`optimizer_state_dict_post_hook`, filled by ``dcp.load``) as its live
    state; unmark them."""
    strip_metadata(optimizer.state)


# ---------------------------------------------------------------------- load

def load_state_dict_pre_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
    strict: bool, missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
) -> None:
    """Before ``load_state_dict`` writes anything into this unit's subtree: check the shape of
    every entry (a ``ValueError`` naming the first mismatching key), then make the entries of
    this unit's parameters loadable in place (full tensors and ``Replicate()`` DTensors become
    this rank's rows). The root unit runs first and sees every key, so a bad state dict is
    rejected before any parameter is touched. Missing/unexpected keys are left to
    ``load_state_dict``'s own ``strict`` handling."""
    if local_metadata.get("assign_to_params_buffers", False):
        raise ValueError(
            "load_state_dict(assign=True) would replace the DTensor parameters that view "
            "fully_shard's flat buffers; load with assign=False"
        )
    if torch.__future__.get_swap_module_params_on_conversion():
        raise ValueError(
            "load_state_dict with torch.__future__.set_swap_module_params_on_conversion(True) "
            "would swap out the DTensor parameters that view fully_shard's flat buffers; "
            "turn it off around the load"
        )
    found = {k: tensor_shape(v) for k, v in state_dict.items() if k.startswith(prefix)}
    expected = expected_entries(module, prefix)
    error = first_mismatch(expected, found, strict=False, what="state dict")
    if error is not None:
        raise ValueError(error)
    state = _registry.state_of(module)
    if state is None:
        return
    own = {id(g) for g in state.groups}
    for name, param in _registry.managed_dist_params(module).items():
        key = prefix + name
        record = _registry.record_of(param)
        assert record is not None
        if key in state_dict and id(record.group) in own:
            state_dict[key] = convert_for_load(key, param, record.row_layout, state_dict[key])


def mark_all_loaded(module: nn.Module) -> None:
    """Every unit in ``module``'s tree refreshes its compute weights before the next use."""
    for m in module.modules():
        state = _registry.state_of(m)
        if state is not None:
            for group in state.groups:
                group.mark_main_weights_updated()
