// What a backend implements for the FP8 quantize op (fp8_quantize_): one function
// over a list of quantize segments.
//
// The flat-buffer copies (mfsdp/backend.h) walk plain (src, dst, numel) segments with
// one scale for the whole call; a quantize segment also carries its own scale and
// amax slot, so one call (one CUDA launch per table of segments) quantizes a whole
// flat group of main-weight shards, each with its own per-tensor scale. The front
// end (csrc/ops.cpp) validates the arguments and builds the list once for every
// backend: cpu/fp8_quantize_cpu.cpp and, in a CUDA build, cuda/fp8_quantize_cuda.cu.
//
// Header-only and pybind11-free: included from .cpp and .cu files alike.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace mfsdp {

// One input tensor of fp8_quantize_. Unlike a Segment, `numel` may be 0: an empty
// input (a rank's empty shard of an unevenly sharded parameter) still has its amax
// slot written.
struct QuantizeSegment {
  const void* src;     // `numel` elements of the input dtype
  void* dst;           // `numel` fp8 bytes in the flat output
  int64_t numel;
  const float* scale;  // 1 fp32 element on the device, read by the kernel (no host sync)
  float* amax;         // 1 fp32 element on the device, written by the kernel
};

struct Fp8Backend {
  c10::DeviceType device_type;
  // Non-empty `segments` (some may have numel 0). For every element x of segment s,
  //   dst = F8(clamp(float(x) * scale_s, -max, max))        max = the fp8 format's largest finite
  // with one fp32 rounding at the multiply, a NaN-propagating clamp and c10's
  // round-to-nearest-even fp32 -> fp8 conversion; and, after the call,
  //   *amax_s = max over the segments t with amax_t == amax_s of max|x| (fp32; 0 when empty;
  //             NaN when any x is NaN).
  // src_dtype: float32, float16 or bfloat16; fp8_dtype: Float8_e4m3fn or Float8_e5m2.
  void (*quantize)(at::Device device, const std::vector<QuantizeSegment>& segments,
                   at::ScalarType src_dtype, at::ScalarType fp8_dtype);
};

extern const Fp8Backend kCpuFp8Backend;  // cpu/fp8_quantize_cpu.cpp
#ifdef MFSDP_WITH_CUDA
extern const Fp8Backend kCudaFp8Backend;  // cuda/fp8_quantize_cuda.cu
#endif

}  // namespace mfsdp
