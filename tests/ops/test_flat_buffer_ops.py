"""Flat-buffer kernels (torch.ops.megatron_fsdp_v2.*) against the pure-PyTorch reference.

``pack_`` and the public wrappers built on it (``refresh_from_shard_``,
``reduce_scatter_copy_in_``, ``reduce_scatter_copy_out_``: one-segment packs) are
checked bitwise against ``megatron_fsdp_v2.ops._reference.pack_``: the kernels
round after the multiply and after the add exactly like the reference's
``_foreach_mul`` / ``_foreach_add`` (no FMA contraction), so plain copies, casts,
scaled copies and accumulation all agree bit for bit. The one tolerance is
``multi_tensor_sum_of_squares``: summation order differs (the CPU kernel
accumulates in float64, the CUDA kernel per-thread in float32, the reference
squares ``_foreach_norm`` results), so it is compared with rtol=1e-5.
"""

from __future__ import annotations

import pytest
import torch
from _flat_buffer import (
    DEVICES,
    DTYPE_PAIRS,
    DTYPES,
    MODES,
    SHAPES,
    _layout,
    _ops,
    _randn,
    assert_bitwise_equal,
    needs_ext,
)

import megatron_fsdp_v2.ops as mops
from megatron_fsdp_v2.ops import _reference as ref

pytestmark = needs_ext


# Correctness against the reference
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale, accumulate", MODES)
@pytest.mark.parametrize("src_dtype, dst_dtype", DTYPE_PAIRS)
def test_pack(device, src_dtype, dst_dtype, scale, accumulate):
    offsets, total = _layout()
    inputs = [_randn(s, src_dtype, device, seed=i) for i, s in enumerate(SHAPES)]
    flat = _randn((total,), dst_dtype, device, seed=100)
    expected = flat.clone()
    ref.pack_(inputs, offsets, expected, scale=scale, accumulate=accumulate)
    _ops().pack_(inputs, offsets, flat, scale=scale, accumulate=accumulate)
    assert_bitwise_equal(flat, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype, dst_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("numel, offset", [(0, 0), (1, 4), (4369, 11), (1000, 3000)])
def test_refresh_from_shard(use_kernels, device, src_dtype, dst_dtype, numel, offset):
    shard = _randn((numel,), src_dtype, device, seed=1)
    weight = _randn((5003,), dst_dtype, device, seed=2)
    expected = weight.clone()
    ref.pack_([shard], [offset], expected)
    mops.refresh_from_shard_(shard, weight, offset)
    assert_bitwise_equal(weight, expected)
    # the slot now holds the shard cast once; the rest is untouched
    assert_bitwise_equal(weight[offset:offset + numel], shard.to(dst_dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype, dst_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("pre_scale", [1.0, 0.125, 1 / 3])
@pytest.mark.parametrize("numel", [0, 1, 4369])
def test_reduce_scatter_copy_in(use_kernels, device, src_dtype, dst_dtype, pre_scale, numel):
    grad = _randn((numel,), src_dtype, device, seed=1)
    rs_input = _randn((numel,), dst_dtype, device, seed=2)
    expected = rs_input.clone()
    ref.pack_([grad], [0], expected, scale=pre_scale)
    mops.reduce_scatter_copy_in_(grad, rs_input, pre_scale=pre_scale)
    assert_bitwise_equal(rs_input, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale, accumulate", MODES)
@pytest.mark.parametrize("src_dtype, dst_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("numel", [1, 4369])
def test_reduce_scatter_copy_out(use_kernels, device, src_dtype, dst_dtype, scale, accumulate,
                                 numel):
    reduced = _randn((numel,), src_dtype, device, seed=1)
    main_grad = _randn((numel,), dst_dtype, device, seed=2)
    expected = main_grad.clone()
    ref.pack_([reduced], [0], expected, scale=scale, accumulate=accumulate)
    mops.reduce_scatter_copy_out_(reduced, main_grad, post_scale=scale, accumulate=accumulate)
    assert_bitwise_equal(main_grad, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [*DTYPES.values(), torch.float64], ids=[*DTYPES, "f64"])
def test_multi_tensor_sum_of_squares(device, dtype):
    tensors = [_randn(s, dtype, device, seed=i) for i, s in enumerate(SHAPES)]
    actual = _ops().multi_tensor_sum_of_squares(tensors)
    assert actual.dtype == torch.float32 and actual.dim() == 0
    assert actual.device == tensors[0].device
    exact = sum(t.double().square().sum() for t in tensors).float()
    torch.testing.assert_close(actual, exact, rtol=1e-5, atol=0)
    torch.testing.assert_close(actual, ref.multi_tensor_sum_of_squares(tensors), rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_multi_tensor_sum_of_squares_empty_list(device):
    zero = mops.multi_tensor_sum_of_squares([], device=device)
    assert zero.item() == 0.0 and zero.dtype == torch.float32 and zero.device.type == device
    with pytest.raises(ValueError, match="empty; pass device="):
        mops.multi_tensor_sum_of_squares([])


@pytest.mark.parametrize("device", DEVICES)
def test_pack_large(device):
    """One 16M+ element tensor (plus a small one): the parallel, vectorized bulk paths,
    including the CPU streaming-store paths (non-accumulating calls writing >= 16 MiB)
    with a misaligned start."""
    big = _randn((4097, 4099), torch.float32, device, seed=1)
    small = _randn((768,), torch.float32, device, seed=2)
    offsets = [3, big.numel() + 8]
    for flat_dtype, scale, accumulate in [
        (torch.bfloat16, 0.5, False),  # streaming cast + scale
        (torch.bfloat16, 0.5, True),  # accumulate (cached stores)
        (torch.float32, 1.0, False),  # streaming same-dtype copy
    ]:
        flat = _randn((big.numel() + 8 + 768,), flat_dtype, device, seed=3)
        expected = flat.clone()
        ref.pack_([big, small], offsets, expected, scale=scale, accumulate=accumulate)
        _ops().pack_([big, small], offsets, flat, scale=scale, accumulate=accumulate)
        assert_bitwise_equal(flat, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_public_wrappers(use_kernels, device):
    """The typed wrappers accept Python sequences and reach the same kernels."""
    offsets, total = _layout()
    inputs = [_randn(s, torch.float32, device, seed=i) for i, s in enumerate(SHAPES)]
    flat = torch.zeros(total, dtype=torch.bfloat16, device=device)
    mops.pack_(tuple(inputs), iter(offsets), flat, scale=2.0)
    for off, inp in zip(offsets, inputs):
        assert_bitwise_equal(flat[off:off + inp.numel()], (inp * 2.0).bfloat16().reshape(-1))
    shard = torch.arange(8, dtype=torch.float32, device=device)
    weight = torch.zeros(16, dtype=torch.bfloat16, device=device)
    mops.refresh_from_shard_(shard, weight, 8)
    assert weight[8:].tolist() == list(range(8)) and weight[:8].abs().sum().item() == 0
    rs_input = torch.empty(8, dtype=torch.bfloat16, device=device)
    mops.reduce_scatter_copy_in_(shard, rs_input, pre_scale=0.5)
    mops.reduce_scatter_copy_out_(rs_input, shard, post_scale=2.0, accumulate=True)
    assert shard.tolist() == [2.0 * i for i in range(8)]
    total_sq = mops.multi_tensor_sum_of_squares([shard])
    assert total_sq.item() == sum((2.0 * i) ** 2 for i in range(8))


# ----------------------------------------------------------------------------
