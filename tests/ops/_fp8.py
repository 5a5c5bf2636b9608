"""What the ``test_fp8_quantize*`` files share: the devices, dtypes, scales and layouts swept,
torch's saturated FP8 cast and amax (the contract), inputs with specials, and the bytewise checks.

The contract is torch's own expression, ``(x.float() * scale).clamp(-max, max).to(fp8)``
with ``max = torch.finfo(fp8).max``, and ``x.abs().amax()``; every test compares the
kernel's bytes with it through ``.view(torch.uint8)``, NaN bytes included, and the amax
exactly (NaN where torch's is NaN).
"""

from __future__ import annotations

import pytest
import torch

FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3fn"), pytest.param(torch.float8_e5m2, id="e5m2")]
SRC = [
    pytest.param(torch.float32, id="f32"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="f16"),
]
# 0.37 is not a power of two (the multiply rounds); 2**-7 moves values into the fp8
# subnormals; 1000 pushes most of them past max (saturation).
SCALES = [pytest.param(s, id=f"scale{s:g}") for s in (1.0, 0.37, 2.0**-7, 1000.0)]
# Sizes 0 and 1, odd lengths, a 3-D one, one past a 32-element SIMD step; PADS leave
# gaps (and odd byte offsets) between the slots, which must stay untouched.
SHAPES = [(0,), (1,), (17, 257), (7, 15), (3, 5, 2), (33,), (1000,)]
PADS = [0, 3, 8, 1, 5, 2, 7]


def _ops():
    return torch.ops.megatron_fsdp_v2


def torch_quantize(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """The contract: torch's saturated cast (torchao's float8 weight cast)."""
    max_finite = torch.finfo(fp8).max
    return (x.reshape(-1).float() * scale).clamp(-max_finite, max_finite).to(fp8)


def torch_amax(x: torch.Tensor) -> torch.Tensor:
    """torch's amax of |x| in fp32; 0 for an empty tensor (torch's amax refuses those)."""
    if x.numel() == 0:
        return torch.zeros((), device=x.device)
    return x.abs().amax().float()


def _layout(shapes=SHAPES, pads=PADS):
    offsets, cursor = [], 0
    for shape, pad in zip(shapes, pads):
        offsets.append(cursor)
        cursor += int(torch.Size(shape).numel()) + pad
    return offsets, cursor


def _garbage_fp8(numel: int, fp8: torch.dtype, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, 256, (numel,), generator=g, dtype=torch.uint8).view(fp8).to(device)


def _spread(shape, dtype, device, seed):
    """Normal values times 10**U(-7, 4): fp8 subnormals to far past max."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * torch.pow(10.0, torch.empty(shape, dtype=torch.float64).uniform_(-7, 4, generator=g))
    return x.to(dtype).to(device)


SPECIALS = [float("inf"), -float("inf"), float("nan"), -float("nan"), 0.0, -0.0, 1e-40, -3e-39,
            448.0, 464.0, -480.0, 57344.0, 61440.0, 65504.0, 1e30]


def _with_specials(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1)
    n = min(len(SPECIALS), flat.numel())
    flat[:n] = torch.tensor(SPECIALS[:n], dtype=torch.float32).to(x.dtype)
    return x


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a = actual.detach().reshape(-1).cpu().view(torch.uint8)
    e = expected.detach().reshape(-1).cpu().view(torch.uint8)
    if not torch.equal(a, e):
        bad = (a != e).nonzero().reshape(-1)
        first = bad[:5].tolist()
        raise AssertionError(f"{bad.numel()} bytes differ, first at {first}: got "
                             f"{[hex(v) for v in a[first].tolist()]}, expected "
                             f"{[hex(v) for v in e[first].tolist()]}")


def assert_amax_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual.reshape(()).cpu(), expected.reshape(()).float().cpu(),
                               rtol=0, atol=0, equal_nan=True)


def _run_and_check(impl, inputs, scales, offsets, flat, fp8) -> list[torch.Tensor]:
    """Runs `impl` on garbage-filled outputs and checks flat and amaxes against torch."""
    device = flat.device
    amaxes = [torch.full((1,) if i % 2 else (), -7.0, device=device) for i in range(len(inputs))]
    expected = flat.clone()
    for x, s, off in zip(inputs, scales, offsets):
        expected[off:off + x.numel()] = torch_quantize(x, s, fp8)
    impl.fp8_quantize_(inputs, scales, offsets, flat, amaxes)
    assert_bytes_equal(flat, expected)
    for x, amax in zip(inputs, amaxes):
        assert_amax_equal(amax, torch_amax(x))
    return amaxes
