"""Pure-PyTorch implementations of the ``megatron_fsdp_v2`` ops.

They are the test oracle for the C++/CUDA kernels and the fallback used when the
extension is not built or ``MFSDP_USE_REFERENCE_OPS=1`` is set. They are built on
the ATen ops PyTorch FSDP2 uses for the same jobs (``_foreach_copy_``,
``_foreach_mul``, ``_foreach_add``), and follow the kernels' numerics exactly:

* plain copies and casts are a single rounding to the destination dtype;
* with a scale, ``opmath(src) * scale`` is rounded to opmath first;
* with accumulation, ``opmath(dst) + opmath(src) * scale`` rounds once more
  before the cast to the destination dtype.

opmath is float32, or float64 when either side is float64.

The ``check_*`` validators mirror ``csrc/include/mfsdp/checks.h`` message for
message and are shared with the fake (meta) kernels in ``_fake.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "multi_tensor_sum_of_squares",
    "pack_",
    "reduce_scatter_copy_in_",
    "reduce_scatter_copy_out_",
    "refresh_from_shard_",
    "unpack_",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ----------------------------------------------------------------------------
# Validation (same wording as csrc/include/mfsdp/checks.h)
# ----------------------------------------------------------------------------


def _fail(op: str, message: str) -> None:
    raise RuntimeError(f"{op}: {message}")


def _check_dtype(t: Tensor, op: str, arg: str) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        _fail(op, f"unsupported dtype {t.dtype} for `{arg}`; expected float32, float16, "
                  "bfloat16 or float64")


def _check_contiguous(t: Tensor, op: str, arg: str) -> None:
    if not t.is_contiguous():
        _fail(op, f"`{arg}` must be contiguous, got shape {tuple(t.shape)} with strides "
                  f"{t.stride()}")


def check_flat_buffer(t: Tensor, op: str, arg: str) -> None:
    if t.dim() != 1:
        _fail(op, f"`{arg}` must be a 1-D flat buffer, got a {t.dim()}-D tensor of shape "
                  f"{tuple(t.shape)}")
    _check_contiguous(t, op, arg)
    _check_dtype(t, op, arg)


def _check_same_device(t: Tensor, arg: str, ref: Tensor, ref_arg: str, op: str) -> None:
    if t.device != ref.device:
        _fail(op, f"device mismatch: `{arg}` is on {t.device} but `{ref_arg}` is on {ref.device}")


def check_list_and_flat(tensors: Sequence[Tensor], list_arg: str, offsets: Sequence[int],
                        flat: Tensor, flat_arg: str, op: str) -> None:
    check_flat_buffer(flat, op, flat_arg)
    if len(tensors) != len(offsets):
        _fail(op, f"list length mismatch: got {len(tensors)} tensors in `{list_arg}` but "
                  f"{len(offsets)} `offsets`; expected one offset per tensor")
    flat_numel = flat.numel()
    for i, (t, offset) in enumerate(zip(tensors, offsets)):
        arg = f"{list_arg}[{i}]"
        _check_same_device(t, arg, flat, flat_arg, op)
        if i == 0:
            _check_dtype(t, op, arg)
        elif t.dtype != tensors[0].dtype:
            _fail(op, f"dtype mismatch in `{list_arg}`: {list_arg}[0] is {tensors[0].dtype} but "
                      f"{arg} is {t.dtype}; all tensors in one call must share a dtype")
        _check_contiguous(t, op, arg)
        numel = t.numel()
        if not (0 <= offset <= flat_numel and numel <= flat_numel - offset):
            _fail(op, f"offsets[{i}] out of range: {arg} at offset {offset} with numel {numel} "
                      f"needs elements [{offset}, {offset + numel}) but `{flat_arg}` has numel "
                      f"{flat_numel}")


def check_pair(src: Tensor, src_arg: str, dst: Tensor, dst_arg: str, op: str) -> None:
    check_flat_buffer(src, op, src_arg)
    check_flat_buffer(dst, op, dst_arg)
    _check_same_device(src, src_arg, dst, dst_arg, op)


def check_same_numel(src: Tensor, src_arg: str, dst: Tensor, dst_arg: str, op: str) -> None:
    if src.numel() != dst.numel():
        _fail(op, f"numel mismatch: `{src_arg}` has {src.numel()} elements but `{dst_arg}` has "
                  f"{dst.numel()}")


def check_range(src: Tensor, src_arg: str, dst: Tensor, dst_arg: str, dst_offset: int,
                offset_arg: str, op: str) -> None:
    numel, dst_numel = src.numel(), dst.numel()
    if not (0 <= dst_offset <= dst_numel and numel <= dst_numel - dst_offset):
        _fail(op, f"{offset_arg} out of range: `{src_arg}` at {offset_arg} {dst_offset} with "
                  f"numel {numel} needs elements [{dst_offset}, {dst_offset + numel}) but "
                  f"`{dst_arg}` has numel {dst_numel}")


def check_tensor_list(tensors: Sequence[Tensor], list_arg: str, op: str) -> None:
    if len(tensors) == 0:
        _fail(op, f"`{list_arg}` is empty; the Python wrapper handles empty lists (pass device=)")
    for i, t in enumerate(tensors):
        arg = f"{list_arg}[{i}]"
        if i == 0:
            _check_dtype(t, op, arg)
        else:
            _check_same_device(t, arg, tensors[0], f"{list_arg}[0]", op)
            if t.dtype != tensors[0].dtype:
                _fail(op, f"dtype mismatch in `{list_arg}`: {list_arg}[0] is {tensors[0].dtype} "
                          f"but {arg} is {t.dtype}; all tensors in one call must share a dtype")
        _check_contiguous(t, op, arg)


# ----------------------------------------------------------------------------
# The one computation behind every copy op
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
    values = [s.to(opmath) for s in srcs]
    if scale != 1.0:
        values = torch._foreach_mul(values, scale)
    if accumulate:
        values = torch._foreach_add([d.to(opmath) for d in dsts], values)
    torch._foreach_copy_(dsts, values)


# ----------------------------------------------------------------------------
# Ops (same signatures as the public wrappers)
# ----------------------------------------------------------------------------


def pack_(inputs: Sequence[Tensor], offsets: Sequence[int], flat: Tensor, *,
          scale: float = 1.0, accumulate: bool = False) -> None:
    check_list_and_flat(inputs, "inputs", offsets, flat, "flat", "pack_")
    views = [flat.narrow(0, off, t.numel()) for t, off in zip(inputs, offsets)]
    _scaled_copy([t.reshape(-1) for t in inputs], views, scale, accumulate)


def unpack_(flat: Tensor, offsets: Sequence[int], outputs: Sequence[Tensor], *,
            scale: float = 1.0, accumulate: bool = False) -> None:
    check_list_and_flat(outputs, "outputs", offsets, flat, "flat", "unpack_")
    views = [flat.narrow(0, off, t.numel()) for t, off in zip(outputs, offsets)]
    _scaled_copy(views, [t.view(-1) for t in outputs], scale, accumulate)


def refresh_from_shard_(main_weight_shard: Tensor, model_weight: Tensor, shard_offset: int) -> None:
    op = "refresh_from_shard_"
    check_pair(main_weight_shard, "main_weight_shard", model_weight, "model_weight", op)
    check_range(main_weight_shard, "main_weight_shard", model_weight, "model_weight",
                shard_offset, "shard_offset", op)
    dst = model_weight.narrow(0, shard_offset, main_weight_shard.numel())
    _scaled_copy([main_weight_shard], [dst], 1.0, False)


def reduce_scatter_copy_in_(grad: Tensor, reduce_scatter_input: Tensor, *,
                            pre_scale: float = 1.0) -> None:
    op = "reduce_scatter_copy_in_"
    check_pair(grad, "grad", reduce_scatter_input, "reduce_scatter_input", op)
    check_same_numel(grad, "grad", reduce_scatter_input, "reduce_scatter_input", op)
    _scaled_copy([grad], [reduce_scatter_input], pre_scale, False)


def reduce_scatter_copy_out_(reduced_shard: Tensor, main_grad_shard: Tensor, *,
                             post_scale: float = 1.0, accumulate: bool = False) -> None:
    op = "reduce_scatter_copy_out_"
    check_pair(reduced_shard, "reduced_shard", main_grad_shard, "main_grad_shard", op)
    check_same_numel(reduced_shard, "reduced_shard", main_grad_shard, "main_grad_shard", op)
    _scaled_copy([reduced_shard], [main_grad_shard], post_scale, accumulate)


def multi_tensor_sum_of_squares(tensors: Sequence[Tensor]) -> Tensor:
    check_tensor_list(tensors, "tensors", "multi_tensor_sum_of_squares")
    # FSDP2 / clip_grad_norm_ path: one multi-tensor norm launch, fp32 accumulation.
    # Squaring the norms costs ~2 ulp against summing squares directly.
    wide = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
    norms = torch._foreach_norm(list(tensors), 2, dtype=wide)
    return torch.stack(norms).square().sum().to(torch.float32)
