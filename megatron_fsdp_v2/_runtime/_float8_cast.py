"""The fused FP8 cast of a group of torchao float8 weights with precomputed scales, used by
:class:`~._subclass_gather.ExtensionGather` instead of each parameter's ``fsdp_pre_all_gather``
(see [Note: FSDP2 all-gather extensions] in ``_subclass_gather.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .. import ops

if TYPE_CHECKING:
    from ._flat_param_group import FlatParamGroup

__all__ = ["fused_float8_cast"]


def fused_float8_cast(group: FlatParamGroup, buffer_for: Callable[[int, torch.dtype], torch.Tensor],
                      base: int = 0
                      ) -> tuple[list[torch.Tensor], list[Any], list[torch.Size]] | None:
    """torchao's ``WeightWithDynamicFloat8CastTensor`` with precomputed scales: its
    ``fsdp_pre_all_gather`` is ``(rows * scale).clamp(-max, max).to(float8)`` into a new
    tensor with metadata ``(scale,)``; the library's fused ``ops.fp8_quantize_`` writes the
    same bits (tested against it) straight into this rank's slot of the FP8 buffer
    (``buffer_for(0, float8 dtype)``, starting at layout element ``base``) for the whole group
    in one call, saving the per-parameter tensors and copies. Returns what
    ``ExtensionGather._pack`` returns, or None: take the protocol (another class, a scale not
    precomputed, mixed float8 formats)."""
    locals_ = [r.dist_param._local_tensor for r in group.records]  # type: ignore[attr-defined]
    if not all(
        type(t).__qualname__ == "WeightWithDynamicFloat8CastTensor"
        and type(t).__module__.startswith("torchao.float8")
        and isinstance(getattr(t, "_precomputed_scale", None), torch.Tensor)
        for t in locals_
    ):
        return None
    formats = {t._dtype for t in locals_}
    if len(formats) != 1 or not group.main_weight.is_contiguous():
        return None
    (fmt,) = formats
    buffer = buffer_for(0, fmt)
    span = group.plan.main_weight_span
    scales = [t._precomputed_scale for t in locals_]
    inputs = [group.local_view(group.main_weight, i) for i in range(len(locals_))]
    ranges = [group.layout.local_item_range(i, *span) for i in range(len(locals_))]
    # (An input with no rows here may lie outside a buffer narrower than the layout.)
    offsets = [lo - base if hi > lo else 0 for lo, hi in ranges]
    amaxes = torch.empty(len(locals_), dtype=torch.float32, device=group.device)
    ops.fp8_quantize_(inputs, [s.reshape(()) for s in scales], offsets, buffer,
                      list(amaxes.unbind()))
    trailing = [r.item.shape[1:] for r in group.records]
    return [buffer], [(scale,) for scale in scales], trailing
