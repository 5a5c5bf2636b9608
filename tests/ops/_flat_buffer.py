"""What the ``test_flat_buffer_ops*`` files share: the devices, dtype pairs and modes swept, the
slot layouts (gaps between slots), random inputs, and the bitwise check.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import megatron_fsdp_v2.ops as mops

needs_ext = pytest.mark.skipif(not mops.HAS_EXTENSION, reason="megatron_fsdp_v2._C is not built")


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
DTYPE_PAIRS = [
    pytest.param(DTYPES[a], DTYPES[b], id=f"{a}->{b}") for a, b in itertools.product(DTYPES, DTYPES)
] + [
    pytest.param(torch.float64, torch.float32, id="f64->f32"),
    pytest.param(torch.float32, torch.float64, id="f32->f64"),
    pytest.param(torch.float64, torch.bfloat16, id="f64->bf16"),
]
# (scale, accumulate); 0.37 is not a power of two, so the multiply really rounds.
MODES = [
    pytest.param(1.0, False, id="copy"),
    pytest.param(0.37, False, id="scale"),
    pytest.param(1.0, True, id="acc"),
    pytest.param(0.37, True, id="scale_acc"),
]
# Sizes 0 and 1, odd 2-D shapes, a 3-D one; PADS leave gaps (and misalign starts)
# between tensors in the flat buffer, which must stay untouched.
SHAPES = [(0,), (1,), (17, 257), (7, 15), (3, 5, 2), (33,)]
PADS = [0, 3, 8, 1, 5, 2]


def _ops():
    return torch.ops.megatron_fsdp_v2


def _randn(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype=dtype, device=device)


def _layout(shapes=SHAPES, pads=PADS):
    offsets, cursor = [], 0
    for shape, pad in zip(shapes, pads):
        offsets.append(cursor)
        cursor += int(torch.Size(shape).numel()) + pad
    return offsets, cursor


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a = actual.detach().reshape(-1).cpu().view(torch.uint8)
    e = expected.detach().reshape(-1).cpu().view(torch.uint8)
    if not torch.equal(a, e):
        diff = (actual.double() - expected.double()).abs().max().item()
        raise AssertionError(f"not bitwise equal (max abs diff {diff})")
