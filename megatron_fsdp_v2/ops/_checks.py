"""Argument checks of the ``megatron_fsdp_v2`` ops, in Python.

* ``check_list_and_flat`` and ``check_tensor_list`` repeat the C++ front end's checks
  (``csrc/include/mfsdp/checks.h``) message for message; the reference ops and the
  fake (meta) kernels use them, so every implementation fails alike.
* ``check_pair``, ``check_same_numel`` and ``check_range`` exist only here: they
  validate the single-segment wrappers (``refresh_from_shard_``,
  ``reduce_scatter_copy_in_``, ``reduce_scatter_copy_out_``) before those call
  ``pack_``, so their errors name the wrapper and its arguments.

Every failure raises RuntimeError ``"<op>: <problem>"`` naming the offending argument.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from megatron_fsdp_v2.api import SUPPORTED_DTYPES

__all__ = [
    "check_flat_buffer",
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
