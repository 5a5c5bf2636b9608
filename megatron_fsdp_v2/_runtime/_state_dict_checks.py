"""Keys and shapes of a state dict against a model's own entries, in model order: what the units'
``load_state_dict`` pre-hook checks before anything is written, and what the checkpoint loads
check before their cross-rank agreement. Messages only (the caller raises); no collectives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

__all__ = ["expected_entries", "first_mismatch", "tensor_shape"]


def expected_entries(module: nn.Module, prefix: str = "") -> dict[str, torch.Size | None]:
    """What ``module.state_dict()`` holds, keyed like it: the global shape of each tensor entry
    (tied parameters under each name), ``None`` for a non-tensor one (``_extra_state``)."""
    return {
        key: value.shape if isinstance(value, torch.Tensor) else None
        for key, value in module.state_dict(prefix=prefix, keep_vars=True).items()
    }


def first_mismatch(
    expected: Mapping[str, torch.Size | None],
    found: Mapping[str, torch.Size | None],
    *,
    strict: bool,
    what: str = "checkpoint",
) -> str | None:
    """The first problem between the model's entries and a checkpoint's, in model order:
    a shape mismatch, then (strict) a missing key, then (strict) an unexpected key.
    ``found[key] is None`` marks a non-tensor entry where a tensor is expected."""
    for key, shape in expected.items():
        if key not in found:
            if strict:
                wanted = f" (the model expects shape {tuple(shape)})" if shape is not None else ""
                return (
                    f"{what} has no entry '{key}'{wanted}; was it saved from a different model? "
                    "(strict=False skips missing entries)"
                )
            continue
        if shape is None:  # a non-tensor entry: presence is all we can check
            continue
        got = found[key]
        if got is None:
            return f"{what} entry '{key}' is not a tensor; the model expects shape {tuple(shape)}"
        if tuple(got) != tuple(shape):
            return (
                f"{what} entry '{key}' has shape {tuple(got)} but the model expects "
                f"{tuple(shape)}"
            )
    if strict:
        for key in found:
            if key not in expected:
                return f"{what} has an unexpected entry '{key}' that the model does not have"
    return None


def tensor_shape(value: Any) -> torch.Size | None:
    """The shape of a tensor entry, ``None`` for a non-tensor one (as in
    :func:`expected_entries`)."""
    return value.shape if isinstance(value, torch.Tensor) else None
