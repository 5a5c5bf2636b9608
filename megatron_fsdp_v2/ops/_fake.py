"""Fake (meta) kernels for every ``megatron_fsdp_v2`` op.

``torch.compile`` traces custom ops with FakeTensors: each op needs a kernel that
checks metadata and produces output metadata without touching data. The mutating
ops return nothing, so their fake kernels only validate (with the same messages
as the C++ checks, so errors surface at trace time). ``register_fake`` also
serves the Meta device. Imported by ``megatron_fsdp_v2.ops`` only when the
extension (and therefore the op schemas) is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_fsdp_v2.ops import _reference as ref


@torch.library.register_fake("megatron_fsdp_v2::pack_")
def _pack_fake(inputs: Sequence[Tensor], offsets: Sequence[int], flat: Tensor, *,
               scale: float = 1.0, accumulate: bool = False) -> None:
    ref.check_list_and_flat(inputs, "inputs", offsets, flat, "flat", "pack_")


@torch.library.register_fake("megatron_fsdp_v2::unpack_")
def _unpack_fake(flat: Tensor, offsets: Sequence[int], outputs: Sequence[Tensor], *,
                 scale: float = 1.0, accumulate: bool = False) -> None:
    ref.check_list_and_flat(outputs, "outputs", offsets, flat, "flat", "unpack_")


@torch.library.register_fake("megatron_fsdp_v2::refresh_from_shard_")
def _refresh_from_shard_fake(main_weight_shard: Tensor, model_weight: Tensor,
                             shard_offset: int) -> None:
    op = "refresh_from_shard_"
    ref.check_pair(main_weight_shard, "main_weight_shard", model_weight, "model_weight", op)
    ref.check_range(main_weight_shard, "main_weight_shard", model_weight, "model_weight",
                    shard_offset, "shard_offset", op)


@torch.library.register_fake("megatron_fsdp_v2::reduce_scatter_copy_in_")
def _reduce_scatter_copy_in_fake(grad: Tensor, reduce_scatter_input: Tensor, *,
                                 pre_scale: float = 1.0) -> None:
    op = "reduce_scatter_copy_in_"
    ref.check_pair(grad, "grad", reduce_scatter_input, "reduce_scatter_input", op)
    ref.check_same_numel(grad, "grad", reduce_scatter_input, "reduce_scatter_input", op)


@torch.library.register_fake("megatron_fsdp_v2::reduce_scatter_copy_out_")
def _reduce_scatter_copy_out_fake(reduced_shard: Tensor, main_grad_shard: Tensor, *,
                                  post_scale: float = 1.0, accumulate: bool = False) -> None:
    op = "reduce_scatter_copy_out_"
    ref.check_pair(reduced_shard, "reduced_shard", main_grad_shard, "main_grad_shard", op)
    ref.check_same_numel(reduced_shard, "reduced_shard", main_grad_shard, "main_grad_shard", op)


@torch.library.register_fake("megatron_fsdp_v2::multi_tensor_sum_of_squares")
def _multi_tensor_sum_of_squares_fake(tensors: Sequence[Tensor]) -> Tensor:
    ref.check_tensor_list(tensors, "tensors", "multi_tensor_sum_of_squares")
    return tensors[0].new_empty((), dtype=torch.float32)
