"""Pure-PyTorch implementations of the ``megatron_fsdp_v2`` ops (``pack_``,
``multi_tensor_sum_of_squares`` and ``fp8_quantize_``).

They are the test oracle for the C++/CUDA kernels and the fallback used when the
extension is not built or ``MFSDP_USE_REFERENCE_OPS=1`` is set. They are built on
the ATen ops PyTorch FSDP2 uses for the same jobs (``_foreach_copy_``,
``_foreach_mul``, ``_foreach_add``), and follow the kernels' numerics exactly:

* plain copies and casts are a single rounding to the destination dtype;
* with a scale, ``opmath(src) * scale`` is rounded to opmath first;
* with accumulation, ``opmath(dst) + opmath(src) * scale`` rounds once more
  before the cast to the destination dtype.

opmath is float32, or float64 when either side is float64. ``fp8_quantize_`` is
torch's saturated cast itself, ``(x.float() * scale).clamp(-max, max).to(fp8)``, the
expression torchao's float8 weight cast uses, with ``x.abs().amax()``. Arguments are
validated by ``_checks`` with the C++ front end's messages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_fsdp_v2.ops._checks import (
    check_fp8_quantize,
    check_list_and_flat,
    check_tensor_list,
)

__all__ = ["fp8_quantize_", "multi_tensor_sum_of_squares", "pack_"]


# ----------------------------------------------------------------------------
# The computation behind pack_
# ----------------------------------------------------------------------------


def _opmath(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in (a, b) else torch.float32


def _scaled_copy(srcs: list[Tensor], dsts: list[Tensor], scale: float, accumulate: bool) -> None:
    """dsts[i] (=|+=) scale * srcs[i], srcs[i] and dsts[i] of equal numel and 1-D."""
    srcs = [s for s in srcs if s.numel() > 0]
    dsts = [d for d in dsts if d.numel() > 0]
    if not srcs:
        return
    if scale == 1.0 and not accumulate:
        torch._foreach_copy_(dsts, srcs)  # one rounding: exact cast
        return
    opmath = _opmath(srcs[0].dtype, dsts[0].dtype)
    values: list[torch.Tensor] | tuple[torch.Tensor, ...] = [s.to(opmath) for s in srcs]
    if scale != 1.0:
        values = torch._foreach_mul(values, scale)
    if accumulate:
        values = torch._foreach_add([d.to(opmath) for d in dsts], values)
    torch._foreach_copy_(dsts, values)


# ----------------------------------------------------------------------------
# Ops (same signatures as the C++ schemas)
# ----------------------------------------------------------------------------


def pack_(inputs: Sequence[Tensor], offsets: Sequence[int], flat: Tensor, *,
          scale: float = 1.0, accumulate: bool = False) -> None:
    check_list_and_flat(inputs, "inputs", offsets, flat, "flat", "pack_")
    views = [flat.narrow(0, off, t.numel()) for t, off in zip(inputs, offsets)]
    _scaled_copy([t.reshape(-1) for t in inputs], views, scale, accumulate)


def multi_tensor_sum_of_squares(tensors: Sequence[Tensor]) -> Tensor:
    check_tensor_list(tensors, "tensors", "multi_tensor_sum_of_squares")
    # FSDP2 / clip_grad_norm_ path: one multi-tensor norm launch, fp32 accumulation.
    # Squaring the norms costs ~2 ulp against summing squares directly.
    wide = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
    norms = torch._foreach_norm(list(tensors), 2, dtype=wide)
    return torch.stack(norms).square().sum().to(torch.float32)


def fp8_quantize_(inputs: Sequence[Tensor], scales: Sequence[Tensor], offsets: Sequence[int],
                  flat: Tensor, amaxes: Sequence[Tensor]) -> None:
    check_fp8_quantize(inputs, scales, offsets, flat, amaxes, "fp8_quantize_")
    max_finite = torch.finfo(flat.dtype).max
    # Zero every slot first, then max-combine, so a slot shared by several inputs gets
    # the max over them (the kernels' contract); an empty input leaves its slot at 0.
    for amax in amaxes:
        amax.zero_()
    for x, scale, offset, amax in zip(inputs, scales, offsets, amaxes):
        values = x.reshape(-1).float()
        quantized = (values * scale.reshape(())).clamp(-max_finite, max_finite).to(flat.dtype)
        flat.narrow(0, offset, values.numel()).copy_(quantized)
        if values.numel() > 0:
            amax.copy_(torch.maximum(amax.reshape(()), values.abs().amax()).reshape(amax.shape))
