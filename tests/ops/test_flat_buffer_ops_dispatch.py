"""Flat-buffer kernels beyond the values: CUDA-only behavior (the ``gpu`` marker, skipped without
a CUDA device) and dispatcher integration (opcheck, schemas, ``torch.compile``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from _flat_buffer import (
    DEVICES,
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
