"""fp8_quantize_ (torch.ops.megatron_fsdp_v2) against torch's saturated FP8 cast.

The contract is torch's own expression, ``(x.float() * scale).clamp(-max, max).to(fp8)``
with ``max = torch.finfo(fp8).max``, and ``x.abs().amax()``; every test compares the
kernel's bytes with it through ``.view(torch.uint8)``, NaN bytes included, and the amax
exactly (NaN where torch's is NaN). The reference op (``_reference.fp8_quantize_``) is
checked against the same expression. Inputs cover both formats, float32 / bfloat16 /
float16, inf / NaN of both signs, fp32 and fp8 subnormals, every rounding tie of the
fp8 grid and its neighbours, every 16-bit input, a sample of every fp32 exponent and
top mantissa bits, empty and odd-length inputs, gaps between slots (left untouched),
several segments, shared scale and amax slots, and non-unit scales.

CUDA variants carry the ``gpu`` marker and skip without a CUDA device.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import megatron_fsdp_v2.ops as mops
from megatron_fsdp_v2.ops import _reference as ref

pytestmark = pytest.mark.skipif(not mops.HAS_EXTENSION, reason="megatron_fsdp_v2._C is not built")

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


@pytest.fixture
def use_kernels(monkeypatch):
    """The public wrapper calls the C++/CUDA kernels, whatever MFSDP_USE_REFERENCE_OPS says."""
    monkeypatch.setattr(mops, "_impl", _ops())


@pytest.fixture
def four_threads():
    """Several CPU threads, so one segment is split across threads (the amax combine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


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


# ----------------------------------------------------------------------------
# CUDA-only behavior
# ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_many_segments_split_launches():
    """More inputs than one launch's table holds (512), misaligned slots, and one amax slot
    shared by inputs of different tables (all slots are zeroed before any table runs)."""
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(0, 3000, (1300,), generator=g).tolist()
    inputs = [_spread((n,), torch.bfloat16, "cuda", seed=i) for i, n in enumerate(sizes)]
    offsets = list(itertools.accumulate([1] + [n + 1 for n in sizes[:-1]]))
    scales = [torch.tensor(0.3 + i % 5, device="cuda") for i in range(len(sizes))]
    flat = _garbage_fp8(offsets[-1] + sizes[-1], torch.float8_e4m3fn, "cuda")
    _run_and_check(_ops(), inputs, scales, offsets, flat, torch.float8_e4m3fn)
    # One slot for the first and last input, 1000 positions apart (different tables).
    shared = torch.full((), -1.0, device="cuda")
    ends = [inputs[0], inputs[-1]]
    padding = [torch.empty(0, device="cuda")] * 1000
    slots = [shared, *[torch.empty((), device="cuda") for _ in padding], shared]
    _ops().fp8_quantize_([ends[0], *padding, ends[1]], [scales[0]] * 1002,
                         [0, *[0] * 1000, flat.numel() - sizes[-1]], flat, slots)
    assert_amax_equal(shared, torch.maximum(torch_amax(ends[0]), torch_amax(ends[1])))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_capture_reads_scale_on_device():
    """Launches go to the current stream (graph capture fails otherwise) and the scale is
    read on the device at replay: a new scale value changes the replayed result."""
    shard = torch.randn(1 << 20, device="cuda")
    scale = torch.tensor(1.0, device="cuda")
    amax = torch.zeros((), device="cuda")
    flat = torch.zeros(shard.numel(), dtype=torch.float8_e4m3fn, device="cuda")

    def step():
        mops.fp8_quantize_([shard], [scale], [0], flat, [amax])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    shard.normal_()
    scale.fill_(37.0)
    graph.replay()
    torch.cuda.synchronize()
    assert_bytes_equal(flat, torch_quantize(shard, scale, torch.float8_e4m3fn))
    assert_amax_equal(amax, torch_amax(shard))


# ----------------------------------------------------------------------------
# Dispatcher integration: opcheck, schema, torch.compile
# ----------------------------------------------------------------------------


def _opcheck_args(device):
    inputs = [_spread((5, 7), torch.float32, device, seed=1),
              _spread((11,), torch.float32, device, seed=2)]
    scales = [torch.tensor(0.5, device=device), torch.tensor([4.0], device=device)]
    amaxes = [torch.zeros((), device=device), torch.zeros(1, device=device)]
    flat = torch.zeros(50, dtype=torch.float8_e4m3fn, device=device)
    return (inputs, scales, [2, 38], flat, amaxes)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    """Fake kernel, autograd registration and functionalization. opcheck's test_schema
    cannot run here: its SchemaCheckMode compares tensors with allclose, which torch does
    not implement for float8; test_schema_mutates_flat_and_amaxes_only does its job."""
    torch.library.opcheck(
        _ops().fp8_quantize_.default, _opcheck_args(device),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_schema_mutates_flat_and_amaxes_only(device):
    """The schema declares flat and amaxes written and returns nothing, and the kernel
    leaves every other argument as it was, byte for byte."""
    schema = _ops().fp8_quantize_.default._schema
    written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    assert written == ["flat", "amaxes"] and len(schema.returns) == 0
    inputs, scales, offsets, flat, amaxes = _opcheck_args(device)
    before = [t.clone() for t in [*inputs, *scales]]
    _ops().fp8_quantize_(inputs, scales, offsets, flat, amaxes)
    for old, new in zip(before, [*inputs, *scales]):
        assert_bytes_equal(new, old)


def test_torch_compile_fullgraph_smoke():
    def refresh(shards, scales, flat, amaxes):
        mops.fp8_quantize_(shards, scales, [0, 12], flat, amaxes)
        return torch.stack(amaxes).amax()

    shards = [torch.randn(3, 4) * 50, torch.randn(5)]
    scales = [torch.tensor(2.0), torch.tensor(0.25)]
    flat = torch.zeros(17, dtype=torch.float8_e4m3fn)
    amaxes = [torch.zeros(()), torch.zeros(())]
    expected = torch.cat([torch_quantize(s, sc, flat.dtype) for s, sc in zip(shards, scales)])
    torch._dynamo.reset()
    out = torch.compile(refresh, fullgraph=True)(shards, scales, flat, amaxes)
    assert_bytes_equal(flat, expected)
    assert out.item() == max(torch_amax(s).item() for s in shards)


# ----------------------------------------------------------------------------
# Bad input: one clear error from the kernels and the reference alike
# ----------------------------------------------------------------------------


def _z(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


def _f8(n):
    return _z(n, dtype=torch.float8_e4m3fn)


def _s():
    return _z()


def _err(id_, args, message):
    return pytest.param(args, message, id=id_)


# (fp8_quantize_ args: inputs, scales, offsets, flat, amaxes; message regex)
ERRORS = [
    _err("flat_not_fp8", ([_z(4)], [_s()], [0], _z(8, dtype=torch.bfloat16), [_s()]),
         r"fp8_quantize_: unsupported dtype .* for `flat`; expected float8_e4m3fn or float8_e5m2"),
    _err("flat_2d", ([_z(4)], [_s()], [0], _z(2, 4, dtype=torch.float8_e5m2), [_s()]),
         r"`flat` must be a 1-D flat buffer, got a 2-D tensor"),
    _err("flat_noncontiguous", ([_z(4)], [_s()], [0], _f8(16)[::2], [_s()]),
         r"`flat` must be contiguous"),
    _err("length_mismatch", ([_z(4), _z(4)], [_s()], [0, 4], _f8(8), [_s(), _s()]),
         r"list length mismatch: got 2 tensors in `inputs`, 1 `scales`, 2 `offsets` and 2 "
         r"`amaxes`; expected one of each per input"),
    _err("input_float64", ([_z(4, dtype=torch.float64)], [_s()], [0], _f8(8), [_s()]),
         r"unsupported dtype .* for `inputs\[0\]`; expected float32, float16 or bfloat16"),
    _err("input_dtype_mismatch",
         ([_z(4), _z(4, dtype=torch.bfloat16)], [_s(), _s()], [0, 4], _f8(8), [_s(), _s()]),
         r"dtype mismatch in `inputs`: inputs\[0\] is .* but inputs\[1\] is"),
    _err("input_noncontiguous", ([_z(4, 4).t()], [_s()], [0], _f8(16), [_s()]),
         r"`inputs\[0\]` must be contiguous"),
    _err("offset_out_of_range", ([_z(4), _z(5)], [_s(), _s()], [0, 4], _f8(8), [_s(), _s()]),
         r"offsets\[1\] out of range: inputs\[1\] at offset 4 with numel 5 needs elements "
         r"\[4, 9\) but `flat` has numel 8"),
    _err("negative_offset", ([_z(4)], [_s()], [-1], _f8(8), [_s()]),
         r"offsets\[0\] out of range"),
    _err("scale_float64", ([_z(4)], [_z(dtype=torch.float64)], [0], _f8(8), [_s()]),
         r"`scales\[0\]` must be a float32 tensor with one element \(0-dim or shape \(1,\)\), "
         r"got .*"),
    _err("scale_two_elements", ([_z(4)], [_z(2)], [0], _f8(8), [_s()]),
         r"`scales\[0\]` must be a float32 tensor with one element"),
    _err("amax_bf16", ([_z(4)], [_s()], [0], _f8(8), [_z(1, dtype=torch.bfloat16)]),
         r"`amaxes\[0\]` must be a float32 tensor with one element"),
    _err("input_device", ([_z(4, device="meta")], [_s()], [0], _f8(8), [_s()]),
         r"device mismatch: `inputs\[0\]` is on meta but `flat` is on cpu"),
    _err("scale_device", ([_z(4)], [_z(device="meta")], [0], _f8(8), [_s()]),
         r"device mismatch: `scales\[0\]` is on meta but `flat` is on cpu"),
    _err("amax_device", ([_z(4)], [_s()], [0], _f8(8), [_z(device="meta")]),
         r"device mismatch: `amaxes\[0\]` is on meta but `flat` is on cpu"),
]


@pytest.mark.parametrize("impl", ["kernel", "reference"])
@pytest.mark.parametrize("args, message", ERRORS)
def test_errors(impl, args, message):
    impl_ops = _ops() if impl == "kernel" else ref
    with pytest.raises(RuntimeError, match=message):
        impl_ops.fp8_quantize_(*args)
    if impl == "kernel":
        # the CPU kernel's own front end (the dispatcher sends meta tensors to the fake)
        cpu_only = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
        with pytest.raises(RuntimeError, match=message):
            _ops().fp8_quantize_.default.redispatch(cpu_only, *args)
