// The CPU FP8 quantize kernel (mfsdp::kCpuFp8Backend, see mfsdp/fp8_quantize.h).
//
// One at::parallel_for over the concatenated element range of the non-empty
// segments (like the copies of cpu/flat_buffer_cpu.cpp), so a flat group of many
// small shards and one huge shard both split evenly across threads. Each piece of a
// segment is quantized in one pass that also returns max|x| of the piece as fp32
// bits; the pieces of one segment, possibly on several threads, are combined with an
// atomic unsigned max, exact and independent of the split (see abs_bits).
//
// Per piece:
//   * span_avx2<S, F8>    x86-64 with AVX2+F16C (runtime check): 32 elements a step in
//                         fp32 lanes; the fp32 -> fp8 rounding is c10's bit recipe
//                         (fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value) done
//                         with integer lane ops;
//   * span_scalar<S, F8>  everything else and the tails: c10::Float8_*(float) itself.
// Both compute exactly what torch's `(x.float() * scale).clamp(-max, max).to(fp8)`
// computes on CPU, bit for bit, NaN sign included (the multiply keeps a NaN's sign on
// x86, the clamp passes NaN through, the conversion ORs the sign back in).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "mfsdp/fp8_quantize.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MFSDP_HAVE_AVX2_FP8_PATH 1
// Only these functions use AVX2; the rest of the library stays baseline x86-64.
#define MFSDP_AVX2_FP8 __attribute__((target("avx2,f16c")))
#endif

namespace mfsdp {
namespace {

// Elements per parallel task; below this a call runs on the calling thread.
constexpr int64_t kGrainSize = 32768;

// |x| as fp32 bits. For non-negative floats the unsigned order of the bits is the
// numeric order, and every NaN (sign cleared) lies above +inf, so an unsigned max of
// these bits is max|x| with NaN propagating, as torch's amax does.
inline uint32_t abs_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits & 0x7fffffffu;
}

// at::clamp's scalar rule: NaN passes through, -0.0 stays -0.0.
inline float clamp_nan(float v, float max_finite) {
  return std::isnan(v) ? v : std::min(std::max(v, -max_finite), max_finite);
}

// Quantizes src[0:n] into dst[0:n] and returns the max of abs_bits over the input.
using SpanFn = uint32_t (*)(const void* src, uint8_t* dst, int64_t n, float scale, float max_finite);

template <typename S, typename F8>
uint32_t span_scalar(const void* src_v, uint8_t* dst, int64_t n, float scale, float max_finite) {
  const S* src = static_cast<const S*>(src_v);
  uint32_t amax = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = static_cast<float>(src[i]);
    amax = std::max(amax, abs_bits(x));
    dst[i] = F8(clamp_nan(x * scale, max_finite)).x;
  }
  return amax;
}

#ifdef MFSDP_HAVE_AVX2_FP8_PATH
MFSDP_AVX2_FP8 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

MFSDP_AVX2_FP8 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

MFSDP_AVX2_FP8 inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// c10's fp32 -> fp8 recipes as lane constants. Every lane holds |v| as bits
// (`a`, < 2^31, so signed 32-bit compares order it correctly):
//   a >= kOverflow        NaN ? kNan : kSaturated     (after the clamp only NaN gets here)
//   a <  kNormalMin       bits(float(a) + 2^kDenormExp) - bits(2^kDenormExp): the fp32
//                         add rounds to the subnormal grid (round to nearest even)
//   otherwise             (a + kRebias + odd) >> kShift, odd = bit kShift of a
//                         (round to nearest even); e4m3fn maps a carry into 0x7f to 0x7e
struct E4m3fnRecipe {
  static constexpr int32_t kOverflow = 1087 << 20;  // 480.0f
  static constexpr int32_t kNan = 0x7f;
  static constexpr int32_t kSaturated = 0x7e;
  static constexpr int32_t kNormalMin = 121 << 23;  // 2^-6
  static constexpr int32_t kDenormMask = 141 << 23;
  static constexpr uint32_t kRebias = (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFF;
  static constexpr int kShift = 20;
  static constexpr bool kCarryIntoNan = true;
};

struct E5m2Recipe {
  static constexpr int32_t kOverflow = 143 << 23;  // 65536.0f
  static constexpr int32_t kNan = 0x7f;
  static constexpr int32_t kSaturated = 0x7c;  // inf
  static constexpr int32_t kNormalMin = 113 << 23;  // 2^-14
  static constexpr int32_t kDenormMask = 134 << 23;
  static constexpr uint32_t kRebias = (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFFF;
  static constexpr int kShift = 21;
  static constexpr bool kCarryIntoNan = false;
};

template <typename F8>
using RecipeOf = std::conditional_t<std::is_same_v<F8, c10::Float8_e4m3fn>, E4m3fnRecipe,
                                    E5m2Recipe>;

// 8 fp32 lanes -> 8 int32 lanes holding the fp8 bytes (0..255).
template <typename R>
MFSDP_AVX2_FP8 inline __m256i fp8_lanes(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(INT32_MIN));
  const __m256i a = _mm256_xor_si256(bits, sign);

  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, R::kShift), _mm256_set1_epi32(1));
  const __m256i rebias = _mm256_set1_epi32(static_cast<int32_t>(R::kRebias));
  __m256i normal = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, rebias), odd), R::kShift);
  if constexpr (R::kCarryIntoNan) {
    const __m256i nan_code = _mm256_set1_epi32(R::kNan);
    normal = _mm256_blendv_epi8(normal, _mm256_set1_epi32(R::kSaturated),
                                _mm256_cmpeq_epi32(normal, nan_code));
  }

  const __m256i denorm_mask = _mm256_set1_epi32(R::kDenormMask);
  const __m256 denorm_sum =
      _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(denorm_mask));
  const __m256i denorm = _mm256_sub_epi32(_mm256_castps_si256(denorm_sum), denorm_mask);

  const __m256i is_nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
  const __m256i big = _mm256_blendv_epi8(_mm256_set1_epi32(R::kSaturated),
                                         _mm256_set1_epi32(R::kNan), is_nan);

  const __m256i is_denorm = _mm256_cmpgt_epi32(_mm256_set1_epi32(R::kNormalMin), a);
  const __m256i is_big = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(R::kOverflow - 1));
  __m256i out = _mm256_blendv_epi8(normal, denorm, is_denorm);
  out = _mm256_blendv_epi8(out, big, is_big);
  return _mm256_or_si256(out, _mm256_srli_epi32(sign, 24));
}

template <typename S, typename F8>
MFSDP_AVX2_FP8 uint32_t span_avx2(const void* src_v, uint8_t* dst, int64_t n, float scale,
                                  float max_finite) {
  using R = RecipeOf<F8>;
  const S* src = static_cast<const S*>(src_v);
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256 vhi = _mm256_set1_ps(max_finite);
  const __m256 vlo = _mm256_set1_ps(-max_finite);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  // Bytes of the packed lanes in dword order r0lo r1lo r2lo r3lo | r0hi r1hi r2hi r3hi.
  const __m256i interleave = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256i vamax = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256i lanes[4];
    for (int k = 0; k < 4; ++k) {
      const __m256 x = load8(src + i + 8 * k);
      vamax = _mm256_max_epu32(vamax, _mm256_and_si256(_mm256_castps_si256(x), abs_mask));
      // at::vec::clamp's order: min(hi, max(lo, v)); both return `v` when it is NaN.
      const __m256 v = _mm256_min_ps(vhi, _mm256_max_ps(vlo, _mm256_mul_ps(x, vscale)));
      lanes[k] = fp8_lanes<R>(v);
    }
    const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(lanes[0], lanes[1]),
                                              _mm256_packus_epi32(lanes[2], lanes[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_permutevar8x32_epi32(bytes, interleave));
  }
  alignas(32) uint32_t partial[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(partial), vamax);
  uint32_t amax = span_scalar<S, F8>(src + i, dst + i, n - i, scale, max_finite);
  for (const uint32_t p : partial) amax = std::max(amax, p);
  return amax;
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}
#endif  // MFSDP_HAVE_AVX2_FP8_PATH

template <typename S, typename F8>
SpanFn pick_span() {
#ifdef MFSDP_HAVE_AVX2_FP8_PATH
  if (cpu_has_avx2()) return &span_avx2<S, F8>;
#endif
  return &span_scalar<S, F8>;
}

template <typename F8>
SpanFn select_span_for(at::ScalarType src_dtype) {
  switch (src_dtype) {
    case at::kFloat:
      return pick_span<float, F8>();
    case at::kHalf:
      return pick_span<c10::Half, F8>();
    case at::kBFloat16:
      return pick_span<c10::BFloat16, F8>();
    default:
      TORCH_INTERNAL_ASSERT(false, "fp8_quantize_: unchecked input dtype ", src_dtype);
  }
}

SpanFn select_span(at::ScalarType src_dtype, at::ScalarType fp8_dtype) {
  if (fp8_dtype == at::kFloat8_e4m3fn) return select_span_for<c10::Float8_e4m3fn>(src_dtype);
  TORCH_INTERNAL_ASSERT(fp8_dtype == at::kFloat8_e5m2, "fp8_quantize_: unchecked fp8 dtype ",
                        fp8_dtype);
  return select_span_for<c10::Float8_e5m2>(src_dtype);
}

float fp8_max(at::ScalarType fp8_dtype) {
  return fp8_dtype == at::kFloat8_e4m3fn
             ? static_cast<float>(std::numeric_limits<c10::Float8_e4m3fn>::max())
             : static_cast<float>(std::numeric_limits<c10::Float8_e5m2>::max());
}

void atomic_max(std::atomic<uint32_t>& slot, uint32_t value) {
  uint32_t seen = slot.load(std::memory_order_relaxed);
  while (seen < value && !slot.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

void quantize_cpu(at::Device /*device*/, const std::vector<QuantizeSegment>& segments,
                  at::ScalarType src_dtype, at::ScalarType fp8_dtype) {
  const SpanFn span = select_span(src_dtype, fp8_dtype);
  const float max_finite = fp8_max(fp8_dtype);
  const int64_t src_size = c10::elementSize(src_dtype);

  // The non-empty segments, as ends[k] = inclusive prefix sums of their numel.
  std::vector<size_t> owner;
  std::vector<int64_t> ends;
  int64_t total = 0;
  for (size_t s = 0; s < segments.size(); ++s) {
    if (segments[s].numel == 0) continue;
    owner.push_back(s);
    ends.push_back(total += segments[s].numel);
  }
  const std::unique_ptr<std::atomic<uint32_t>[]> amax_bits(
      new std::atomic<uint32_t>[segments.size()]);
  for (size_t s = 0; s < segments.size(); ++s) amax_bits[s].store(0, std::memory_order_relaxed);

  at::parallel_for(0, total, kGrainSize, [&](int64_t begin, int64_t end) {
    size_t k = std::upper_bound(ends.begin(), ends.end(), begin) - ends.begin();
    for (; k < ends.size(); ++k) {
      const QuantizeSegment& seg = segments[owner[k]];
      const int64_t seg_begin = ends[k] - seg.numel;
      if (seg_begin >= end) break;
      const int64_t first = std::max(begin, seg_begin) - seg_begin;
      const int64_t n = std::min(end, ends[k]) - seg_begin - first;
      const uint32_t piece_amax =
          span(static_cast<const char*>(seg.src) + first * src_size,
               static_cast<uint8_t*>(seg.dst) + first, n, *seg.scale, max_finite);
      atomic_max(amax_bits[owner[k]], piece_amax);
    }
  });

  // Zero every slot first, then max-combine: a slot named by several inputs ends up
  // with the max over them, and an empty input contributes 0.
  for (const QuantizeSegment& seg : segments) *seg.amax = 0.0f;
  for (size_t s = 0; s < segments.size(); ++s) {
    uint32_t bits;
    std::memcpy(&bits, segments[s].amax, sizeof(bits));
    bits = std::max(bits, amax_bits[s].load(std::memory_order_relaxed));
    std::memcpy(segments[s].amax, &bits, sizeof(bits));
  }
}

}  // namespace

const Fp8Backend kCpuFp8Backend{c10::DeviceType::CPU, &quantize_cpu};

}  // namespace mfsdp
