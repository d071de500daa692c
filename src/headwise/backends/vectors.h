// Vectors of 16 floats and what headwise's attention kernels share: loads that widen bfloat16, a horizontal sum,
// exp of 16 scores, and the items of a call spread over torch's threads. Included by decode_attention.cpp and
// prefill_attention.cpp (headwise.native builds them into one library and hashes this header with them).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace headwise_vectors {

typedef float f16v __attribute__((vector_size(64)));
typedef float f8v __attribute__((vector_size(32)));
typedef float f4v __attribute__((vector_size(16)));
typedef unsigned short u16x16 __attribute__((vector_size(32)));
typedef unsigned int u32x16 __attribute__((vector_size(64)));

inline f16v load16(const float* p) {
  f16v x;
  __builtin_memcpy(&x, p, sizeof x);
  return x;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// The AVX2 build's loops run on 8-float registers: there GCC keeps arrays of 16-float vectors in memory and builds a
// runtime broadcast from 16 scalar stores. A 16-float sum of the other builds is two registers, lanes 0-7 and 8-15.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bfloat16 is float32's top half: widen, shift
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline __m256 load8(const int8_t* p) {  // an 8-bit cache row's values: widened to int32, then to float
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float sum16(__m256 lo, __m256 hi) {  // sum16 (below) of the 16 floats lo, hi: the same additions
  const __m256 y = _mm256_add_ps(lo, hi);
  const f4v z = (f4v)_mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
  return (z[0] + z[1]) + (z[2] + z[3]);
}
#endif

inline f16v load16(const c10::BFloat16* p) {  // bfloat16 is float32's top half: widen, shift
#ifdef __AVX512F__  // one widening load (GCC's vector extensions split it into two halves and a shuffle)
  const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<f16v>(_mm512_castsi512_ps(wide));
#elif defined(__AVX2__)  // two widening loads (the same split of the generic conversion: four instructions)
  const __m256 lo = load8(p), hi = load8(p + 8);
  f16v x;
  __builtin_memcpy(&x, &lo, sizeof lo);
  __builtin_memcpy(reinterpret_cast<char*>(&x) + sizeof lo, &hi, sizeof hi);
  return x;
#else
  u16x16 h;
  __builtin_memcpy(&h, p, sizeof h);
  const u32x16 wide = __builtin_convertvector(h, u32x16) << 16;
  f16v x;
  __builtin_memcpy(&x, &wide, sizeof x);
  return x;
#endif
}

inline f16v load16(const int8_t* p) {  // an 8-bit cache row's values, widened (exact)
#ifdef __AVX512F__
  return reinterpret_cast<f16v>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#else
  typedef int8_t i8x16 __attribute__((vector_size(16)));
  i8x16 b;
  __builtin_memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, f16v);
#endif
}

// Halves added, 16 -> 8 -> 4 -> 1. The halves taken by shuffles, which stay in registers: taken by memcpy, GCC stored
// the vector and read its halves back through general registers (under AVX2, loads spanning two stores, each a
// store-forwarding stall: twice a key's dot product time).
inline float sum16(f16v x) {
  const f8v y = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const f4v z = __builtin_shufflevector(y, y, 0, 1, 2, 3) + __builtin_shufflevector(y, y, 4, 5, 6, 7);
  return (z[0] + z[1]) + (z[2] + z[3]);
}

#ifdef __AVX512F__
// sum16 of four vectors at once, the same additions in the same order (lanes i and i + 8, then i and i + 4, then
// pairs, then the pairs' sums), each step taken for all four in one register: the four sums, in order.
inline __m128 sum16x4(f16v a, f16v b, f16v c, f16v d) {
  const __m512 A = reinterpret_cast<__m512>(a), B = reinterpret_cast<__m512>(b);
  const __m512 C = reinterpret_cast<__m512>(c), D = reinterpret_cast<__m512>(d);
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(A, B, 0x44), _mm512_shuffle_f32x4(A, B, 0xEE));  // a's 8, b's 8
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(C, D, 0x44), _mm512_shuffle_f32x4(C, D, 0xEE));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));  // 4 each
  const __m512 pairs = _mm512_add_ps(z, _mm512_permute_ps(z, 0xB1));  // z0 + z1, z1 + z0, z2 + z3, z3 + z2
  const __m512 sums = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, 0x4E));  // (z0 + z1) + (z2 + z3) in lane 0
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), sums));
}
#endif

typedef int i16v __attribute__((vector_size(64)));
typedef int i8v __attribute__((vector_size(32)));

// exp(x) of a vector V of floats (I: ints of the same size), x <= 0 (a score minus its row's largest), within a few
// float32 ulps of std::exp: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' degree-7 polynomial, times 2^n put into the
// exponent. Below -87.3 (where exp leaves float32's normal range) it returns 0, so a masked key's -inf gives an exact 0;
// NaN stays NaN. Each lane's arithmetic is its own: exp8 on two halves is exp16's bits.
template <typename V, typename I>
inline V exp_of(V x) {
  const V magic = V{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer held in the low bits
  const V clamped = x < -88.f ? V{} - 88.f : x;
  const V t = clamped * 1.44269504088896341f + magic;
  const V n = t - magic;  // round(x / ln2)
  const V r = (clamped - n * 0.693359375f) - n * -2.12194440e-4f;  // x - n ln2, ln2 in two parts
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  I bits;
  __builtin_memcpy(&bits, &t, sizeof bits);
  const I exponent = (bits - 0x4B400000 + 127) << 23;  // t's low bits hold n: the float 2^n
  V two_n;
  __builtin_memcpy(&two_n, &exponent, sizeof two_n);
  const V e = p * two_n;
  return x < -87.33654f ? V{} : e;
}

inline f16v exp16(f16v x) { return exp_of<f16v, i16v>(x); }
inline f8v exp8(f8v x) { return exp_of<f8v, i8v>(x); }  // on AVX2's registers (GCC kept 16-float vectors in memory there)

// tanh(x) of 16 floats within a few float32 ulps: for |x| < 0.4 its odd Taylor series to x^15 (the first term left out
// is below 1e-8 of the value), else sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) <= 0.45 (no cancellation). NaN stays
// NaN; +-inf gives +-1.
inline f16v tanh16(f16v x) {
  const f16v a = x < 0.f ? -x : x, y = a * a;
  f16v p = f16v{} + (-929569.f / 638512875.f);  // Horner's rule over x^2, from the x^15 term down
  p = p * y + 21844.f / 6081075.f;
  p = p * y + -1382.f / 155925.f;
  p = p * y + 62.f / 2835.f;
  p = p * y + -17.f / 315.f;
  p = p * y + 2.f / 15.f;
  p = p * y + -1.f / 3.f;
  const f16v small = a + a * (y * p);
  const f16v e = exp16(-2.f * a);
  const f16v large = (1.f - e) / (1.f + e);
  const f16v t = a < 0.4f ? small : large;
  return x < 0.f ? -t : t;
}

// The score terms both kernels take, checked: the softcap (0: none), sinks (H,) and ALiBi's slopes (1 or B, H),
// contiguous float32, or none (nullptr); `batched`: the slopes a row per batch row.
struct ScoreTerms {
  float cap = 0.f;
  const float* sinks = nullptr;
  const float* slopes = nullptr;
  bool batched = false;

  // query head h's sink and, of batch row b (of H heads), its slope: where they start (nullptr: none)
  const float* sinks_at(int64_t h) const { return sinks != nullptr ? sinks + h : nullptr; }
  const float* slopes_at(int64_t b, int64_t H, int64_t h) const {
    return slopes != nullptr ? slopes + (batched ? b * H : 0) + h : nullptr;
  }
};

inline ScoreTerms score_terms(const char* op, int64_t B, int64_t H, double softcap, const std::optional<at::Tensor>& sinks,
                              const std::optional<at::Tensor>& alibi) {
  TORCH_CHECK(softcap >= 0, op, ": softcap must be > 0, or 0 for none, got ", softcap);
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                                     sinks->size(0) == H),
              op, ": sinks must be a contiguous float32 (H,) tensor, one logit per query head");
  TORCH_CHECK(!alibi.has_value() || (alibi->scalar_type() == at::kFloat && alibi->is_contiguous() && alibi->dim() == 2 &&
                                     (alibi->size(0) == 1 || alibi->size(0) == B) && alibi->size(1) == H),
              op, ": alibi must be a contiguous float32 (1 or B, H) tensor of slopes");
  return {static_cast<float>(softcap), sinks.has_value() ? sinks->data_ptr<float>() : nullptr,
          alibi.has_value() ? alibi->data_ptr<float>() : nullptr, alibi.has_value() && alibi->size(0) > 1};
}

// fn(i, scratch) for every item 0 <= i < n on torch's threads, the costliest first, each thread taking the next
// item when it is done with one: rows of different lengths (a paged batch) share the threads evenly. An fn that takes
// fn(i, next, scratch) is told the item its thread runs next (-1: none), taken one ahead where there are AHEAD_ITEMS
// items or more a thread.
constexpr int64_t AHEAD_ITEMS = 8;

template <typename Scratch, typename Fn>
void each_item(int64_t n, const std::vector<int64_t>& cost, Fn fn) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  if (!cost.empty()) std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::atomic<int64_t> next{0};
  constexpr bool told = std::is_invocable_v<Fn, int64_t, int64_t, Scratch&>;  // fn(i, the thread's next item or -1, scratch)
  const int64_t threads = at::get_num_threads();
  // one ahead only where every thread has AHEAD_ITEMS items or more: with fewer, a thread's second pick would often be
  // another's first, and the items a thread holds unstarted unbalance the threads at the end (docs: decoding, the
  // next item's keys)
  const bool one_ahead = told && n >= AHEAD_ITEMS * threads;
  at::parallel_for(0, std::min<int64_t>(n, threads), 1, [&](int64_t, int64_t) {
    Scratch t;
    for (int64_t j = next++; j < n;) {
      // the next item taken before this one runs (so that its rows can be asked in while this one is computed), but
      // for the last items, which go to whichever thread is free first
      const int64_t after = one_ahead && next.load(std::memory_order_relaxed) + threads < n ? next++ : -1;
      if constexpr (told) {
        fn(order[j], after >= 0 && after < n ? order[after] : -1, t);
      } else {
        fn(order[j], t);
      }
      j = after >= 0 ? after : next++;
    }
  });
}

}  // namespace headwise_vectors
