// Multi-tensor launch metadata: many (src, dst, numel) segments in one launch.
//
// The segment table travels *by value* as a __grid_constant__ kernel parameter,
// so a launch needs no host->device copy and no pinned staging buffer, and it is
// safe to capture in a CUDA graph (the parameters are baked into the graph node).
// CUDA >= 12.1 allows 32 KB of kernel parameters on sm_70+, enough for 768
// segments; older toolkits keep to the classic 4 KB. A longer list is split into
// consecutive launches of kMaxSegments (a flat group of a few hundred parameters is one).
//
// Every launch copies its whole parameter block, so the table's capacity is sized
// to the segments used: a launch of at most kSmallSegments segments passes a
// ~0.3 KB table, at most kMediumSegments a ~2 KB one, and only longer lists the
// full ~24.6 KB table (one kernel instantiation per capacity).
//
// Work is cut into tiles that never straddle segments: segment s owns tiles
// [tile_begin[s], tile_begin[s + 1]) and tile t of it starts kTile * (t -
// tile_begin[s]) elements into the segment. Tile starts are therefore aligned
// whenever the segment's pointers are, which is what lets the kernels use 16-byte
// vector loads and stores.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "mfsdp/backend.h"

namespace mfsdp {

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int kMaxSegments = 768;  // ~24.6 KB of kernel parameters
#else
constexpr int kMaxSegments = 96;   // ~3 KB, under the 4 KB limit
#endif

constexpr int kSmallSegments = 8;    // ~0.3 KB: a single tensor or a small unit
constexpr int kMediumSegments = 64;  // ~2 KB: a transformer block's parameters

template <int Capacity>
struct SegmentTable {
  static constexpr int kCapacity = Capacity;
  int64_t tile_begin[Capacity + 1];  // prefix sums of tiles; tile_begin[num_segments] = total
  const void* src[Capacity];
  void* dst[Capacity];
  int64_t numel[Capacity];
  int num_segments;
};

static_assert(sizeof(SegmentTable<kSmallSegments>) <= 512, "a small launch copies little");

// Index of the segment owning `tile`: the last s with tile_begin[s] <= tile
// (segments are non-empty, so the owner is unique).
template <typename Table>
__device__ __forceinline__ int find_segment(const Table& table, int64_t tile) {
  int lo = 0;
  int hi = table.num_segments - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table.tile_begin[mid] <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Enough resident blocks of `block_threads` threads to fill the current device; a kernel's
// grid-stride loop does the rest. The SM count is queried once per device (shared by every
// kernel file: an inline function has one static per program).
inline int64_t max_resident_blocks(int block_threads) {
  static std::atomic<int> sm_count[C10_COMPILE_TIME_MAX_GPUS] = {};  // 0: not queried yet
  const c10::DeviceIndex device = c10::cuda::current_device();
  int count = sm_count[device].load(std::memory_order_relaxed);
  if (count == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    sm_count[device].store(count, std::memory_order_relaxed);
  }
  return int64_t{count} * (2048 / block_threads);
}

// Fills a table of `Capacity` with segments [first, first + count) and calls
// launch(table, num_tiles).
template <int Capacity, typename Launch>
void launch_table(const std::vector<Segment>& segments, size_t first, size_t count,
                  int64_t tile_elems, const Launch& launch) {
  SegmentTable<Capacity> table;
  table.num_segments = static_cast<int>(count);
  int64_t tiles = 0;
  for (size_t i = 0; i < count; ++i) {
    const Segment& seg = segments[first + i];
    table.tile_begin[i] = tiles;
    table.src[i] = seg.src;
    table.dst[i] = seg.dst;
    table.numel[i] = seg.numel;
    tiles += (seg.numel + tile_elems - 1) / tile_elems;
  }
  table.tile_begin[count] = tiles;
  launch(table, tiles);
}

// Calls launch(table, num_tiles) for each group of at most kMaxSegments segments, with
// the smallest table that holds the group: `launch` is a generic lambda over the table
// type. `tile_elems` is the kernel's elements per tile. Empty segments must be dropped.
template <typename Launch>
void for_each_table(const std::vector<Segment>& segments, int64_t tile_elems,
                    const Launch& launch) {
  static_assert(kSmallSegments < kMediumSegments && kMediumSegments < kMaxSegments,
                "table capacities must grow");
  for (size_t first = 0; first < segments.size(); first += kMaxSegments) {
    const size_t count = std::min<size_t>(kMaxSegments, segments.size() - first);
    if (count <= kSmallSegments) {
      launch_table<kSmallSegments>(segments, first, count, tile_elems, launch);
    } else if (count <= kMediumSegments) {
      launch_table<kMediumSegments>(segments, first, count, tile_elems, launch);
    } else {
      launch_table<kMaxSegments>(segments, first, count, tile_elems, launch);
    }
  }
}

}  // namespace mfsdp
