"""Flat-buffer kernels: bad input (clear errors from both the kernels and the reference) and the
build / loading of the extension.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from _flat_buffer import (
    _ops,
    needs_ext,
)

import megatron_fsdp_v2.ops as mops
from megatron_fsdp_v2.ops import _reference as ref

pytestmark = needs_ext


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


def test_reference_ops_env_var(fresh_python):
    code = (
        "import megatron_fsdp_v2.ops as o; from megatron_fsdp_v2.ops import _reference as r; "
        "assert o.USE_REFERENCE_OPS and o._impl is r, o._impl"
    )
    env = dict(os.environ, MFSDP_USE_REFERENCE_OPS="1")
    fresh_python.run(code, env=env)


def test_stale_build_raises_one_clear_import_error(fresh_python):
    code = (
        "import torch; torch.__version__ = '0.0.1'\n"
        "try:\n    import megatron_fsdp_v2.ops\n"
        "except ImportError as e:\n    print(e)\nelse:\n    raise SystemExit('no ImportError')"
    )
    out = fresh_python.run(code).stdout
    assert "built against torch" in out and "0.0.1" in out
    assert "pip install --no-build-isolation -e ." in out
