// The `megatron_fsdp_v2` op library: every schema, the one front end, and the
// registration of each backend's kernels.
//
// The TORCH_LIBRARY block is the source of truth for the C++ API. The front end
// validates an op's arguments (mfsdp/checks.h) and turns them into a segment list,
// once for every backend; a backend (mfsdp/backend.h) only walks the list:
// cpu/flat_buffer_cpu.cpp and, in a CUDA build, cuda/flat_buffer_cuda.cu. Fake
// (meta) kernels for torch.compile live in megatron_fsdp_v2/ops/_fake.py.
//
// Two ops, because every flat-buffer copy of the runtime is a pack: the
// refresh and reduce-scatter copies of megatron_fsdp_v2/ops/__init__.py are
// single-segment pack_ calls behind their own argument checks.
//
// Conventions: in-place ops end in `_`, mark every mutated tensor `Tensor(a!)`
// and return `()`. Scales are `float` (double in C++) and are applied in fp32
// "opmath" (fp64 when either side is float64).
#include <torch/library.h>

#include <vector>

#include "mfsdp/backend.h"
#include "mfsdp/checks.h"

namespace mfsdp {

TORCH_LIBRARY(megatron_fsdp_v2, m) {
  // flat[offsets[i] : offsets[i] + inputs[i].numel()] (=|+=) scale * inputs[i].flatten()
  m.def(
      "pack_(Tensor[] inputs, int[] offsets, Tensor(a!) flat, *, float scale=1.0, "
      "bool accumulate=False) -> ()");
  // sum_i sum(tensors[i].float() ** 2) as a 0-dim float32 tensor (non-empty list)
  m.def("multi_tensor_sum_of_squares(Tensor[] tensors) -> Tensor");
}

namespace {

// tensors[i] -> flat[offsets[i] : offsets[i] + tensors[i].numel()], empty tensors
// dropped. Arguments must already be validated.
std::vector<Segment> segments_into_flat(at::TensorList tensors, at::IntArrayRef offsets,
                                        const at::Tensor& flat) {
  std::vector<Segment> segments;
  segments.reserve(tensors.size());
  char* base = static_cast<char*>(flat.data_ptr());
  const int64_t elem = flat.element_size();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel() == 0) continue;
    segments.push_back({tensors[i].const_data_ptr(), base + offsets[i] * elem, tensors[i].numel()});
  }
  return segments;
}

// Read-only segments over whole tensors (dst unused), for reductions.
std::vector<Segment> segments_of(at::TensorList tensors) {
  std::vector<Segment> segments;
  segments.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    if (t.numel() > 0) segments.push_back({t.const_data_ptr(), nullptr, t.numel()});
  }
  return segments;
}

template <const Backend& kBackend>
void pack_(at::TensorList inputs, at::IntArrayRef offsets, const at::Tensor& flat, double scale,
           bool accumulate) {
  check_list_and_flat(inputs, "inputs", offsets, flat, "flat", "pack_");
  TORCH_INTERNAL_ASSERT(flat.device().type() == kBackend.device_type);
  const std::vector<Segment> segments = segments_into_flat(inputs, offsets, flat);
  if (segments.empty()) return;
  kBackend.copy(flat.device(), segments, inputs[0].scalar_type(), flat.scalar_type(), scale,
                accumulate);
}

template <const Backend& kBackend>
at::Tensor multi_tensor_sum_of_squares(at::TensorList tensors) {
  check_tensor_list(tensors, "tensors", "multi_tensor_sum_of_squares");
  TORCH_INTERNAL_ASSERT(tensors[0].device().type() == kBackend.device_type);
  return kBackend.sum_of_squares(tensors[0].device(), segments_of(tensors),
                                 tensors[0].scalar_type());
}

template <const Backend& kBackend>
void register_kernels(torch::Library& m) {
  m.impl("pack_", &pack_<kBackend>);
  m.impl("multi_tensor_sum_of_squares", &multi_tensor_sum_of_squares<kBackend>);
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_fsdp_v2, CPU, m) { register_kernels<kCpuBackend>(m); }

#ifdef MFSDP_WITH_CUDA
TORCH_LIBRARY_IMPL(megatron_fsdp_v2, CUDA, m) { register_kernels<kCudaBackend>(m); }
#endif

}  // namespace mfsdp
