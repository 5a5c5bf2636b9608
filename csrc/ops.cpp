// Every schema of the `megatron_fsdp_v2` op library, and nothing else.
//
// This block is the source of truth for the C++ API. Backend files only add
// TORCH_LIBRARY_IMPL blocks (cpu/flat_buffer_cpu.cpp, cuda/flat_buffer_cuda.cu);
// fake (meta) kernels for torch.compile live in megatron_fsdp_v2/ops/_fake.py.
//
// Conventions: in-place ops end in `_`, mark every mutated tensor `Tensor(a!)`
// (lists: `Tensor(a!)[]`) and return `()`. Scales are `float` (double in C++) and
// are applied in fp32 "opmath" (fp64 when either side is float64).
#include <torch/library.h>

TORCH_LIBRARY(megatron_fsdp_v2, m) {
  // flat[offsets[i] : offsets[i] + inputs[i].numel()] (=|+=) scale * inputs[i].flatten()
  m.def(
      "pack_(Tensor[] inputs, int[] offsets, Tensor(a!) flat, *, float scale=1.0, "
      "bool accumulate=False) -> ()");
  // outputs[i] (=|+=) scale * flat[offsets[i] : offsets[i] + numel].view_as(outputs[i])
  m.def(
      "unpack_(Tensor flat, int[] offsets, Tensor(a!)[] outputs, *, float scale=1.0, "
      "bool accumulate=False) -> ()");
  // model_weight[shard_offset : shard_offset + main_weight_shard.numel()] = main_weight_shard
  m.def(
      "refresh_from_shard_(Tensor main_weight_shard, Tensor(a!) model_weight, int shard_offset) "
      "-> ()");
  // reduce_scatter_input = pre_scale * grad
  m.def(
      "reduce_scatter_copy_in_(Tensor grad, Tensor(a!) reduce_scatter_input, *, "
      "float pre_scale=1.0) -> ()");
  // main_grad_shard (=|+=) post_scale * reduced_shard
  m.def(
      "reduce_scatter_copy_out_(Tensor reduced_shard, Tensor(a!) main_grad_shard, *, "
      "float post_scale=1.0, bool accumulate=False) -> ()");
  // sum_i sum(tensors[i].float() ** 2) as a 0-dim float32 tensor (non-empty list)
  m.def("multi_tensor_sum_of_squares(Tensor[] tensors) -> Tensor");
}
