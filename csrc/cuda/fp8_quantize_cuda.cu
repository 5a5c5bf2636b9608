// The CUDA FP8 quantize kernel (mfsdp::kCudaFp8Backend, see mfsdp/fp8_quantize.h).
//
// One call is two launches per table of up to kMaxQuantizeSegments segments:
// zero_amax_kernel zeroes every amax slot of the call (all tables first), then
// fp8_quantize_kernel<S, F8> walks the table's tiles with a grid-stride loop, like
// scaled_cast_kernel of cuda/flat_buffer_cuda.cu: a full tile whose pointers are
// aligned loads kUnroll 16-byte input vectors per thread before it stores their fp8
// bytes, anything else takes a strided scalar loop. Every thread keeps max|x| of the
// segment its block is in as fp32 bits; when the block moves to another segment (and
// at the end) the block max-reduces them and thread 0 does one atomicMax on the
// slot's bits. For non-negative floats (NaN included, above +inf) the unsigned order
// of the bits is the numeric order, so the result is exact whatever the schedule.
//
// Numerics: __fmul_rn(float(x), scale), a clamp that passes NaN through, and c10's
// Float8_e4m3fn / Float8_e5m2 constructor (the bit recipe torch's own casts use), so
// every finite result equals torch's `(x.float() * scale).clamp(-max, max).to(fp8)`.
// A NaN input leaves the multiply as the canonical NaN, 0x7f in both formats.
//
// The segment table is this file's own (QuantizeTable: per-segment scale and amax
// pointers on top of multi_tensor.cuh's fields), passed by value as a
// __grid_constant__ parameter: no host-to-device copy, CUDA-graph capturable.
// Kernels run on the current stream under a device guard. Keep pybind11 and
// ATen/cuda/CUDAContext.h out of this file (see cuda/flat_buffer_cuda.cu).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <vector>

#include "mfsdp/fp8_quantize.h"
#include "multi_tensor.cuh"

namespace mfsdp {
namespace {

constexpr int kBlock = 256;
constexpr int kUnroll = 4;

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int kMaxQuantizeSegments = 512;  // ~24.6 KB of kernel parameters (32 KB limit)
#else
constexpr int kMaxQuantizeSegments = 64;  // ~3.1 KB, under the classic 4 KB limit
#endif

struct QuantizeTable {
  int64_t tile_begin[kMaxQuantizeSegments + 1];  // prefix sums; empty segments own no tile
  const void* src[kMaxQuantizeSegments];
  uint8_t* dst[kMaxQuantizeSegments];
  int64_t numel[kMaxQuantizeSegments];
  const float* scale[kMaxQuantizeSegments];
  float* amax[kMaxQuantizeSegments];
  int num_segments;
};

// 16-byte input vectors: 4 fp32 or 8 fp16/bf16 elements, i.e. 4 or 8 output bytes.
template <typename S>
constexpr int vec_width() {
  return 16 / static_cast<int>(sizeof(S));
}

template <typename S>
constexpr int64_t tile_elems() {
  return int64_t{kBlock} * vec_width<S>() * kUnroll;
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// find_segment (multi_tensor.cuh) finds the segment owning a tile. An empty segment shares its
// tile_begin with the next one, so it is never the last s with tile_begin[s] <= tile.

__device__ __forceinline__ unsigned abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

template <typename F8>
__device__ __forceinline__ uint8_t quantize(float x, float scale, float max_finite) {
  float v = __fmul_rn(x, scale);
  v = isnan(v) ? v : fminf(fmaxf(v, -max_finite), max_finite);  // at::clamp: NaN passes through
  return F8(v).x;
}

// Block-wide max of `v` (every thread calls it), folded into *slot by thread 0.
__device__ __forceinline__ void flush_amax(float* slot, unsigned v) {
  __shared__ unsigned warp_max[kBlock / 32];
#pragma unroll
  for (int delta = 16; delta > 0; delta /= 2) v = max(v, __shfl_down_sync(0xffffffffu, v, delta));
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kBlock / 32 ? warp_max[lane] : 0u;
#pragma unroll
    for (int delta = 16; delta > 0; delta /= 2) {
      v = max(v, __shfl_down_sync(0xffffffffu, v, delta));
    }
    if (lane == 0) atomicMax(reinterpret_cast<unsigned*>(slot), v);
  }
  __syncthreads();  // warp_max is reused by the next flush
}

__global__ void __launch_bounds__(kBlock) zero_amax_kernel(const __grid_constant__ QuantizeTable table) {
  for (int s = threadIdx.x; s < table.num_segments; s += kBlock) *table.amax[s] = 0.0f;
}

template <typename S, typename F8>
__global__ void __launch_bounds__(kBlock)
    fp8_quantize_kernel(const __grid_constant__ QuantizeTable table, float max_finite) {
  constexpr int kVec = vec_width<S>();
  constexpr int64_t kTile = tile_elems<S>();
  using InVec = Vec<S, kVec>;
  using OutVec = Vec<uint8_t, kVec>;

  // Every thread of a block sees the same tiles, so `current` and the flushes are
  // block-uniform.
  unsigned amax = 0;
  int current = -1;
  const int64_t num_tiles = table.tile_begin[table.num_segments];
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int s = find_segment(table, tile);
    if (s != current) {
      if (current >= 0) flush_amax(table.amax[current], amax);
      current = s;
      amax = 0;
    }
    const float scale = *table.scale[s];
    const int64_t start = (tile - table.tile_begin[s]) * kTile;
    const int64_t remaining = table.numel[s] - start;
    const int64_t n = remaining < kTile ? remaining : kTile;
    const S* src = static_cast<const S*>(table.src[s]) + start;
    uint8_t* dst = table.dst[s] + start;
    const bool aligned = reinterpret_cast<uintptr_t>(src) % sizeof(InVec) == 0 &&
                         reinterpret_cast<uintptr_t>(dst) % sizeof(OutVec) == 0;
    if (aligned && n == kTile) {
      InVec in[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        in[u] = reinterpret_cast<const InVec*>(src)[u * kBlock + threadIdx.x];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        OutVec out;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float x = static_cast<float>(in[u].v[j]);
          amax = max(amax, abs_bits(x));
          out.v[j] = quantize<F8>(x, scale, max_finite);
        }
        reinterpret_cast<OutVec*>(dst)[u * kBlock + threadIdx.x] = out;
      }
    } else {
      for (int64_t i = threadIdx.x; i < n; i += kBlock) {
        const float x = static_cast<float>(src[i]);
        amax = max(amax, abs_bits(x));
        dst[i] = quantize<F8>(x, scale, max_finite);
      }
    }
  }
  if (current >= 0) flush_amax(table.amax[current], amax);
}


// The segments cut into tables of at most kMaxQuantizeSegments, with tile prefix sums
// for `tile_elems` elements per tile; returns (table, total tiles) pairs.
std::vector<std::pair<QuantizeTable, int64_t>> make_tables(
    const std::vector<QuantizeSegment>& segments, int64_t tile_elems) {
  std::vector<std::pair<QuantizeTable, int64_t>> tables;
  for (size_t first = 0; first < segments.size(); first += kMaxQuantizeSegments) {
    const size_t count = std::min<size_t>(kMaxQuantizeSegments, segments.size() - first);
    QuantizeTable table;
    table.num_segments = static_cast<int>(count);
    int64_t tiles = 0;
    for (size_t i = 0; i < count; ++i) {
      const QuantizeSegment& seg = segments[first + i];
      table.tile_begin[i] = tiles;
      table.src[i] = seg.src;
      table.dst[i] = static_cast<uint8_t*>(seg.dst);
      table.numel[i] = seg.numel;
      table.scale[i] = seg.scale;
      table.amax[i] = seg.amax;
      tiles += (seg.numel + tile_elems - 1) / tile_elems;
    }
    table.tile_begin[count] = tiles;
    tables.emplace_back(table, tiles);
  }
  return tables;
}

template <typename S, typename F8>
void launch_quantize(const std::vector<QuantizeSegment>& segments, float max_finite,
                     cudaStream_t stream) {
  const std::vector<std::pair<QuantizeTable, int64_t>> tables =
      make_tables(segments, tile_elems<S>());
  // Zero every slot before any table max-reduces into it: a slot shared by inputs of
  // two tables gets the max over both.
  for (const auto& [table, tiles] : tables) {
    zero_amax_kernel<<<1, kBlock, 0, stream>>>(table);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int64_t grid_limit = max_resident_blocks(kBlock);
  for (const auto& [table, tiles] : tables) {
    if (tiles == 0) continue;  // only empty inputs: their slots stay 0
    const int blocks = static_cast<int>(std::min(tiles, grid_limit));
    fp8_quantize_kernel<S, F8><<<blocks, kBlock, 0, stream>>>(table, max_finite);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename F8>
void launch_for_input(at::ScalarType src_dtype, const std::vector<QuantizeSegment>& segments,
                      cudaStream_t stream) {
  const float max_finite = static_cast<float>(std::numeric_limits<F8>::max());
  switch (src_dtype) {
    case at::kFloat:
      return launch_quantize<float, F8>(segments, max_finite, stream);
    case at::kHalf:
      return launch_quantize<c10::Half, F8>(segments, max_finite, stream);
    case at::kBFloat16:
      return launch_quantize<c10::BFloat16, F8>(segments, max_finite, stream);
    default:
      TORCH_INTERNAL_ASSERT(false, "fp8_quantize_: unchecked input dtype ", src_dtype);
  }
}

void quantize_cuda(at::Device device, const std::vector<QuantizeSegment>& segments,
                   at::ScalarType src_dtype, at::ScalarType fp8_dtype) {
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (fp8_dtype == at::kFloat8_e4m3fn) {
    launch_for_input<c10::Float8_e4m3fn>(src_dtype, segments, stream);
  } else {
    TORCH_INTERNAL_ASSERT(fp8_dtype == at::kFloat8_e5m2, "fp8_quantize_: unchecked fp8 dtype ",
                          fp8_dtype);
    launch_for_input<c10::Float8_e5m2>(src_dtype, segments, stream);
  }
}

}  // namespace

const Fp8Backend kCudaFp8Backend{c10::DeviceType::CUDA, &quantize_cuda};

}  // namespace mfsdp
