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

CUDA variants carry the ``gpu`` marker and skip without a CUDA device.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys

import pytest
import torch

import megatron_fsdp_v2.ops as mops
from megatron_fsdp_v2.ops import _reference as ref

needs_ext = pytest.mark.skipif(not mops.HAS_EXTENSION, reason="megatron_fsdp_v2._C is not built")
pytestmark = needs_ext

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


@pytest.fixture
def use_kernels(monkeypatch):
    """The public wrappers call the C++/CUDA kernels, whatever MFSDP_USE_REFERENCE_OPS says."""
    monkeypatch.setattr(mops, "_impl", _ops())


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


# ----------------------------------------------------------------------------
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
# CUDA-only behavior
# ----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("accumulate", [False, True])
def test_cuda_many_segments_split_launches(accumulate):
    """More tensors than one launch's segment table holds (768): still correct."""
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 300, (1500,), generator=g).tolist()
    inputs = [torch.randn(n, device="cuda") for n in sizes]
    offsets = list(itertools.accumulate([0] + [n + 1 for n in sizes[:-1]]))
    flat = torch.randn(offsets[-1] + sizes[-1], device="cuda", dtype=torch.bfloat16)
    expected = flat.clone()
    ref.pack_(inputs, offsets, expected, scale=0.3, accumulate=accumulate)
    _ops().pack_(inputs, offsets, flat, scale=0.3, accumulate=accumulate)
    assert_bitwise_equal(flat, expected)
    torch.testing.assert_close(
        _ops().multi_tensor_sum_of_squares(inputs),
        ref.multi_tensor_sum_of_squares(inputs), rtol=1e-5, atol=0,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_current_stream_and_graph_capture():
    """Kernels launch on the current stream: a CUDA graph capture (which fails on any
    launch to another stream) records them, and replay re-reads the mutated inputs."""
    offsets, total = _layout()
    inputs = [_randn(s, torch.float32, "cuda", seed=i) for i, s in enumerate(SHAPES)]
    flat = torch.zeros(total, device="cuda", dtype=torch.bfloat16)
    shard = torch.randn(1 << 20, device="cuda")
    weight = torch.zeros(1 << 20, device="cuda", dtype=torch.bfloat16)

    def step():
        mops.refresh_from_shard_(shard, weight, 0)
        mops.pack_(inputs, offsets, flat, scale=0.5)
        return mops.multi_tensor_sum_of_squares(inputs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up off the default stream, as CUDA graph capture recommends
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        total_sq = step()

    for t in [shard, *inputs]:
        t.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(weight, shard.bfloat16())
    expected = torch.zeros_like(flat)
    ref.pack_(inputs, offsets, expected, scale=0.5)
    assert_bitwise_equal(flat, expected)
    torch.testing.assert_close(total_sq, ref.multi_tensor_sum_of_squares(inputs), rtol=1e-5, atol=0)


# ----------------------------------------------------------------------------
# Dispatcher integration: opcheck, torch.compile
# ----------------------------------------------------------------------------


def _opcheck_cases(device):
    offsets, total = _layout()
    inputs = [_randn(s, torch.float32, device, seed=i) for i, s in enumerate(SHAPES)]
    flat = _randn((total,), torch.bfloat16, device, seed=7)
    vec32 = _randn((64,), torch.float32, device, seed=8)
    weight = _randn((200,), torch.bfloat16, device, seed=10)
    return {
        "pack_list": ("pack_", (inputs, offsets, flat), {"scale": 0.5, "accumulate": True}),
        # the shape of refresh_from_shard_ / reduce-scatter copy-in and copy-out
        "pack_one_segment": ("pack_", ([vec32], [100], weight), {"scale": 0.25}),
        "multi_tensor_sum_of_squares": ("multi_tensor_sum_of_squares", ([vec32, vec32[:7]],), {}),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(_opcheck_cases("cpu")))
def test_opcheck(device, case):
    name, args, kwargs = _opcheck_cases(device)[case]
    torch.library.opcheck(getattr(_ops(), name).default, args, kwargs)


def test_op_library_schemas():
    """pack_ is the only mutating op and writes only `flat`; every op name the CPU-only
    fallback registers (ops._load._OP_NAMES) exists."""
    from megatron_fsdp_v2.ops import _load

    for name in _load._OP_NAMES:
        assert hasattr(_ops(), name), name
    schema = _ops().pack_.default._schema
    written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    assert written == ["flat"] and len(schema.returns) == 0


def test_torch_compile_fullgraph_smoke():
    def step(shard, weight, grads, grad_flat):
        mops.refresh_from_shard_(shard, weight, 8)
        mops.pack_(grads, [0, 20], grad_flat, scale=0.5, accumulate=True)
        return mops.multi_tensor_sum_of_squares([grad_flat])

    shard, weight = torch.randn(8), torch.zeros(16, dtype=torch.bfloat16)
    grads, grad_flat = [torch.randn(4, 5), torch.randn(7)], torch.ones(27)
    expected_weight, expected_flat = weight.clone(), grad_flat.clone()
    ref.pack_([shard], [8], expected_weight)
    ref.pack_(grads, [0, 20], expected_flat, scale=0.5, accumulate=True)

    torch._dynamo.reset()
    # Inductor on CPU: ~5 s here; the fake kernels and auto-functionalization are what
    # is being tested, the generated wrapper just calls the ops.
    out = torch.compile(step, fullgraph=True)(shard, weight, grads, grad_flat)
    assert_bitwise_equal(weight, expected_weight)
    assert_bitwise_equal(grad_flat, expected_flat)
    torch.testing.assert_close(out, expected_flat.square().sum(), rtol=1e-5, atol=0)


# ----------------------------------------------------------------------------
# Bad input: clear errors from both the kernels and the reference
# ----------------------------------------------------------------------------

IMPLS = [pytest.param("kernel", id="kernel"), pytest.param("reference", id="reference")]


def _impl(kind):
    return _ops() if kind == "kernel" else ref


def _z(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


def _err(id_, *values):
    return pytest.param(*values, id=id_)


BF16, I32, I64 = torch.bfloat16, torch.int32, torch.int64

# (pack_ args, message regex)
PACK_ERRORS = [
    _err("flat_noncontiguous", ([_z(5)], [0], _z(40)[::2]), r"`flat` must be contiguous"),
    _err("flat_not_1d", ([_z(5)], [0], _z(4, 10)), r"`flat` must be a 1-D flat buffer"),
    _err(
        "offset_out_of_range",
        ([_z(5), _z(10)], [0, 15], _z(20)),
        r"offsets\[1\] out of range: inputs\[1\] at offset 15 with numel 10 needs elements "
        r"\[15, 25\) but `flat` has numel 20",
    ),
    _err("negative_offset", ([_z(5)], [-1], _z(20)), r"offsets\[0\] out of range"),
    _err(
        "length_mismatch",
        ([_z(5), _z(5)], [0], _z(20)),
        r"list length mismatch: got 2 tensors in `inputs` but 1 `offsets`",
    ),
    _err(
        "dtype_mismatch",
        ([_z(5), _z(5, dtype=BF16)], [0, 5], _z(20)),
        r"dtype mismatch in `inputs`: inputs\[0\] is .* but inputs\[1\] is",
    ),
    _err("input_noncontiguous", ([_z(4, 4).t()], [0], _z(20)), r"`inputs\[0\]` must be contiguous"),
    _err("int_flat", ([_z(5)], [0], _z(20, dtype=I32)), r"unsupported dtype .* for `flat`"),
    _err(
        "device_mismatch",
        ([_z(5, device="meta")], [0], _z(20)),
        r"device mismatch: `inputs\[0\]` is on meta but `flat` is on cpu",
    ),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("args, message", PACK_ERRORS)
def test_pack_errors(impl, args, message):
    with pytest.raises(RuntimeError, match=message):
        _impl(impl).pack_(*args)


def test_device_mismatch_in_cpu_kernel():
    """The CPU kernel's own check (the dispatcher would route meta inputs to the fake kernel)."""
    cpu_only = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    meta = _z(5, device="meta")
    with pytest.raises(RuntimeError, match=r"`inputs\[0\]` is on meta but `flat` is on cpu"):
        _ops().pack_.default.redispatch(cpu_only, [meta], [0], _z(20))
    with pytest.raises(RuntimeError, match=r"`tensors\[1\]` is on meta but `tensors\[0\]`"):
        _ops().multi_tensor_sum_of_squares.default.redispatch(cpu_only, [_z(5), meta])


# (public wrapper, args, message regex); the wrappers built on pack_ name themselves
OTHER_ERRORS = [
    _err("refresh_range", "refresh_from_shard_", (_z(8), _z(16), 9),
         r"shard_offset out of range: `main_weight_shard` at shard_offset 9 with numel 8"),
    _err("refresh_2d", "refresh_from_shard_", (_z(8), _z(4, 4), 0),
         r"`model_weight` must be a 1-D flat buffer"),
    _err("refresh_noncontiguous", "refresh_from_shard_", (_z(16)[::2], _z(16), 0),
         r"`main_weight_shard` must be contiguous"),
    _err("rs_in_numel", "reduce_scatter_copy_in_", (_z(8), _z(9)),
         r"numel mismatch: `grad` has 8 elements but `reduce_scatter_input` has 9"),
    _err("rs_in_dtype", "reduce_scatter_copy_in_", (_z(8, dtype=I64), _z(8)),
         r"unsupported dtype .* for `grad`"),
    _err("rs_out_numel", "reduce_scatter_copy_out_", (_z(8), _z(7)),
         r"numel mismatch: `reduced_shard` has 8 elements but `main_grad_shard` has 7"),
    _err("rs_out_noncontiguous", "reduce_scatter_copy_out_", (_z(8), _z(16)[::2]),
         r"`main_grad_shard` must be contiguous"),
    _err("sumsq_dtype", "multi_tensor_sum_of_squares", ([_z(3), _z(3, dtype=BF16)],),
         r"dtype mismatch in `tensors`"),
    _err("sumsq_device", "multi_tensor_sum_of_squares", ([_z(3), _z(3, device="meta")],),
         r"device mismatch: `tensors\[1\]` is on meta"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name, args, message", OTHER_ERRORS)
def test_other_errors(monkeypatch, impl, name, args, message):
    monkeypatch.setattr(mops, "_impl", _impl(impl))
    with pytest.raises(RuntimeError, match=message):
        getattr(mops, name)(*args)


# ----------------------------------------------------------------------------
# Build / loading
# ----------------------------------------------------------------------------


def test_build_info():
    info = mops.build_info()
    assert set(info) == {"torch_built", "torch_runtime", "cuda_built", "cpu_kernels",
                         "cuda_kernels", "extension"}
    assert info["extension"] is True and info["cpu_kernels"] is True
    assert info["torch_built"] == info["torch_runtime"] == str(torch.__version__)
    cuda_toolchain = torch.version.cuda is not None and shutil.which("nvcc") is not None
    if cuda_toolchain and os.environ.get("MFSDP_FORCE_CPU", "0") != "1":
        assert info["cuda_kernels"] is True, info
        assert info["cuda_built"] is not None
    if not info["cuda_kernels"]:
        assert info["cuda_built"] is None


def test_reference_ops_env_var():
    code = (
        "import megatron_fsdp_v2.ops as o; from megatron_fsdp_v2.ops import _reference as r; "
        "assert o.USE_REFERENCE_OPS and o._impl is r, o._impl"
    )
    env = dict(os.environ, MFSDP_USE_REFERENCE_OPS="1")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_stale_build_raises_one_clear_import_error():
    code = (
        "import torch; torch.__version__ = '0.0.1'\n"
        "try:\n    import megatron_fsdp_v2.ops\n"
        "except ImportError as e:\n    print(e)\nelse:\n    raise SystemExit('no ImportError')"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                         capture_output=True, text=True).stdout
    assert "built against torch" in out and "0.0.1" in out
    assert "pip install --no-build-isolation -e ." in out

