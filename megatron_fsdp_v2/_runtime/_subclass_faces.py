"""The faces of a parameter whose tensor subclass defines FSDP2's all-gather extensions (see
[Note: FSDP2 all-gather extensions] in ``_subclass_gather.py``): which of its inner tensors hold
its values, and the subclass rebuilt over other values."""

from __future__ import annotations

import torch

__all__ = ["has_all_gather_extensions", "inner_values", "rewrap", "values_names"]


def has_all_gather_extensions(param: torch.Tensor) -> bool:
    """Whether ``param``'s class defines FSDP2's all-gather extension methods."""
    return hasattr(param, "fsdp_pre_all_gather") and hasattr(param, "fsdp_post_all_gather")


def values_names(param: torch.Tensor) -> list[str]:
    """The names of ``param``'s inner tensors (``__tensor_flatten__``) of its own shape and
    dtype: what holds its values. The others are metadata: torchao's ``_precomputed_scale``
    (a 0-d scale) once ``precompute_float8_dynamic_scale_for_fsdp`` ran, which torchao's
    ``__tensor_flatten__`` then lists too."""
    names, _ = param.__tensor_flatten__()  # type: ignore[attr-defined]
    return [n for n in names if isinstance(t := getattr(param, n, None), torch.Tensor)
            and t.shape == param.shape and t.dtype == param.dtype]


def inner_values(param: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``param``'s values: the one inner tensor of an extension
    subclass of its shape and dtype (see [Note: FSDP2 all-gather extensions]), else ``param``
    detached."""
    if not has_all_gather_extensions(param):
        return param.detach()
    (name,) = values_names(param)
    return getattr(param, name).detach()


def rewrap(template: torch.Tensor, values: torch.Tensor, keep_metadata: bool = True
           ) -> torch.Tensor:
    """``template``'s subclass (same configuration) rebuilt over the plain tensor ``values``.
    ``keep_metadata=False``: without the template's other inner tensors (a scale computed for
    the values before wrapping, which the wrapped weights must not inherit: FSDP2 drops it too,
    its shards are rebuilt through ops that keep only ``_tensor``)."""
    names, context = template.__tensor_flatten__()  # type: ignore[attr-defined]
    (name,) = values_names(template)
    inner = {n: getattr(template, n) for n in names} if keep_metadata else {}
    inner[name] = values
    return type(template).__tensor_unflatten__(  # type: ignore[attr-defined]
        inner, context, values.shape, values.stride()
    )
