// The CPU backend (mfsdp::kCpuBackend, see mfsdp/backend.h): the loops over the
// segment lists that the front end (csrc/ops.cpp) builds and registers.
//
// A copy is one at::parallel_for over the concatenated element range of its
// segments, so a flat group of many small tensors and one huge tensor both split
// evenly across threads. Per piece of a segment the work is one of:
//   * std::memcpy                  same dtype, scale 1, no accumulation (an AVX2
//                                  streaming-store copy for calls writing >= 16 MiB);
//   * span_avx2<S, D>              x86-64 CPUs with AVX2+F16C (runtime check):
//                                  8 lanes of fp32 opmath, explicit bf16/fp16 casts;
//   * span_scalar<S, D>            everything else (float64, other ISAs); a plain
//                                  loop the compiler vectorizes.
// All paths compute  dst = D(opmath(src) * scale)  or, when accumulating,
// dst = D(opmath(dst) + opmath(src) * scale), rounding after the multiply and after
// the add, exactly like the pure-PyTorch reference (setup.py passes
// -ffp-contract=off so no FMA merges the two). Calls writing >= kStreamingMinBytes
// use non-temporal stores (see there).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#include "mfsdp/backend.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MFSDP_HAVE_AVX2_PATH 1
// Only these functions use AVX2; the rest of the library stays baseline x86-64.
#define MFSDP_AVX2 __attribute__((target("avx2,f16c")))
#endif

namespace mfsdp {
namespace {

// Elements per parallel task; below this a call runs on the calling thread.
constexpr int64_t kGrainSize = 32768;

// fp32 "opmath", fp64 when either side is float64.
template <typename S, typename D>
using opmath_t = std::conditional_t<std::is_same_v<S, double> || std::is_same_v<D, double>,
                                    double, float>;

// Calls whose destination is at least this large use streaming (non-temporal)
// stores where available: the destination is far larger than the last-level
// cache, so caching it only costs a read-for-ownership of every line (a cached
// copy moves 3 bytes for every 2 it needs). Smaller calls keep normal stores so
// the destination stays cache-hot for whoever reads it next.
constexpr int64_t kStreamingMinBytes = int64_t{16} << 20;

// dst[0:n] (=|+=) scale * src[0:n], type-erased so the parallel driver is not a
// template. `streaming` is a hint (never set together with `accumulate`).
using SpanFn = void (*)(const void* src, void* dst, int64_t n, double scale, bool accumulate,
                        bool streaming);
// sum(float(x)^2) over p[0:n], accumulated in double.
using SumSqFn = double (*)(const void* p, int64_t n);

template <typename S, typename D>
void span_scalar(const void* src_v, void* dst_v, int64_t n, double scale_d, bool accumulate,
                 bool /*streaming*/ = false) {
  using acc_t = opmath_t<S, D>;
  const S* src = static_cast<const S*>(src_v);
  D* dst = static_cast<D*>(dst_v);
  const acc_t scale = static_cast<acc_t>(scale_d);
  if (accumulate) {
    for (int64_t i = 0; i < n; ++i) {
      const acc_t scaled = static_cast<acc_t>(src[i]) * scale;
      dst[i] = static_cast<D>(static_cast<acc_t>(dst[i]) + scaled);
    }
  } else if (scale != acc_t(1)) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<D>(static_cast<acc_t>(src[i]) * scale);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<D>(static_cast<acc_t>(src[i]));
  }
}

template <typename T>
double sumsq_scalar(const void* p_v, int64_t n) {
  const T* p = static_cast<const T*>(p_v);
  // Eight independent lanes: vectorizes without reassociation flags.
  double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      const double x = static_cast<double>(p[i + j]);
      lanes[j] += x * x;
    }
  }
  double sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
               ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; i < n; ++i) {
    const double x = static_cast<double>(p[i]);
    sum += x * x;
  }
  return sum;
}

#ifdef MFSDP_HAVE_AVX2_PATH
// 8 elements <-> 8 fp32 lanes.
MFSDP_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

MFSDP_AVX2 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

MFSDP_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

MFSDP_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

MFSDP_AVX2 inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Round to nearest even like c10::BFloat16(float); NaN becomes 0x7fc0.
MFSDP_AVX2 inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), is_nan);
  // Every lane is < 2^16, so the unsigned-saturating pack is exact.
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded),
                                          _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// Streaming variants; `p` must be aligned to the 8-element store width.
MFSDP_AVX2 inline void stream8(float* p, __m256 v) { _mm256_stream_ps(p, v); }

MFSDP_AVX2 inline void stream8(c10::Half* p, __m256 v) {
  _mm_stream_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

MFSDP_AVX2 inline void stream8(c10::BFloat16* p, __m256 v) {
  alignas(16) c10::BFloat16 tmp[8];
  store8(tmp, v);
  _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm_load_si128(reinterpret_cast<__m128i*>(tmp)));
}

template <typename S, typename D>
MFSDP_AVX2 void span_avx2(const void* src_v, void* dst_v, int64_t n, double scale_d,
                          bool accumulate, bool streaming) {
  const S* src = static_cast<const S*>(src_v);
  D* dst = static_cast<D*>(dst_v);
  const float scale = static_cast<float>(scale_d);
  const __m256 vscale = _mm256_set1_ps(scale);
  int64_t i = 0;
  if (streaming && !accumulate) {
    // Scalar head up to the first store-width-aligned destination element.
    constexpr uintptr_t kAlign = 8 * sizeof(D);
    const int64_t misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) % kAlign);
    const int64_t head = std::min<int64_t>(n, misalign == 0 ? 0 : (kAlign - misalign) / sizeof(D));
    span_scalar<S, D>(src, dst, head, scale_d, false);
    i = head;
    if (scale != 1.0f) {
      for (; i + 8 <= n; i += 8) stream8(dst + i, _mm256_mul_ps(load8(src + i), vscale));
    } else {
      for (; i + 8 <= n; i += 8) stream8(dst + i, load8(src + i));
    }
    _mm_sfence();
  } else if (accumulate) {
    for (; i + 8 <= n; i += 8) {
      const __m256 scaled = _mm256_mul_ps(load8(src + i), vscale);
      store8(dst + i, _mm256_add_ps(load8(dst + i), scaled));
    }
  } else if (scale != 1.0f) {
    for (; i + 8 <= n; i += 8) store8(dst + i, _mm256_mul_ps(load8(src + i), vscale));
  } else {
    for (; i + 8 <= n; i += 8) store8(dst + i, load8(src + i));
  }
  span_scalar<S, D>(src + i, dst + i, n - i, scale_d, accumulate);
}

MFSDP_AVX2 inline __m256d square_add(__m256d acc, __m128 x) {
  const __m256d wide = _mm256_cvtps_pd(x);
  return _mm256_add_pd(acc, _mm256_mul_pd(wide, wide));
}

template <typename T>
MFSDP_AVX2 double sumsq_avx2(const void* p_v, int64_t n) {
  const T* p = static_cast<const T*>(p_v);
  __m256d acc0 = _mm256_setzero_pd(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = load8(p + i);
    const __m256 b = load8(p + i + 8);
    acc0 = square_add(acc0, _mm256_castps256_ps128(a));
    acc1 = square_add(acc1, _mm256_extractf128_ps(a, 1));
    acc2 = square_add(acc2, _mm256_castps256_ps128(b));
    acc3 = square_add(acc3, _mm256_extractf128_ps(b, 1));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(_mm256_add_pd(acc0, acc1), _mm256_add_pd(acc2, acc3)));
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + sumsq_scalar<T>(p + i, n - i);
}

// Same-dtype, unscaled copy with streaming stores (the memcpy of a streaming call).
MFSDP_AVX2 void copy_bytes_streaming(char* dst, const char* src, int64_t nbytes) {
  const int64_t misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) % 32);
  const int64_t head = std::min<int64_t>(nbytes, misalign == 0 ? 0 : 32 - misalign);
  std::memcpy(dst, src, static_cast<size_t>(head));
  int64_t i = head;
  for (; i + 128 <= nbytes; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
  _mm_sfence();
  std::memcpy(dst + i, src + i, static_cast<size_t>(nbytes - i));
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}
#endif  // MFSDP_HAVE_AVX2_PATH

template <typename T>
constexpr bool kHasSimdPath =
    std::is_same_v<T, float> || std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>;

template <typename S, typename D>
SpanFn pick_span() {
#ifdef MFSDP_HAVE_AVX2_PATH
  if constexpr (kHasSimdPath<S> && kHasSimdPath<D>) {
    if (cpu_has_avx2()) return &span_avx2<S, D>;
  }
#endif
  return &span_scalar<S, D>;
}

template <typename T>
SumSqFn pick_sumsq() {
#ifdef MFSDP_HAVE_AVX2_PATH
  if constexpr (kHasSimdPath<T>) {
    if (cpu_has_avx2()) return &sumsq_avx2<T>;
  }
#endif
  return &sumsq_scalar<T>;
}

SpanFn select_span(at::ScalarType src_dtype, at::ScalarType dst_dtype) {
  SpanFn fn = nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src_dtype, "mfsdp_span_src", [&] {
    using src_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst_dtype, "mfsdp_span_dst",
                                    [&] { fn = pick_span<src_t, scalar_t>(); });
  });
  return fn;
}

SumSqFn select_sumsq(at::ScalarType dtype) {
  SumSqFn fn = nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "mfsdp_sumsq",
                                  [&] { fn = pick_sumsq<scalar_t>(); });
  return fn;
}

// Walks the segments overlapping the global element range [begin, end) of their
// concatenation; calls fn(segment, first element within it, count).
class SegmentWalker {
 public:
  explicit SegmentWalker(const std::vector<Segment>& segments)
      : segments_(segments), ends_(segments_.size()) {
    int64_t total = 0;
    for (size_t s = 0; s < segments_.size(); ++s) ends_[s] = (total += segments_[s].numel);
  }

  int64_t total() const { return ends_.empty() ? 0 : ends_.back(); }

  template <typename F>
  void for_each_piece(int64_t begin, int64_t end, const F& fn) const {
    size_t s = std::upper_bound(ends_.begin(), ends_.end(), begin) - ends_.begin();
    for (; s < segments_.size(); ++s) {
      const int64_t seg_begin = ends_[s] - segments_[s].numel;
      if (seg_begin >= end) break;
      const int64_t lo = std::max(begin, seg_begin);
      const int64_t hi = std::min(end, ends_[s]);
      fn(segments_[s], lo - seg_begin, hi - lo);
    }
  }

 private:
  const std::vector<Segment>& segments_;  // the caller's, outlives the walker
  std::vector<int64_t> ends_;  // inclusive prefix sums of numel
};

void copy_cpu(at::Device /*device*/, const std::vector<Segment>& segments,
              at::ScalarType src_dtype, at::ScalarType dst_dtype, double scale, bool accumulate) {
  const SegmentWalker walker(segments);
  const int64_t src_size = c10::elementSize(src_dtype);
  const int64_t dst_size = c10::elementSize(dst_dtype);
  const bool plain_copy = src_dtype == dst_dtype && scale == 1.0 && !accumulate;
  const bool streaming = !accumulate && walker.total() * dst_size >= kStreamingMinBytes;
  const SpanFn span = plain_copy ? nullptr : select_span(src_dtype, dst_dtype);
  at::parallel_for(0, walker.total(), kGrainSize, [&](int64_t begin, int64_t end) {
    walker.for_each_piece(begin, end, [&](const Segment& seg, int64_t first, int64_t n) {
      const char* src = static_cast<const char*>(seg.src) + first * src_size;
      char* dst = static_cast<char*>(seg.dst) + first * dst_size;
      if (!plain_copy) {
        span(src, dst, n, scale, accumulate, streaming);
        return;
      }
#ifdef MFSDP_HAVE_AVX2_PATH
      if (streaming && cpu_has_avx2()) {
        copy_bytes_streaming(dst, src, n * src_size);
        return;
      }
#endif
      std::memcpy(dst, src, static_cast<size_t>(n * src_size));
    });
  });
}

at::Tensor sum_of_squares_cpu(at::Device device, const std::vector<Segment>& segments,
                              at::ScalarType dtype) {
  const int64_t elem_size = c10::elementSize(dtype);
  const SumSqFn sumsq = select_sumsq(dtype);
  const SegmentWalker walker(segments);
  const double sum = at::parallel_reduce(
      int64_t{0}, walker.total(), kGrainSize, 0.0,
      [&](int64_t begin, int64_t end, double partial) {
        walker.for_each_piece(begin, end, [&](const Segment& seg, int64_t first, int64_t n) {
          partial += sumsq(static_cast<const char*>(seg.src) + first * elem_size, n);
        });
        return partial;
      },
      std::plus<double>());
  at::Tensor out = at::empty({}, at::TensorOptions().dtype(at::kFloat).device(device));
  *out.data_ptr<float>() = static_cast<float>(sum);
  return out;
}

}  // namespace

const Backend kCpuBackend{c10::DeviceType::CPU, &copy_cpu, &sum_of_squares_cpu};

}  // namespace mfsdp
