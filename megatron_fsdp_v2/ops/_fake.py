"""Fake (meta) kernels for every ``megatron_fsdp_v2`` op.

``torch.compile`` traces custom ops with FakeTensors: each op needs a kernel that
checks metadata and produces output metadata without touching data. ``pack_``
and ``fp8_quantize_`` return nothing, so their fake kernels only validate (with the
same messages as the C++ checks, so errors surface at trace time). ``register_fake`` also serves the
Meta device. Imported by ``megatron_fsdp_v2.ops`` only when the extension (and
therefore the op schemas) is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_fsdp_v2.ops._checks import (
    check_fp8_quantize,
    check_list_and_flat,
    check_tensor_list,
)


@torch.library.register_fake("megatron_fsdp_v2::pack_")
def _pack_fake(inputs: Sequence[Tensor], offsets: Sequence[int], flat: Tensor, *,
               scale: float = 1.0, accumulate: bool = False) -> None:
    check_list_and_flat(inputs, "inputs", offsets, flat, "flat", "pack_")


@torch.library.register_fake("megatron_fsdp_v2::multi_tensor_sum_of_squares")
def _multi_tensor_sum_of_squares_fake(tensors: Sequence[Tensor]) -> Tensor:
    check_tensor_list(tensors, "tensors", "multi_tensor_sum_of_squares")
    return tensors[0].new_empty((), dtype=torch.float32)


@torch.library.register_fake("megatron_fsdp_v2::fp8_quantize_")
def _fp8_quantize_fake(inputs: Sequence[Tensor], scales: Sequence[Tensor], offsets: Sequence[int],
                       flat: Tensor, amaxes: Sequence[Tensor]) -> None:
    check_fp8_quantize(inputs, scales, offsets, flat, amaxes, "fp8_quantize_")
