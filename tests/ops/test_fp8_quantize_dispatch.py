"""fp8_quantize_ beyond the values: CUDA-only behavior (many segments, graph capture; the ``gpu``
marker, skipped without a CUDA device), dispatcher integration (opcheck, schema,
``torch.compile``) and bad input (one clear error from the kernels and the reference alike).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from _flat_buffer import DEVICES
from _fp8 import (
    _garbage_fp8,
    _ops,
    _run_and_check,
    _spread,
    assert_amax_equal,
    assert_bytes_equal,
    torch_amax,
    torch_quantize,
)

import megatron_fsdp_v2.ops as mops
from megatron_fsdp_v2.ops import _reference as ref

pytestmark = pytest.mark.skipif(not mops.HAS_EXTENSION, reason="megatron_fsdp_v2._C is not built")


# ----------------------------------------------------------------------------
# CUDA-only behavior
# ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_many_segments_split_launches():
    """More inputs than one launch's table holds (512) and misaligned slots."""
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(0, 3000, (1300,), generator=g).tolist()
    inputs = [_spread((n,), torch.bfloat16, "cuda", seed=i) for i, n in enumerate(sizes)]
    offsets = list(itertools.accumulate([1] + [n + 1 for n in sizes[:-1]]))
    scales = [torch.tensor(0.3 + i % 5, device="cuda") for i in range(len(sizes))]
    flat = _garbage_fp8(offsets[-1] + sizes[-1], torch.float8_e4m3fn, "cuda")
    _run_and_check(_ops(), inputs, scales, offsets, flat, torch.float8_e4m3fn)


@pytest.mark.parametrize("device", DEVICES)
def test_amax_slot_shared_by_inputs_1000_apart(device):
    """One amax slot for the first and the last of 1002 inputs, 1000 empty inputs between them:
    on CUDA they are in different launch tables (512 inputs each), and every slot is zeroed
    before any table runs, so the slot gets the max over both. The empty inputs share the
    others' dtype: one call takes one input dtype (``fp8_quantize_``'s contract; a float32
    tensor among bf16 ones is refused with a dtype mismatch on every device)."""
    first = _spread((2999,), torch.bfloat16, device, seed=1)
    last = _spread((1501,), torch.bfloat16, device, seed=2)
    padding = [torch.empty(0, dtype=first.dtype, device=device)] * 1000
    scale = torch.tensor(0.3, device=device)
    shared = torch.full((), -1.0, device=device)
    slots = [shared, *[torch.full((), -1.0, device=device) for _ in padding], shared]
    flat = _garbage_fp8(1 + first.numel() + last.numel(), torch.float8_e4m3fn, device)
    expected = flat.clone()
    expected[1:1 + first.numel()] = torch_quantize(first, scale, torch.float8_e4m3fn)
    expected[-last.numel():] = torch_quantize(last, scale, torch.float8_e4m3fn)
    _ops().fp8_quantize_([first, *padding, last], [scale] * 1002,
                         [1, *[0] * 1000, flat.numel() - last.numel()], flat, slots)
    assert_bytes_equal(flat, expected)
    assert_amax_equal(shared, torch.maximum(torch_amax(first), torch_amax(last)))
    assert all(slot.item() == 0.0 for slot in slots[1:-1])  # an empty input's amax is 0


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
