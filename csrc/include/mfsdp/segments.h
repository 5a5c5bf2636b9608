// The one data shape every flat-buffer kernel consumes: a list of segments, each
// a contiguous run of `numel` elements read from `src` and written to `dst`.
//
// pack_ makes one segment per input (input -> flat[offset:]), unpack_ one per
// output (flat[offset:] -> output), and the 1-D copy ops a single segment. The
// CPU and CUDA backends differ only in how they walk the list.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

namespace mfsdp {

struct Segment {
  const void* src;
  void* dst;
  int64_t numel;
};

// Segments for tensors[i] -> flat[offsets[i] : offsets[i] + tensors[i].numel()].
// Empty tensors are dropped. Arguments must already be validated.
inline std::vector<Segment> segments_into_flat(at::TensorList tensors, at::IntArrayRef offsets,
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

// Segments for flat[offsets[i] : offsets[i] + tensors[i].numel()] -> tensors[i].
inline std::vector<Segment> segments_from_flat(const at::Tensor& flat, at::IntArrayRef offsets,
                                               at::TensorList tensors) {
  std::vector<Segment> segments;
  segments.reserve(tensors.size());
  const char* base = static_cast<const char*>(flat.const_data_ptr());
  const int64_t elem = flat.element_size();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel() == 0) continue;
    segments.push_back({base + offsets[i] * elem, tensors[i].data_ptr(), tensors[i].numel()});
  }
  return segments;
}

// A single segment src -> dst[dst_offset:] (empty list when src is empty).
inline std::vector<Segment> segment_pair(const at::Tensor& src, const at::Tensor& dst,
                                         int64_t dst_offset) {
  if (src.numel() == 0) return {};
  char* base = static_cast<char*>(dst.data_ptr());
  return {{src.const_data_ptr(), base + dst_offset * dst.element_size(), src.numel()}};
}

// Read-only segments over whole tensors (dst unused), for reductions.
inline std::vector<Segment> segments_of(at::TensorList tensors) {
  std::vector<Segment> segments;
  segments.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    if (t.numel() > 0) segments.push_back({t.const_data_ptr(), nullptr, t.numel()});
  }
  return segments;
}

}  // namespace mfsdp
