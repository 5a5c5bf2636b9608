// What a backend implements: two functions over a list of segments.
//
// A segment is one contiguous run of `numel` elements read from `src` (and, for
// copies, written to `dst`). The front end (csrc/ops.cpp) validates the op's
// arguments and turns them into segments once, for every backend; a backend
// (cpu/flat_buffer_cpu.cpp, cuda/flat_buffer_cuda.cu) only walks the list.
//
// Header-only and pybind11-free: included from .cpp and .cu files alike.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace mfsdp {

struct Segment {
  const void* src;
  void* dst;  // unused by reductions
  int64_t numel;
};

// Segments passed to a backend are non-empty (numel > 0) and their pointers are
// valid on `device`. CUDA kernels run on the device's current stream.
struct Backend {
  c10::DeviceType device_type;
  // Non-empty `segments`; for every element,
  //   dst = D(opmath(src) * scale)                  or, accumulating,
  //   dst = D(opmath(dst) + opmath(src) * scale),
  // rounding after the multiply, after the add and at the cast (no FMA).
  // opmath is float32, or float64 when either dtype is float64.
  void (*copy)(at::Device device, const std::vector<Segment>& segments, at::ScalarType src_dtype,
               at::ScalarType dst_dtype, double scale, bool accumulate);
  // sum(float(x)^2) over all elements of `segments` (of one dtype) as a 0-dim float32
  // tensor on `device`; an empty list gives 0.
  at::Tensor (*sum_of_squares)(at::Device device, const std::vector<Segment>& segments,
                               at::ScalarType dtype);
};

extern const Backend kCpuBackend;  // cpu/flat_buffer_cpu.cpp
#ifdef MFSDP_WITH_CUDA
extern const Backend kCudaBackend;  // cuda/flat_buffer_cuda.cu
#endif

}  // namespace mfsdp
