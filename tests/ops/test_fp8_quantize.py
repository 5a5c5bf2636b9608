"""fp8_quantize_ (torch.ops.megatron_fsdp_v2) against torch's saturated FP8 cast (the contract:
``_fp8.py``), bitwise, and its amax.

The reference op (``_reference.fp8_quantize_``) is checked against the same expression. Inputs
cover both formats, float32 / bfloat16 / float16, inf / NaN of both signs, fp32 and fp8
subnormals, every rounding tie of the fp8 grid and its neighbours, every 16-bit input, a sample
of every fp32 exponent and top mantissa bits, empty and odd-length inputs, gaps between slots
(left untouched), several segments, shared scale and amax slots, and non-unit scales.
"""

from __future__ import annotations

import pytest
import torch
from _flat_buffer import DEVICES
from _fp8 import (
    FP8,
    SCALES,
    SHAPES,
    SRC,
    _garbage_fp8,
    _layout,
    _ops,
    _run_and_check,
    _spread,
    _with_specials,
    assert_amax_equal,
    assert_bytes_equal,
    torch_quantize,
)

import megatron_fsdp_v2.ops as mops
from megatron_fsdp_v2.ops import _reference as ref

pytestmark = pytest.mark.skipif(not mops.HAS_EXTENSION, reason="megatron_fsdp_v2._C is not built")


# ----------------------------------------------------------------------------
# Bitwise against torch's saturated cast
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("src_dtype", SRC)
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_matches_torch(device, src_dtype, fp8, scale, impl):
    offsets, total = _layout()
    inputs = [_spread(s, src_dtype, device, seed=i) for i, s in enumerate(SHAPES)]
    for x in inputs[2:4]:
        _with_specials(x)
    # 0-dim and shape-(1,) scales alternate; one input gets its own, different scale.
    scales = [torch.full((1,) if i % 2 else (), scale, device=device) for i in range(len(SHAPES))]
    scales[3] = torch.tensor(scale * 3.1, device=device)
    flat = _garbage_fp8(total, fp8, device)
    _run_and_check(_ops() if impl == "kernel" else ref, inputs, scales, offsets, flat, fp8)


def _boundaries(fp8: torch.dtype) -> torch.Tensor:
    """Every finite fp8 value, every midpoint between neighbours (the round-to-nearest-even
    ties), one fp32 ulp either side of both, values around max and the overflow
    threshold, the subnormal edge, fp32 subnormals; both signs."""
    codes = torch.arange(0, 0x80, dtype=torch.uint8).view(fp8).float()
    grid = codes[torch.isfinite(codes)].unique()  # ascending, 0 .. max
    mids = (grid[:-1] + grid[1:]) / 2  # exact in fp32
    max_finite = torch.finfo(fp8).max
    ulp_past_max = float(grid[-1] - grid[-2])
    extra = torch.tensor([max_finite + ulp_past_max / 2, max_finite + ulp_past_max,
                          max_finite * 2, float(grid[1]) / 2, float(grid[1]) / 4,
                          1e-45, 1e-40, 1.1754942e-38, 3.4028235e38])
    points = torch.cat([grid, mids, extra])
    bits = points.view(torch.int32)
    below = (bits - 1).clamp(min=0).view(torch.float32)
    above = (bits + 1).view(torch.float32)
    positive = torch.cat([points, below, above])
    return torch.cat([positive, -positive])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_rounding_boundaries(device, fp8, scale):
    """Ties round to even, one ulp off a tie rounds to the nearer value, past max saturates.
    With scale 1/8 the input is boundary * 8: the multiply is exact, the cast is tested."""
    values = (_boundaries(fp8) / scale).to(device)
    scales = [torch.tensor(scale, device=device)]
    flat = torch.empty(values.numel() + 3, dtype=fp8, device=device)
    _run_and_check(_ops(), [values], scales, [3], flat, fp8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_every_16bit_input(device, src_dtype, fp8, scale):
    """All 65536 bf16 / fp16 bit patterns (inf, NaN of both signs, subnormals included)."""
    values = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    values = values.view(src_dtype).to(device)
    flat = torch.empty(values.numel(), dtype=fp8, device=device)
    _run_and_check(_ops(), [values], [torch.tensor(scale, device=device)], [0], flat, fp8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_fp32_bit_patterns(device, fp8, scale):
    """Every combination of sign, exponent and the top 13 mantissa bits of fp32 (the low
    10 bits random): every fp32 binade, NaN and inf patterns, and every rounding case of
    both formats up to the sticky bits (test_rounding_boundaries has the exact ties)."""
    g = torch.Generator().manual_seed(0)
    high = torch.arange(0, 1 << 22, dtype=torch.int64) << 10
    low = torch.randint(0, 1 << 10, (1 << 22,), generator=g, dtype=torch.int64)
    values = (high | low).to(torch.int32).view(torch.float32).to(device)  # wraps to negatives
    flat = torch.empty(values.numel(), dtype=fp8, device=device)
    _run_and_check(_ops(), [values], [torch.tensor(scale, device=device)], [0], flat, fp8)


# ----------------------------------------------------------------------------
# amax: across threads / blocks, shared slots, empty inputs
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["first", "last", "nan_middle", "inf_middle"])
def test_amax_of_split_segments(four_threads, device, where):
    """A segment much longer than one parallel task (CPU) or tile (CUDA): its amax combines
    every piece, wherever the max is."""
    big = _spread((1 << 20) + 13, torch.float32, "cpu", seed=1).clamp(-100, 100)
    small = _spread((77,), torch.float32, "cpu", seed=2).clamp(-100, 100)
    position = {"first": 0, "last": -1, "nan_middle": big.numel() // 2 + 5,
                "inf_middle": big.numel() // 3}[where]
    big[position] = {"first": -1234.5, "last": 999.25, "nan_middle": float("nan"),
                     "inf_middle": -float("inf")}[where]
    inputs = [big.to(device), small.to(device)]
    scales = [torch.tensor(0.5, device=device), torch.tensor(3.0, device=device)]
    flat = torch.zeros(big.numel() + 77 + 1, dtype=torch.float8_e4m3fn, device=device)
    amaxes = _run_and_check(_ops(), inputs, scales, [1, big.numel() + 1], flat,
                            torch.float8_e4m3fn)
    expected = {"first": 1234.5, "last": 999.25, "nan_middle": float("nan"),
                "inf_middle": float("inf")}[where]
    assert_amax_equal(amaxes[0], torch.tensor(expected))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_shared_scale_and_amax_slots(device, impl):
    """Inputs may share a scale tensor and an amax slot; a shared slot gets the max over
    its inputs (an empty input contributes 0), whatever it held before."""
    a = torch.tensor([1.0, -5.0, 2.0], device=device)
    b = torch.tensor([-7.5, 3.0], device=device)
    c = torch.tensor([100.0], device=device)
    empty = torch.empty(0, device=device)
    scale = torch.tensor(2.0, device=device)
    shared, own = torch.full((), 1e9, device=device), torch.full((1,), -1.0, device=device)
    flat = torch.zeros(6, dtype=torch.float8_e5m2, device=device)
    impl_ops = _ops() if impl == "kernel" else ref
    # the largest |x| comes first, so "last writer wins" would leave 7.5
    impl_ops.fp8_quantize_([c, a, empty, b], [scale, scale, scale, scale], [0, 1, 4, 4], flat,
                           [shared, shared, own, shared])
    assert shared.item() == 100.0
    assert own.item() == 0.0
    assert_bytes_equal(flat, torch_quantize(torch.cat([c, a, b]), scale, torch.float8_e5m2))


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device):
    """No inputs: nothing written. Only empty inputs: amax slots 0, flat untouched."""
    flat = _garbage_fp8(8, torch.float8_e4m3fn, device)
    before = flat.clone()
    _ops().fp8_quantize_([], [], [], flat, [])
    assert_bytes_equal(flat, before)
    amaxes = [torch.full((), 5.0, device=device), torch.full((1,), 5.0, device=device)]
    empties = [torch.empty(0, device=device), torch.empty(0, 3, device=device)]
    scales = [torch.tensor(1.0, device=device)] * 2
    _ops().fp8_quantize_(empties, scales, [0, 8], flat, amaxes)
    assert_bytes_equal(flat, before)
    assert [a.item() for a in amaxes] == [0.0, 0.0]


@pytest.mark.parametrize("device", DEVICES)
def test_public_wrapper(use_kernels, device):
    """The typed wrapper accepts any sequences and reaches the kernels."""
    x = torch.tensor([[0.5, -600.0], [3.0, 1e-3]], device=device)
    amax = torch.zeros((), device=device)
    flat = torch.zeros(5, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.tensor(1.0, device=device)
    mops.fp8_quantize_((x,), iter([scale]), (1,), flat, [amax])
    smallest = torch.tensor(1e-3).to(flat.dtype).item()  # rounds to the subnormal 2**-9
    assert flat.float().tolist() == [0.0, 0.5, -448.0, 3.0, smallest]
    assert amax.item() == 600.0
