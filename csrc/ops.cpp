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
// single-segment pack_ calls behind their own argument checks. A third,
// fp8_quantize_, is the FP8 refresh of a flat group of main-weight shards: its
// segments carry a scale and an amax slot each (mfsdp/fp8_quantize.h), and its
// kernels are cpu/fp8_quantize_cpu.cpp and cuda/fp8_quantize_cuda.cu.
//
// Conventions: in-place ops end in `_`, mark every mutated tensor `Tensor(a!)`
// and return `()`. Scales are `float` (double in C++) and are applied in fp32
// "opmath" (fp64 when either side is float64).
#include <torch/library.h>

#include <vector>

#include "mfsdp/backend.h"
#include "mfsdp/checks.h"
#include "mfsdp/fp8_quantize.h"

namespace mfsdp {

TORCH_LIBRARY(megatron_fsdp_v2, m) {
  // flat[offsets[i] : offsets[i] + inputs[i].numel()] (=|+=) scale * inputs[i].flatten()
  m.def(
      "pack_(Tensor[] inputs, int[] offsets, Tensor(a!) flat, *, float scale=1.0, "
      "bool accumulate=False) -> ()");
  // sum_i sum(tensors[i].float() ** 2) as a 0-dim float32 tensor (non-empty list)
  m.def("multi_tensor_sum_of_squares(Tensor[] tensors) -> Tensor");
  // For each i, with v = inputs[i].flatten().float() * scales[i] (one fp32 rounding)
  // and max = the largest finite value of flat.dtype (448 e4m3fn, 57344 e5m2):
  //   flat[offsets[i] : offsets[i] + inputs[i].numel()] = v.clamp(-max, max).to(flat.dtype)
  //   amaxes[i] = inputs[i].abs().amax() as fp32, 0 for an empty input
  // in one pass over the input: torch's saturated cast bit for bit (a NaN stays NaN,
  // +-inf saturate to +-max; the amax is NaN when the input has one). inputs: one of
  // float32 / float16 / bfloat16; flat: float8_e4m3fn or float8_e5m2; scales and
  // amaxes: one-element float32 tensors on flat's device (read / written on the
  // device, no host sync). An amax slot shared by several inputs gets the max over
  // them; amaxes must not overlap the inputs, scales or flat.
  m.def(
      "fp8_quantize_(Tensor[] inputs, Tensor[] scales, int[] offsets, Tensor(a!) flat, "
      "Tensor(b!)[] amaxes) -> ()");
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

template <const Fp8Backend& kBackend>
void fp8_quantize_(at::TensorList inputs, at::TensorList scales, at::IntArrayRef offsets,
                   const at::Tensor& flat, at::TensorList amaxes) {
  check_fp8_quantize(inputs, scales, offsets, flat, amaxes, "fp8_quantize_");
  TORCH_INTERNAL_ASSERT(flat.device().type() == kBackend.device_type);
  if (inputs.empty()) return;
  // Empty inputs stay in the list: their amax slots are written too.
  std::vector<QuantizeSegment> segments;
  segments.reserve(inputs.size());
  uint8_t* base = static_cast<uint8_t*>(flat.data_ptr());
  for (size_t i = 0; i < inputs.size(); ++i) {
    segments.push_back({inputs[i].const_data_ptr(), base + offsets[i], inputs[i].numel(),
                        scales[i].const_data_ptr<float>(), amaxes[i].data_ptr<float>()});
  }
  kBackend.quantize(flat.device(), segments, inputs[0].scalar_type(), flat.scalar_type());
}

template <const Fp8Backend& kBackend>
void register_fp8_kernels(torch::Library& m) {
  m.impl("fp8_quantize_", &fp8_quantize_<kBackend>);
}

template <const Backend& kBackend>
void register_kernels(torch::Library& m) {
  m.impl("pack_", &pack_<kBackend>);
  m.impl("multi_tensor_sum_of_squares", &multi_tensor_sum_of_squares<kBackend>);
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_fsdp_v2, CPU, m) {
  register_kernels<kCpuBackend>(m);
  register_fp8_kernels<kCpuFp8Backend>(m);
}

#ifdef MFSDP_WITH_CUDA
TORCH_LIBRARY_IMPL(megatron_fsdp_v2, CUDA, m) {
  register_kernels<kCudaBackend>(m);
  register_fp8_kernels<kCudaFp8Backend>(m);
}
#endif

}  // namespace mfsdp
