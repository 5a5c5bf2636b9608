// The CUDA backend (mfsdp::kCudaBackend, see mfsdp/backend.h): kernel launches
// over the segment lists that the front end (csrc/ops.cpp) builds and registers.
//
// One kernel does every copy: scaled_cast_kernel<S, D> walks a segment table
// (multi_tensor.cuh; one instantiation per table capacity, so a launch copies
// only a table sized to its segments) with a grid-stride loop over tiles. A full tile whose
// pointers are aligned moves kUnroll 16-byte vectors per thread (all loads issued
// before the stores); partial or misaligned tiles fall back to a strided scalar
// loop. A pack_ of a whole list is one launch (per kMaxSegments segments).
//
// Numerics match the CPU kernels and the reference: opmath(src) * scale and
// opmath(dst) + scaled are rounded separately (__fmul_rn/__fadd_rn cannot be
// contracted into an FMA), then cast once to D.
//
// Kernels run on the current stream of the tensors' device, under a device guard.
// Keep pybind11 / torch/extension.h out of this file, and ATen/cuda/CUDAContext.h
// too: it pulls in cuBLAS/cuSPARSE/cuSOLVER headers that minimal toolkits lack,
// and c10 gives us the stream (at::cuda::getCurrentCUDAStream is the same call).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "mfsdp/backend.h"
#include "multi_tensor.cuh"

namespace mfsdp {
namespace {

constexpr int kBlock = 256;
constexpr int kUnroll = 4;

template <typename S, typename D>
using opmath_t = std::conditional_t<std::is_same_v<S, double> || std::is_same_v<D, double>,
                                    double, float>;

// 16-byte accesses on the wider side of the copy.
template <typename S, typename D>
constexpr int vec_width() {
  return 16 / static_cast<int>(sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D));
}

template <typename S, typename D>
constexpr int64_t tile_elems() {
  return int64_t{kBlock} * vec_width<S, D>() * kUnroll;
}

__device__ __forceinline__ int64_t tile_size(int64_t tile, int64_t remaining) {
  return remaining < tile ? remaining : tile;
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

template <typename S, typename D, typename acc_t>
__device__ __forceinline__ D scaled_cast(S x, D old, acc_t scale, bool accumulate) {
  acc_t v = mul_rn(static_cast<acc_t>(x), scale);
  if (accumulate) v = add_rn(static_cast<acc_t>(old), v);
  return static_cast<D>(v);
}

template <typename S, typename D, typename Table>
__global__ void __launch_bounds__(kBlock)
    scaled_cast_kernel(const __grid_constant__ Table table, opmath_t<S, D> scale,
                       bool accumulate) {
  using acc_t = opmath_t<S, D>;
  constexpr int kVec = vec_width<S, D>();
  constexpr int64_t kTile = tile_elems<S, D>();
  using SrcVec = Vec<S, kVec>;
  using DstVec = Vec<D, kVec>;

  const int64_t num_tiles = table.tile_begin[table.num_segments];
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int s = find_segment(table, tile);
    const int64_t start = (tile - table.tile_begin[s]) * kTile;
    const int64_t n = tile_size(kTile, table.numel[s] - start);
    const S* src = static_cast<const S*>(table.src[s]) + start;
    D* dst = static_cast<D*>(table.dst[s]) + start;
    const bool aligned = reinterpret_cast<uintptr_t>(src) % sizeof(SrcVec) == 0 &&
                         reinterpret_cast<uintptr_t>(dst) % sizeof(DstVec) == 0;
    if (aligned && n == kTile) {
      SrcVec in[kUnroll];
      DstVec out[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        in[u] = reinterpret_cast<const SrcVec*>(src)[u * kBlock + threadIdx.x];
        if (accumulate) out[u] = reinterpret_cast<const DstVec*>(dst)[u * kBlock + threadIdx.x];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          out[u].v[j] = scaled_cast<S, D, acc_t>(in[u].v[j], out[u].v[j], scale, accumulate);
        }
        reinterpret_cast<DstVec*>(dst)[u * kBlock + threadIdx.x] = out[u];
      }
    } else {
      for (int64_t i = threadIdx.x; i < n; i += kBlock) {
        dst[i] = scaled_cast<S, D, acc_t>(src[i], accumulate ? dst[i] : D(0), scale, accumulate);
      }
    }
  }
}

template <typename acc_t>
__device__ __forceinline__ acc_t block_sum(acc_t v) {
  __shared__ acc_t warp_sums[kBlock / 32];
#pragma unroll
  for (int delta = 16; delta > 0; delta /= 2) v += __shfl_down_sync(0xffffffffu, v, delta);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = threadIdx.x < kBlock / 32 ? warp_sums[threadIdx.x] : acc_t(0);
  if (warp == 0) {
#pragma unroll
    for (int delta = 16; delta > 0; delta /= 2) v += __shfl_down_sync(0xffffffffu, v, delta);
  }
  return v;  // valid in thread 0
}

// One partial sum of squares per block; sum_partials_kernel adds them up, so the
// result does not depend on scheduling (no atomics).
template <typename T, typename Table>
__global__ void __launch_bounds__(kBlock)
    sum_of_squares_kernel(const __grid_constant__ Table table, float* partials) {
  using acc_t = opmath_t<T, T>;
  constexpr int kVec = vec_width<T, T>();
  constexpr int64_t kTile = tile_elems<T, T>();
  using InVec = Vec<T, kVec>;

  acc_t acc = 0;
  const int64_t num_tiles = table.tile_begin[table.num_segments];
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int s = find_segment(table, tile);
    const int64_t start = (tile - table.tile_begin[s]) * kTile;
    const int64_t n = tile_size(kTile, table.numel[s] - start);
    const T* src = static_cast<const T*>(table.src[s]) + start;
    if (reinterpret_cast<uintptr_t>(src) % sizeof(InVec) == 0 && n == kTile) {
      InVec in[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        in[u] = reinterpret_cast<const InVec*>(src)[u * kBlock + threadIdx.x];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const acc_t x = static_cast<acc_t>(in[u].v[j]);
          acc += x * x;
        }
      }
    } else {
      for (int64_t i = threadIdx.x; i < n; i += kBlock) {
        const acc_t x = static_cast<acc_t>(src[i]);
        acc += x * x;
      }
    }
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = static_cast<float>(acc);
}

__global__ void __launch_bounds__(kBlock)
    sum_partials_kernel(const float* partials, int64_t n, float* out) {
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += kBlock) acc += partials[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) *out = acc;
}


void copy_cuda(at::Device device, const std::vector<Segment>& segments, at::ScalarType src_dtype,
               at::ScalarType dst_dtype, double scale, bool accumulate) {
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t grid_limit = max_resident_blocks(kBlock);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src_dtype, "mfsdp_cast_src", [&] {
    using src_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst_dtype, "mfsdp_cast_dst", [&] {
      using dst_t = scalar_t;
      using acc_t = opmath_t<src_t, dst_t>;
      for_each_table(
          segments, tile_elems<src_t, dst_t>(), [&](const auto& table, int64_t tiles) {
            using Table = std::decay_t<decltype(table)>;
            const int blocks = static_cast<int>(std::min(tiles, grid_limit));
            scaled_cast_kernel<src_t, dst_t, Table><<<blocks, kBlock, 0, stream>>>(
                table, static_cast<acc_t>(scale), accumulate);
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
    });
  });
}

at::Tensor sum_of_squares_cuda(at::Device device, const std::vector<Segment>& segments,
                               at::ScalarType dtype) {
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t grid_limit = max_resident_blocks(kBlock);
  const int64_t groups = std::max<int64_t>(
      1, (static_cast<int64_t>(segments.size()) + kMaxSegments - 1) / kMaxSegments);
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor partials = at::empty({groups * grid_limit}, f32);
  at::Tensor out = at::empty({}, f32);
  int64_t used = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "mfsdp_sum_of_squares", [&] {
    for_each_table(segments, tile_elems<scalar_t, scalar_t>(),
                   [&](const auto& table, int64_t tiles) {
                     using Table = std::decay_t<decltype(table)>;
                     const int blocks = static_cast<int>(std::min(tiles, grid_limit));
                     sum_of_squares_kernel<scalar_t, Table>
                         <<<blocks, kBlock, 0, stream>>>(table, partials.data_ptr<float>() + used);
                     C10_CUDA_KERNEL_LAUNCH_CHECK();
                     used += blocks;
                   });
  });
  sum_partials_kernel<<<1, kBlock, 0, stream>>>(partials.data_ptr<float>(), used,
                                                out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

const Backend kCudaBackend{c10::DeviceType::CUDA, &copy_cuda, &sum_of_squares_cuda};

}  // namespace mfsdp
