"""The arithmetic of gradient clipping, shared by ``clip_grad_norm_`` and ``get_total_norm``
(``utils.py``): which norms, each rank's part of one, how parts combine across ranks, and the
scaling. No collective is issued here; the callers decide which groups all-reduce the parts.

[Note: p-norms of sharded gradients]
A p-norm of gradients spread over ranks decomposes into parts that one all-reduce combines:

* finite ``p > 0``: each rank sums ``|g|^p`` over its elements (as the sum of its per-tensor
  norms to the power ``p``, accumulated in fp32); the parts are summed (``SUM``) and the total
  is raised to ``1/p``. ``p = 2`` uses the fused sum-of-squares kernel.
* ``inf``: each rank takes its largest magnitude; the parts combine with ``MAX``.

This is exactly what ``torch.nn.utils.clip_grad_norm_`` computes on one process (the norm of the
per-tensor norms), so the result matches it for every ``p``; an empty shard contributes 0.
Refused with ``ValueError``, before any collective: ``p = 0`` (torch's "norm" there is a count
of non-zero per-tensor norms, which depends on how tensors are cut into shards and is not a
norm to clip by), negative ``p`` (not a norm either) and NaN.

``foreach`` has torch's meaning: ``None`` takes the fused/foreach kernels where the device has
them, ``True`` requires them (``RuntimeError`` on a device without, like torch, checked on the
parameters' devices so every rank decides alike), ``False`` goes tensor by tensor. It changes
the kernels, never the collectives.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.utils._foreach_utils import _device_has_foreach_support

from .. import ops
from ..api import SUPPORTED_DTYPES

__all__ = [
    "by_device_and_dtype",
    "check_foreach",
    "check_norm_type",
    "combine",
    "finish",
    "local_norm_part",
    "reduce_op",
    "scale_",
]


def check_norm_type(norm_type: float | str, what: str = "clip_grad_norm_") -> float:
    """``norm_type`` as a float (``'inf'`` accepted, as torch does), or a ``ValueError`` /
    ``TypeError`` naming the supported ones (see [Note: p-norms of sharded gradients])."""
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise TypeError(
            f"{what}: norm_type must be a number or 'inf', got {norm_type!r}"
        ) from None
    if math.isnan(p) or p <= 0:
        raise ValueError(
            f"{what}: norm_type={norm_type!r} is not supported: use a p-norm with "
            "p > 0 (1.0, 2.0, 3.0, ...) or inf. p=0 (a count of non-zero gradients) and "
            "negative p are not norms one can clip by"
        )
    return p


def check_foreach(foreach: bool | None, devices: Iterable[torch.device]) -> None:
    """``foreach=True`` on a device without foreach kernels: torch's ``RuntimeError``, raised
    before any collective. ``devices`` are the parameters' (the same on every rank)."""
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"clip_grad_norm_: foreach must be True, False or None, got {foreach!r}")
    if foreach:
        for device in devices:
            if not _device_has_foreach_support(device):
                raise RuntimeError(
                    f"foreach=True was passed, but can't use the foreach API on {device.type} "
                    "tensors; pass foreach=None or False"
                )


def reduce_op(p: float) -> dist.ReduceOp.RedOpType:
    return dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM


def combine(total: torch.Tensor, part: torch.Tensor, p: float) -> torch.Tensor:
    """Two parts of a p-norm as one (before :func:`finish`)."""
    return torch.maximum(total, part) if math.isinf(p) else total + part


def finish(total: torch.Tensor, p: float) -> torch.Tensor:
    """The norm from the combined parts."""
    if math.isinf(p):
        return total
    if p == 2.0:
        return total.sqrt()
    return total.pow(1.0 / p)


def by_device_and_dtype(
    tensors: list[torch.Tensor],
) -> list[tuple[tuple[torch.device, torch.dtype], list[torch.Tensor]]]:
    """Non-empty tensors grouped by (device, dtype), groups in a rank-independent order."""
    by_device_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_device_dtype.setdefault((t.device, t.dtype), []).append(t)
    return sorted(by_device_dtype.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1])))


def _use_foreach(foreach: bool | None, device: torch.device) -> bool:
    return foreach is not False and _device_has_foreach_support(device)


def local_norm_part(tensors: list[torch.Tensor], p: float, device: torch.device,
                    foreach: bool | None = None) -> torch.Tensor:
    """This rank's part of the p-norm of ``tensors`` (any dtypes and devices) as a 0-dim fp32
    tensor on ``device``: the sum of ``|g|^p`` for finite ``p``, the largest magnitude for
    ``inf`` (0 for no elements)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (tensor_device, dtype), group in by_device_and_dtype(tensors):
        fused = _use_foreach(foreach, tensor_device)
        if p == 2.0 and fused and dtype in SUPPORTED_DTYPES:
            # One fused kernel per dtype (it takes one dtype), accumulating in fp32 or wider.
            part = ops.multi_tensor_sum_of_squares([t.contiguous() for t in group])
        else:
            if fused:
                norms = list(torch._foreach_norm(group, p, dtype=torch.float32))
            else:
                norms = [torch.linalg.vector_norm(t, p, dtype=torch.float32) for t in group]
            stacked = torch.stack(norms)
            part = stacked.max() if math.isinf(p) else stacked.pow(p).sum()
        total = combine(total, part.to(device=device, dtype=torch.float32), p)
    return total


def scale_(grads: list[torch.Tensor], coef: torch.Tensor, foreach: bool | None = None) -> None:
    """Multiply every gradient in place by ``coef`` (0-dim), cast to each gradient's dtype."""
    for (device, dtype), group in by_device_and_dtype(grads):
        factor = coef.to(device=device, dtype=dtype)
        if _use_foreach(foreach, device):
            torch._foreach_mul_(group, factor)
        else:
            for g in group:
                g.mul_(factor)
