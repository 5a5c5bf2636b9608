"""Argument checks of the ``megatron_fsdp_v2`` ops, in Python.

* ``check_list_and_flat``, ``check_tensor_list`` and ``check_fp8_quantize`` repeat the
  C++ front end's checks (``csrc/include/mfsdp/checks.h``) message for message; the
  reference ops and the fake (meta) kernels use them, so every implementation fails alike.
* ``check_pair``, ``check_same_numel`` and ``check_range`` exist only here: they
  validate the single-segment wrappers (``refresh_from_shard_``,
  ``reduce_scatter_copy_in_``, ``reduce_scatter_copy_out_``) before those call
  ``pack_``, so their errors name the wrapper and its arguments.

Every failure raises RuntimeError ``"<op>: <problem>"`` naming the offending argument.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_fsdp_v2.api import SUPPORTED_DTYPES

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""Output dtypes of ``fp8_quantize_`` (the fp8 flat buffer's dtype picks the format)."""

FP8_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Input dtypes of ``fp8_quantize_``; float64 would round at ``x.float()`` before the scale."""

__all__ = [
    "FP8_DTYPES",
    "FP8_INPUT_DTYPES",
    "check_flat_buffer",
    "check_fp8_quantize",
    "check_list_and_flat",
    "check_pair",
    "check_range",
    "check_same_numel",
    "check_tensor_list",
]


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


def _check_same_dtype(tensors: Sequence[Tensor], i: int, list_arg: str, op: str) -> None:
    if tensors[i].dtype != tensors[0].dtype:
        _fail(op, f"dtype mismatch in `{list_arg}`: {list_arg}[0] is {tensors[0].dtype} but "
                  f"{list_arg}[{i}] is {tensors[i].dtype}; all tensors in one call must share a "
                  "dtype")


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
        else:
            _check_same_dtype(tensors, i, list_arg, op)
        _check_contiguous(t, op, arg)
        _check_in_flat(t, offset, i, arg, flat_numel, flat_arg, op)


def _check_in_flat(t: Tensor, offset: int, i: int, arg: str, flat_numel: int, flat_arg: str,
                   op: str) -> None:
    """``t`` placed at ``offset`` lies inside the flat buffer of ``flat_numel`` elements."""
    numel = t.numel()
    if not (0 <= offset <= flat_numel and numel <= flat_numel - offset):
        _fail(op, f"offsets[{i}] out of range: {arg} at offset {offset} with numel {numel} "
                  f"needs elements [{offset}, {offset + numel}) but `{flat_arg}` has numel "
                  f"{flat_numel}")


def check_tensor_list(tensors: Sequence[Tensor], list_arg: str, op: str) -> None:
    if len(tensors) == 0:
        _fail(op, f"`{list_arg}` is empty; the Python wrapper handles empty lists (pass device=)")
    for i, t in enumerate(tensors):
        arg = f"{list_arg}[{i}]"
        if i == 0:
            _check_dtype(t, op, arg)
        else:
            _check_same_device(t, arg, tensors[0], f"{list_arg}[0]", op)
            _check_same_dtype(tensors, i, list_arg, op)
        _check_contiguous(t, op, arg)


def check_pair(src: Tensor, src_arg: str, dst: Tensor, dst_arg: str, op: str) -> None:
    """Two 1-D flat buffers on one device."""
    check_flat_buffer(src, op, src_arg)
    check_flat_buffer(dst, op, dst_arg)
    _check_same_device(src, src_arg, dst, dst_arg, op)


def check_same_numel(src: Tensor, src_arg: str, dst: Tensor, dst_arg: str, op: str) -> None:
    if src.numel() != dst.numel():
        _fail(op, f"numel mismatch: `{src_arg}` has {src.numel()} elements but `{dst_arg}` has "
                  f"{dst.numel()}")


def check_range(src: Tensor, src_arg: str, dst: Tensor, dst_arg: str, dst_offset: int,
                offset_arg: str, op: str) -> None:
    """``dst[dst_offset : dst_offset + src.numel()]`` lies inside ``dst``."""
    numel, dst_numel = src.numel(), dst.numel()
    if not (0 <= dst_offset <= dst_numel and numel <= dst_numel - dst_offset):
        _fail(op, f"{offset_arg} out of range: `{src_arg}` at {offset_arg} {dst_offset} with "
                  f"numel {numel} needs elements [{dst_offset}, {dst_offset + numel}) but "
                  f"`{dst_arg}` has numel {dst_numel}")


def _check_fp32_slot(t: Tensor, arg: str, flat: Tensor, op: str) -> None:
    """A one-element float32 tensor on ``flat``'s device (a per-tensor scale or amax slot)."""
    _check_same_device(t, arg, flat, "flat", op)
    if t.dtype != torch.float32 or t.numel() != 1:
        _fail(op, f"`{arg}` must be a float32 tensor with one element (0-dim or shape (1,)), "
                  f"got {t.dtype} of shape {tuple(t.shape)}")


def check_fp8_quantize(inputs: Sequence[Tensor], scales: Sequence[Tensor],
                       offsets: Sequence[int], flat: Tensor, amaxes: Sequence[Tensor],
                       op: str) -> None:
    """The checks of ``fp8_quantize_``: ``check_list_and_flat`` with the quantize dtypes,
    plus one scale and one amax slot per input."""
    if flat.dim() != 1:
        _fail(op, f"`flat` must be a 1-D flat buffer, got a {flat.dim()}-D tensor of shape "
                  f"{tuple(flat.shape)}")
    _check_contiguous(flat, op, "flat")
    if flat.dtype not in FP8_DTYPES:
        _fail(op, f"unsupported dtype {flat.dtype} for `flat`; expected float8_e4m3fn or "
                  "float8_e5m2")
    n = len(inputs)
    if not len(scales) == len(offsets) == len(amaxes) == n:
        _fail(op, f"list length mismatch: got {n} tensors in `inputs`, {len(scales)} `scales`, "
                  f"{len(offsets)} `offsets` and {len(amaxes)} `amaxes`; expected one of each "
                  "per input")
    flat_numel = flat.numel()
    for i, (t, offset) in enumerate(zip(inputs, offsets)):
        arg = f"inputs[{i}]"
        _check_same_device(t, arg, flat, "flat", op)
        if i == 0:
            if t.dtype not in FP8_INPUT_DTYPES:
                _fail(op, f"unsupported dtype {t.dtype} for `{arg}`; expected float32, float16 "
                          "or bfloat16")
        else:
            _check_same_dtype(inputs, i, "inputs", op)
        _check_contiguous(t, op, arg)
        _check_in_flat(t, offset, i, arg, flat_numel, "flat", op)
        _check_fp32_slot(scales[i], f"scales[{i}]", flat, op)
        _check_fp32_slot(amaxes[i], f"amaxes[{i}]", flat, op)
