"""Flat-buffer kernels of megatron_fsdp_v2.

Typed wrappers over ``torch.ops.megatron_fsdp_v2.*`` (C++/CUDA kernels registered
with the dispatcher, traceable by ``torch.compile``). When the extension is not
built, or ``MFSDP_USE_REFERENCE_OPS=1`` is set, the same calls run the
pure-PyTorch reference implementations in ``_reference.py``.

Shared contract:

* dtypes: ``megatron_fsdp_v2.api.SUPPORTED_DTYPES`` (float32, float16, bfloat16,
  float64), any source/destination pair; scaling and accumulation are computed in
  float32 "opmath" (float64 if either side is float64) and rounded once to the
  destination dtype (plus once after the multiply when scaling).
* 1-D buffers (``flat``, shards, reduce-scatter buffers) must be 1-D and
  contiguous; list tensors must be contiguous, of one dtype and on the buffer's
  device. Violations raise RuntimeError naming the op, the argument and the
  problem.
* ops ending in ``_`` mutate their destination and return None.

Two ops are native: ``pack_`` and ``multi_tensor_sum_of_squares``. The refresh and
reduce-scatter copies are one-segment ``pack_`` calls behind their own argument
checks (``_checks``), so they share its kernels, numerics and CUDA launch. A third
native op, ``fp8_quantize_``, is the FP8 refresh of a flat group of main-weight shards
(its own contract, below); the runtime does not call it yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_fsdp_v2.ops import _checks, _reference
from megatron_fsdp_v2.ops._load import (
    HAS_CUDA_KERNELS,
    HAS_EXTENSION,
    USE_REFERENCE_OPS,
    build_info,
)

__all__ = [
    "HAS_CUDA_KERNELS",
    "HAS_EXTENSION",
    "USE_REFERENCE_OPS",
    "build_info",
    "fp8_quantize_",
    "multi_tensor_sum_of_squares",
    "pack_",
    "reduce_scatter_copy_in_",
    "reduce_scatter_copy_out_",
    "refresh_from_shard_",
]

if HAS_EXTENSION:
    from megatron_fsdp_v2.ops import _fake  # noqa: F401  (registers the fake kernels)

# Either torch.ops.megatron_fsdp_v2 or the reference module: same names (pack_,
# multi_tensor_sum_of_squares, fp8_quantize_), same calls.
_impl = _reference if (USE_REFERENCE_OPS or not HAS_EXTENSION) else torch.ops.megatron_fsdp_v2


def _as_list(items: Sequence) -> list | tuple:
    return items if isinstance(items, (list, tuple)) else list(items)


def pack_(inputs: Sequence[Tensor], offsets: Sequence[int], flat: Tensor, *,
          scale: float = 1.0, accumulate: bool = False) -> None:
    """Copy (or accumulate) a list of tensors into one flat buffer.

    For each ``i``: ``flat[offsets[i] : offsets[i] + inputs[i].numel()]`` ``=`` (or
    ``+=`` when ``accumulate``) ``scale * inputs[i].reshape(-1)``, cast to
    ``flat.dtype``. Used for grad staging (``param.grad`` into the flat grad buffer or
    straight into a reduce-scatter input in the comm dtype, with the pre-scale) and
    weight copy-in. On CUDA the whole list is one kernel launch.

    Args:
        inputs: contiguous tensors of any shape, one dtype, on ``flat``'s device.
        offsets: element offset of each input in ``flat``.
        flat: 1-D contiguous destination buffer (mutated).
        scale: multiplier applied in fp32 opmath.
        accumulate: add into ``flat`` instead of overwriting.
    """
    _impl.pack_(_as_list(inputs), _as_list(offsets), flat, scale=scale, accumulate=accumulate)


def refresh_from_shard_(main_weight_shard: Tensor, model_weight: Tensor, shard_offset: int) -> None:
    """Write this rank's main-weight shard into its slot of the replicated model weight.

    ``model_weight[shard_offset : shard_offset + main_weight_shard.numel()] =
    main_weight_shard`` cast to ``model_weight.dtype`` (e.g. fp32 -> bf16). This is the
    local half of the in-place refresh of a replicated buffer; the other half is an
    in-place ``all_gather_into_tensor`` issued by the runtime.

    Args:
        main_weight_shard: 1-D contiguous source shard.
        model_weight: 1-D contiguous replicated buffer (mutated).
        shard_offset: element offset of the shard in ``model_weight``.
    """
    op = "refresh_from_shard_"
    _checks.check_pair(main_weight_shard, "main_weight_shard", model_weight, "model_weight", op)
    _checks.check_range(main_weight_shard, "main_weight_shard", model_weight, "model_weight",
                        shard_offset, "shard_offset", op)
    _impl.pack_([main_weight_shard], [shard_offset], model_weight)


def _copy_same_numel(op: str, src: Tensor, src_arg: str, dst: Tensor, dst_arg: str,
                     scale: float, accumulate: bool) -> None:
    """``dst`` (=|+=) ``scale * src`` for two 1-D buffers of one numel: a one-segment pack_."""
    _checks.check_pair(src, src_arg, dst, dst_arg, op)
    _checks.check_same_numel(src, src_arg, dst, dst_arg, op)
    _impl.pack_([src], [0], dst, scale=scale, accumulate=accumulate)


def reduce_scatter_copy_in_(grad: Tensor, reduce_scatter_input: Tensor, *,
                            pre_scale: float = 1.0) -> None:
    """Stage a flat gradient into the reduce-scatter input in the comm dtype.

    ``reduce_scatter_input = grad * pre_scale`` cast to ``reduce_scatter_input.dtype``.

    Args:
        grad: 1-D contiguous gradient buffer.
        reduce_scatter_input: 1-D contiguous buffer of the same numel (mutated).
        pre_scale: pre-reduction divide factor, applied in fp32 opmath.
    """
    _copy_same_numel("reduce_scatter_copy_in_", grad, "grad", reduce_scatter_input,
                     "reduce_scatter_input", pre_scale, False)


def reduce_scatter_copy_out_(reduced_shard: Tensor, main_grad_shard: Tensor, *,
                             post_scale: float = 1.0, accumulate: bool = False) -> None:
    """Write (or accumulate) a reduced gradient shard into the main-grad shard.

    ``main_grad_shard`` ``=`` (or ``+=``) ``post_scale * reduced_shard`` cast to
    ``main_grad_shard.dtype``.

    Args:
        reduced_shard: 1-D contiguous output of the reduce-scatter.
        main_grad_shard: 1-D contiguous buffer of the same numel (mutated).
        post_scale: post-reduction divide factor, applied in fp32 opmath.
        accumulate: add into ``main_grad_shard`` instead of overwriting.
    """
    _copy_same_numel("reduce_scatter_copy_out_", reduced_shard, "reduced_shard",
                     main_grad_shard, "main_grad_shard", post_scale, accumulate)


def multi_tensor_sum_of_squares(tensors: Sequence[Tensor], *,
                                device: torch.device | str | None = None) -> Tensor:
    """Sum of squares over a list of tensors, for global-norm gradient clipping.

    Returns a 0-dim float32 tensor on the tensors' device equal to
    ``sum(t.float().pow(2).sum() for t in tensors)`` (the kernels accumulate in
    float64 on CPU and float32 on CUDA). Tensors must be contiguous, of one dtype,
    on one device.

    Args:
        tensors: the tensors (e.g. local gradient shards).
        device: only used for an empty list, which returns a zero on ``device``;
            an empty list without ``device`` raises ValueError.
    """
    tensors = _as_list(tensors)
    if len(tensors) == 0:
        if device is None:
            raise ValueError(
                "multi_tensor_sum_of_squares: `tensors` is empty; pass device= to get a zero "
                "on that device"
            )
        return torch.zeros((), dtype=torch.float32, device=device)
    return _impl.multi_tensor_sum_of_squares(tensors)


def fp8_quantize_(inputs: Sequence[Tensor], scales: Sequence[Tensor], offsets: Sequence[int],
                  flat: Tensor, amaxes: Sequence[Tensor]) -> None:
    """Quantize a list of main-weight shards into one flat FP8 buffer and take their amaxes.

    For each ``i``, in one pass over ``inputs[i]``:
    ``flat[offsets[i] : offsets[i] + n_i] = (inputs[i].reshape(-1).float() * scales[i])
    .clamp(-max, max).to(flat.dtype)`` with ``max = torch.finfo(flat.dtype).max`` (448 for
    float8_e4m3fn, 57344 for float8_e5m2), bit for bit; and ``amaxes[i] =
    inputs[i].abs().amax()`` as float32 (0 for an empty input). The cast saturates: values
    beyond ``+-max``, infinities included, become ``+-max``; a NaN stays NaN (torch's
    clamp propagates it), and an input holding a NaN has a NaN amax. An amax slot shared
    by several inputs receives the max over them. The amax is that of the input, before
    the scale: the next step's scale (``max / amax``) needs no second pass over the
    weights. On CUDA a call is two launches per 512 inputs and never syncs with the host
    (scales are read and amaxes written on the device).

    Args:
        inputs: contiguous float32, float16 or bfloat16 tensors (one dtype), on
            ``flat``'s device; any shape, read flattened.
        scales: one float32 tensor with one element (0-dim or shape ``(1,)``) per input.
        offsets: element (= byte) offset of each input's slot in ``flat``.
        flat: 1-D contiguous float8_e4m3fn or float8_e5m2 buffer (mutated); its dtype is
            the format.
        amaxes: one float32 tensor with one element per input (mutated); must not
            overlap ``inputs``, ``scales`` or ``flat``.
    """
    _impl.fp8_quantize_(_as_list(inputs), _as_list(scales), _as_list(offsets), flat,
                        _as_list(amaxes))
