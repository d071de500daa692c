// One query row per head over its keys, the whole attention in one pass per key head: scores,
// softmax, weighted sum, float32 throughout, each key and value row read once for all the query
// heads that share it. Keys and values are float32, bfloat16 or 8-bit rows (an int8 KVCache's: a
// row of D int8 values, then its float32 scale; value d is x[d] * scale). Two ops over one core: a dense cache (decode_attention,
// with a softcap, ALiBi and sinks or not) and the blocks of a paged pool (paged_decode_attention). Built at run time by headwise.backends.decode_kernel for the
// instruction set torch runs its own kernels with; the ops' schemas live on the Python side, which
// also checks what it passes (devices, dtypes, shapes, rows contiguous).
//
// Head sizes 64 and 128 run on 16-float vectors (GCC/Clang vector extensions: the compiler maps
// them to AVX-512, or to two AVX2 registers), several keys and query heads a pass; other sizes one
// key and head at a time, 16 values at once and the rest one by one, in the same order for every row type.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "vectors.h"

namespace {

using namespace headwise_vectors;

// w[j] = exp(w[j] - top) for j < S (the softmax's numerators), and their sum.
#if defined(__AVX2__) && !defined(__AVX512F__)
// On AVX2's 8-float registers (GCC kept 16-float vectors, and a broadcast of top, in memory there): the two halves of
// each 16 and of the sums side by side, so the same additions in the same order as below.
inline float exp_sum(float* w, int64_t S, float top) {
  const f8v t = {top, top, top, top, top, top, top, top};
  f8v lo = {}, hi = {};
  int64_t j = 0;
  float tail[16];
  for (; j < S; j += 16) {
    float* p = w + j;
    if (j + 16 > S) {  // the last few: padded with -inf, whose exp is 0
      std::fill(tail, tail + 16, -std::numeric_limits<float>::infinity());
      std::copy(w + j, w + S, tail);
      p = tail;
    }
    f8v a, b;
    __builtin_memcpy(&a, p, sizeof a);
    __builtin_memcpy(&b, p + 8, sizeof b);
    a = exp8(a - t);
    b = exp8(b - t);
    __builtin_memcpy(p, &a, sizeof a);
    __builtin_memcpy(p + 8, &b, sizeof b);
    lo += a;
    hi += b;
    if (p == tail) std::copy(tail, tail + (S - j), w + j);
  }
  return sum16((__m256)lo, (__m256)hi);
}
#else
inline float exp_sum(float* w, int64_t S, float top) {
  f16v total = {};
  int64_t j = 0;
  for (; j + 16 <= S; j += 16) {
    const f16v e = exp16(load16(w + j) - top);
    __builtin_memcpy(w + j, &e, sizeof e);
    total += e;
  }
  if (j < S) {  // the last few: padded with -inf, whose exp is 0
    float tail[16];
    std::fill(tail, tail + 16, -std::numeric_limits<float>::infinity());
    std::copy(w + j, w + S, tail);
    const f16v e = exp16(load16(tail) - top);
    __builtin_memcpy(tail, &e, sizeof e);
    std::copy(tail, tail + (S - j), w + j);
    total += e;
  }
  return sum16(total);
}
#endif

// An 8-bit row's scale (the float32 after its D values; 1 for float32 and bfloat16 rows), and a row's values as
// float32: an 8-bit row's each times its scale, the numbers headwise.cache.dequantize_rows reads back, so that the
// loops below give the bits they give over those rows in float32. ROW_EXTRA: a row's elements beyond its D values.
template <typename T>
constexpr int64_t ROW_EXTRA = std::is_same_v<T, int8_t> ? 4 : 0;

template <typename T>
inline float row_scale(const T* row, int64_t D) {
  if constexpr (std::is_same_v<T, int8_t>) {
    float s;
    __builtin_memcpy(&s, row + D, sizeof s);
    return s;
  } else {
    (void)row, (void)D;
    return 1.f;
  }
}

template <typename T>
inline f16v values16(const T* p, float rs) {
  if constexpr (std::is_same_v<T, int8_t>) {
    return load16(p) * rs;
  } else {
    (void)rs;
    return load16(p);
  }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
template <typename T>
inline __m256 values8(const T* p, float rs) {
  if constexpr (std::is_same_v<T, int8_t>) {
    return _mm256_mul_ps(load8(p), _mm256_set1_ps(rs));
  } else {
    (void)rs;
    return load8(p);
  }
}
#endif

template <typename T>
inline float value(const T* p, int64_t d, float rs) {
  if constexpr (std::is_same_v<T, int8_t>) {
    return static_cast<float>(p[d]) * rs;
  } else {
    (void)rs;
    return static_cast<float>(p[d]);
  }
}

constexpr int64_t KEYS = 4;         // keys scored together: independent sums hide the multiply-add latency
constexpr int64_t VALUE_ROWS = 64;  // value rows summed for every query head before the next rows (kept in L1)
constexpr int64_t AHEAD = 4096;     // bytes: how far ahead of the rows being read the next are asked into the cache

// `rows` rows of n values from `row` on, AHEAD bytes further, asked into the cache where that is still inside the
// run, which ends at `end` (rows side by side only): the hardware's prefetchers alone ran short of memory's rate on
// these loops (most on bfloat16 rows), and a paged run's next block lies elsewhere (docs: decoding, on a Zen 5 EPYC).
// The cache lines of `rows` rows of `stride` elements from `row` on, asked into the cache: L1 (LEVEL 3) or L2 (LEVEL 2).
template <int LEVEL = 3, typename T>
inline void rows_in(const T* row, int64_t rows, int64_t stride) {
  const char* a = reinterpret_cast<const char*>(row);
  const int64_t bytes = rows * stride * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(a + off, 0, LEVEL);
}

template <typename T>
inline void rows_ahead(const T* row, int64_t rows, int64_t n, const T* end) {
  const T* a = row + AHEAD / static_cast<int64_t>(sizeof(T));
  if (a + rows * n > end) return;
  rows_in(a, rows, n);
}

// `rows` value rows from `row` on asked into L2 while the keys at the same positions are scored (L2, not L1: a float32
// head's values outgrow L1), so that the values' pass after the softmax finds them there instead of starting a stream
// of its own from memory (docs: decoding, the compiled step over an 8-bit cache).
template <typename T>
inline void values_into_l2(const T* row, int64_t rows, int64_t stride) {
  rows_in<2>(row, rows, stride);
}

// The thread's next item's key row at the same position asked into L2 while this item's values are summed (they came
// into L2 with its keys): the memory's stream goes on into the next item's keys instead of stopping at each item's end
// (docs: decoding, the next item's keys).
template <typename T>
inline void keys_into_l2(const T* row, int64_t stride) {
  rows_in<2>(row, 1, stride);
}

// A run of n consecutive keys (or values): row u at p + u * stride.
template <typename T>
struct Run {
  const T* p;
  int64_t n;
};

#if defined(__AVX512F__) || defined(__AVX2__)
constexpr int GROUP = 4;  // query heads a key row is loaded for at once (AVX-512: 4 x KEYS sums and KEYS rows, 20 of 32 registers)
#else
constexpr int GROUP = 1;  // one head at a time
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// Keys scored a pass for GB query heads: GB x keys x 2 registers of sums and a key's two halves within the 16.
template <int GB>
constexpr int keys_for() { return GB == 1 ? 4 : GB == 2 ? 3 : GB == 3 ? 2 : 1; }
#endif

// f(integral_constant<int, g>) for g = min(GROUP, left): a group's head count as a template argument (sums in registers)
template <typename Fn>
inline void by_group(int64_t left, Fn f) {
  switch (std::min<int64_t>(left, GROUP)) {
    case 4: return f(std::integral_constant<int, 4>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 1>{});
  }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// scores_group (below) on AVX2's registers: keys_for<GB>() keys a pass, each loaded (bfloat16: widened) once for the group
template <typename T, int D, int GB>
void scores_group(const float* q, const T* p, int64_t n, int64_t stride, int64_t S, float scale, float* w, const T* v, int64_t vs) {
  constexpr int C = D / 16, K = keys_for<GB>();
  int64_t s = 0;
  for (; s + K <= n; s += K) {
    const T* k0 = p + s * stride;
    if (stride == D + ROW_EXTRA<T>) rows_ahead(k0, K, stride, p + n * stride);
    if (v != nullptr) values_into_l2(v + s * vs, K, vs);
    __m256 lo[GB][K], hi[GB][K];
    for (int g = 0; g < GB; ++g) {
      for (int u = 0; u < K; ++u) lo[g][u] = hi[g][u] = _mm256_setzero_ps();
    }
    float rs[K];
    for (int u = 0; u < K; ++u) rs[u] = row_scale(k0 + u * stride, D);
    for (int c = 0; c < C; ++c) {
      for (int u = 0; u < K; ++u) {
        const __m256 kl = values8(k0 + u * stride + 16 * c, rs[u]), kh = values8(k0 + u * stride + 16 * c + 8, rs[u]);
        for (int g = 0; g < GB; ++g) {
          lo[g][u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + 16 * c), kl, lo[g][u]);
          hi[g][u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + 16 * c + 8), kh, hi[g][u]);
        }
      }
    }
    for (int g = 0; g < GB; ++g) {
      for (int u = 0; u < K; ++u) w[g * S + s + u] = sum16(lo[g][u], hi[g][u]) * scale;
    }
  }
  for (; s < n; ++s) {
    for (int g = 0; g < GB; ++g) {
      __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
      const float rs = row_scale(p + s * stride, D);
      for (int c = 0; c < C; ++c) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + 16 * c), values8(p + s * stride + 16 * c, rs), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + 16 * c + 8), values8(p + s * stride + 16 * c + 8, rs), hi);
      }
      w[g * S + s] = sum16(lo, hi) * scale;
    }
  }
}
#else
// w[g * S + u] = q[g] . row u * scale for GB query heads (q, w offset to the group's first head; w to the run's first
// key), the run's rows: each key row loaded (bfloat16: widened) once for the group; each sum over the head size in order.
// v: the run's value rows (stride vs) to ask into L2 as their keys are scored, or nullptr.
template <typename T, int D, int GB>
void scores_group(const float* q, const T* p, int64_t n, int64_t stride, int64_t S, float scale, float* w, const T* v, int64_t vs) {
  constexpr int C = D / 16;
  int64_t s = 0;
  for (; s + KEYS <= n; s += KEYS) {
    const T* k0 = p + s * stride;
    if (stride == D + ROW_EXTRA<T>) rows_ahead(k0, KEYS, stride, p + n * stride);
    if (v != nullptr) values_into_l2(v + s * vs, KEYS, vs);
    f16v a[GB][KEYS] = {};
    float rs[KEYS];
    for (int64_t u = 0; u < KEYS; ++u) rs[u] = row_scale(k0 + u * stride, D);
    for (int c = 0; c < C; ++c) {
      f16v k[KEYS];
      for (int64_t u = 0; u < KEYS; ++u) k[u] = values16(k0 + u * stride + 16 * c, rs[u]);
      for (int g = 0; g < GB; ++g) {
        const f16v x = load16(q + g * D + 16 * c);
        for (int64_t u = 0; u < KEYS; ++u) a[g][u] += x * k[u];
      }
    }
    for (int g = 0; g < GB; ++g) {
#ifdef __AVX512F__  // the four keys' sums in one pass of shuffles (sum16's additions, in its order)
      static_assert(KEYS == 4, "sum16x4 sums four keys");
      _mm_storeu_ps(w + g * S + s, _mm_mul_ps(sum16x4(a[g][0], a[g][1], a[g][2], a[g][3]), _mm_set1_ps(scale)));
#else
      for (int64_t u = 0; u < KEYS; ++u) w[g * S + s + u] = sum16(a[g][u]) * scale;
#endif
    }
  }
  for (; s < n; ++s) {
    for (int g = 0; g < GB; ++g) {
      f16v a = {};
      const float rs = row_scale(p + s * stride, D);
      for (int c = 0; c < C; ++c) a += load16(q + g * D + 16 * c) * values16(p + s * stride + 16 * c, rs);
      w[g * S + s] = sum16(a) * scale;
    }
  }
}
#endif

// w[g * S + u] = q[g] . row u * scale, for the G query heads and the run's rows (w already offset to the run's first key);
// the first group asks the run's value rows v (stride vs) into L2
template <typename T, int D>
void scores_vec(const float* q, const T* p, int64_t n, int64_t stride, int64_t G, int64_t S, float scale, float* w, const T* v, int64_t vs) {
  for (int64_t g0 = 0; g0 < G; g0 += GROUP) {
    by_group(G - g0, [&](auto gb) {
      scores_group<T, D, decltype(gb)::value>(q + g0 * D, p, n, stride, S, scale, w + g0 * S, g0 == 0 ? v : nullptr, vs);
    });
  }
}

// Head sizes other than 64 and 128: each dot product over 16 values at a time, then the last D % 16 one by one, each
// a fused multiply-add (std::fma: left to itself the compiler fused them for one row type and not another), in an
// order that depends on nothing but D: 8-bit rows read in place give the bits of the rows read back.
template <typename T>
void scores_any(const float* q, const T* p, int64_t n, int64_t stride, int64_t G, int64_t S, int64_t D, float scale, float* w) {
  const int64_t D16 = D - D % 16;
  for (int64_t s = 0; s < n; ++s) {
    const T* k0 = p + s * stride;
    const float rs = row_scale(k0, D);
    for (int64_t g = 0; g < G; ++g) {
      f16v a = {};
      for (int64_t d = 0; d < D16; d += 16) a += load16(q + g * D + d) * values16(k0 + d, rs);
      float rest = 0.f;
      for (int64_t d = D16; d < D; ++d) rest = std::fma(q[g * D + d], value(k0, d, rs), rest);
      w[g * S + s] = (sum16(a) + rest) * scale;
    }
  }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// context_group (below) on AVX2's registers: 64 columns a pass (8 registers of sums), one head at a time, the same
// multiply-adds in the same order.

template <typename T, int D, int GB>
void context_group(const float* w, const T* p, int64_t j0, int64_t j1, int64_t n, int64_t stride, int64_t S, float* acc, bool first,
                   Run<T> next, int64_t ns) {
  static_assert(D % 64 == 0, "AVX2: 64 columns a pass");
  for (int g = 0; g < GB; ++g) {
    for (int c0 = 0; c0 < D; c0 += 64) {
      __m256 a[8];
      for (int c = 0; c < 8; ++c) a[c] = _mm256_loadu_ps(acc + g * D + c0 + 8 * c);
      for (int64_t j = j0; j < j1; ++j) {
        if (first && g == 0 && c0 == 0 && stride == D + ROW_EXTRA<T>) rows_ahead(p + j * stride, 1, stride, p + n * stride);
        if (first && g == 0 && c0 == 0 && j < next.n) keys_into_l2(next.p + j * ns, ns);
        const float wj = w[g * S + j];
        if (wj == 0.f) continue;  // a masked key: its value row may hold anything
        const __m256 wv = _mm256_set1_ps(wj);
        const float rs = row_scale(p + j * stride, D);
        for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(wv, values8(p + j * stride + c0 + 8 * c, rs), a[c]);
      }
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + g * D + c0 + 8 * c, a[c]);
    }
  }
}
#else
// acc[g] += sum_u w[g * S + u] * row u for GB query heads (w, acc offset to the group's first head; w to the run's first
// key), rows j0 <= u < j1 of a run of n: each value row loaded once for the group, added in order; keys of weight 0 skipped
template <typename T, int D, int GB>
void context_group(const float* w, const T* p, int64_t j0, int64_t j1, int64_t n, int64_t stride, int64_t S, float* acc, bool first,
                   Run<T> next, int64_t ns) {
  constexpr int C = D / 16;
  f16v a[GB][C];
  for (int g = 0; g < GB; ++g) {
    for (int c = 0; c < C; ++c) a[g][c] = load16(acc + g * D + 16 * c);
  }
  for (int64_t j = j0; j < j1; ++j) {
    if (first && stride == D + ROW_EXTRA<T>) rows_ahead(p + j * stride, 1, stride, p + n * stride);  // the first group reads them from memory
    if (first && j < next.n) keys_into_l2(next.p + j * ns, ns);
    float wj[GB];
    bool any = false;
    for (int g = 0; g < GB; ++g) any |= (wj[g] = w[g * S + j]) != 0.f;
    if (!any) continue;  // a masked key: its value row may hold anything
    const float rs = row_scale(p + j * stride, D);
    f16v v[C];
    for (int c = 0; c < C; ++c) v[c] = values16(p + j * stride + 16 * c, rs);
    for (int g = 0; g < GB; ++g) {
      if (wj[g] == 0.f) continue;
      for (int c = 0; c < C; ++c) a[g][c] += wj[g] * v[c];
    }
  }
  for (int g = 0; g < GB; ++g) {
    for (int c = 0; c < C; ++c) __builtin_memcpy(acc + g * D + 16 * c, &a[g][c], sizeof a[g][c]);
  }
}
#endif

// acc[g] += sum_u w[g * S + u] * row u, for the run's rows (w offset to the run's first key); keys of weight 0 skipped;
// the first group asks row u of the run `next` (stride ns) into L2 beside value row u, where it has one
template <typename T, int D>
void context_vec(const float* w, const T* p, int64_t n, int64_t stride, int64_t G, int64_t S, float* acc, Run<T> next, int64_t ns) {
  constexpr int64_t most = std::max(1, GROUP * 64 / D);  // heads whose sums fit in registers beside a row: 4 at D = 64, 2 at 128
  for (int64_t j0 = 0; j0 < n; j0 += VALUE_ROWS) {
    const int64_t j1 = std::min(n, j0 + VALUE_ROWS);
    for (int64_t g0 = 0; g0 < G; g0 += most) {
      by_group(std::min(most, G - g0), [&](auto gb) {
        context_group<T, D, decltype(gb)::value>(w + g0 * S, p, j0, j1, n, stride, S, acc + g0 * D, g0 == 0, next, ns);
      });
    }
  }
}

// (Head sizes other than 64 and 128: 16 values at a time, then the last Dv % 16, as scores_any.)
template <typename T>
void context_any(const float* w, const T* p, int64_t n, int64_t stride, int64_t G, int64_t S, int64_t Dv, float* acc, Run<T> next,
                 int64_t ns) {
  const int64_t D16 = Dv - Dv % 16;
  for (int64_t j = 0; j < n; ++j) {
    if (j < next.n) keys_into_l2(next.p + j * ns, ns);
    const T* v0 = p + j * stride;
    const float rs = row_scale(v0, Dv);
    for (int64_t g = 0; g < G; ++g) {
      const float wj = w[g * S + j];
      if (wj == 0.f) continue;
      float* a = acc + g * Dv;
      for (int64_t d = 0; d < D16; d += 16) {
        const f16v x = load16(a + d) + wj * values16(v0 + d, rs);
        __builtin_memcpy(a + d, &x, sizeof x);
      }
      for (int64_t d = D16; d < Dv; ++d) a[d] = std::fma(wj, value(v0, d, rs), a[d]);
    }
  }
}

// The next run's rows asked into the cache while this run's are computed, where the run is shorter than a page:
// the blocks of a paged pool lie anywhere, and x86 hardware prefetchers stop at page edges, so a run of a page or
// more gets their stream and one of less gets nothing from them (docs: serving, the paged kernel).
constexpr int64_t PAGE = 4096;

template <typename T>
inline void ahead(const Run<T>& r, int64_t stride) {
  if (r.n * stride * static_cast<int64_t>(sizeof(T)) < PAGE) rows_in(r.p, r.n, stride);
}

// w[j] = cap * tanh(w[j] / cap) for j < n (tanh16: within a few float32 ulps)
inline void capped(float* w, int64_t n, float cap) {
  const float inv = 1.f / cap;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const f16v x = cap * tanh16(load16(w + j) * inv);
    __builtin_memcpy(w + j, &x, sizeof x);
  }
  if (j < n) {  // the last few, through a padded copy
    float tail[16] = {};
    std::copy(w + j, w + n, tail);
    const f16v x = cap * tanh16(load16(tail) * inv);
    __builtin_memcpy(tail, &x, sizeof x);
    std::copy(tail, tail + (n - j), w + j);
  }
}

// Scratch of one thread: the query rows in float32, the scores (G, S), the sums (G, Dv), a row's padding, its runs.
template <typename T>
struct Scratch {
  std::vector<float> q, w, acc, total;
  std::vector<char> mask;
  std::vector<Run<T>> keys, values;
};

// The G query heads q (G, D) of one key head over its S keys, given as runs of key rows and value
// rows (the same runs for both), real[j] == false masking key j (nullptr: every key is real), each score taken to
// cap * tanh(score / cap) where cap > 0 (Gemma 2's softcap), then less slopes[g] * (S - 1 - j) (ALiBi's bias: the query
// sits at position S - 1; nullptr: none), sinks[g] (nullptr: none) a logit of query head g that joins its softmax with
// no value (gpt-oss's): out (G, Dv) in O, zeros for a row that sees no key. next: the thread's next item's first run of key rows (stride ks),
// asked into L2 as this item's values are summed (its row j beside this item's value row j), or none (n = 0).
template <typename T, typename Q, typename O>
void attend_head(const Q* q, const std::vector<Run<T>>& keys, const std::vector<Run<T>>& values, int64_t ks, int64_t vs,
                 const bool* real, int64_t S, int64_t G, int64_t D, int64_t Dv, float scale, float cap, const float* slopes,
                 const float* sinks, O* out, Scratch<T>& t, Run<T> next = {nullptr, 0}) {
  t.q.resize(G * D);
  t.w.resize(G * S);
  t.acc.assign(G * Dv, 0.f);
  t.total.assign(G, 0.f);
  for (int64_t j = 0; j < G * D; ++j) t.q[j] = static_cast<float>(q[j]);
  int64_t at = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const Run<T>& r = keys[i];
    if (i + 1 < keys.size()) ahead(keys[i + 1], ks);
    if (D == 64) {
      scores_vec<T, 64>(t.q.data(), r.p, r.n, ks, G, S, scale, t.w.data() + at, values[i].p, vs);
    } else if (D == 128) {
      scores_vec<T, 128>(t.q.data(), r.p, r.n, ks, G, S, scale, t.w.data() + at, values[i].p, vs);
    } else {
      scores_any<T>(t.q.data(), r.p, r.n, ks, G, S, D, scale, t.w.data() + at);
    }
    at += r.n;
  }
  if (cap > 0.f) capped(t.w.data(), G * S, cap);  // before the padding's -inf (a padded key's score may be anything)
  for (int64_t g = 0; slopes != nullptr && g < G; ++g) {  // ALiBi: -slope * |(S - 1) - j|
    float* wg = t.w.data() + g * S;
    for (int64_t j = 0; j < S; ++j) wg[j] -= slopes[g] * static_cast<float>(S - 1 - j);
  }
  for (int64_t g = 0; g < G; ++g) {  // softmax numerators, each row's max (or its sink, if larger) taken out; masked keys 0
    float* wg = t.w.data() + g * S;
    if (real != nullptr) {
      for (int64_t j = 0; j < S; ++j) wg[j] = real[j] ? wg[j] : -std::numeric_limits<float>::infinity();
    }
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < S; ++j) top = std::max(top, wg[j]);
    if (top == -std::numeric_limits<float>::infinity()) {  // no key seen (or every score -inf): weights 0
      std::fill(wg, wg + S, 0.f);
      continue;
    }
    const float sink = sinks != nullptr ? sinks[g] : -std::numeric_limits<float>::infinity(), most = std::max(top, sink);
    t.total[g] = exp_sum(wg, S, most) + (sinks != nullptr ? std::exp(sink - most) : 0.f);  // the sink's share: no value
  }
  at = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const Run<T>& r = values[i];
    if (i + 1 < values.size()) ahead(values[i + 1], vs);
    const Run<T> following = at < next.n ? Run<T>{next.p + at * ks, next.n - at} : Run<T>{nullptr, 0};  // beside key `at` on
    if (Dv == 64) {
      context_vec<T, 64>(t.w.data() + at, r.p, r.n, vs, G, S, t.acc.data(), following, ks);
    } else if (Dv == 128) {
      context_vec<T, 128>(t.w.data() + at, r.p, r.n, vs, G, S, t.acc.data(), following, ks);
    } else {
      context_any<T>(t.w.data() + at, r.p, r.n, vs, G, S, Dv, t.acc.data(), following, ks);
    }
    at += r.n;
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = t.total[g] > 0.f ? 1.f / t.total[g] : 0.f;
    for (int64_t d = 0; d < Dv; ++d) out[g * Dv + d] = static_cast<O>(static_cast<Q>(t.acc[g * Dv + d] * inv));  // (Q's rounding)
  }
}

// q (B, H, 1, D) contiguous over the first S slots of k (B, Hkv, L, D) and v (B, Hkv, L, Dv) (S <= L), rows contiguous
// (8-bit rows: D + 4 and Dv + 4 elements, the scale last), real (B, L) bool or none, the softcap, sinks (H,) and ALiBi's
// slopes (1 or B, H) in `terms` -> out (B, H, 1, Dv) of O, each value rounded to Q first (O: Q, or float32)
template <typename T, typename Q, typename O = Q>
void dense(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& real, int64_t S,
           at::Tensor& out, float scale, const ScoreTerms& terms) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3);
  const int64_t Hkv = k.size(1), Dv = v.size(3) - ROW_EXTRA<T>, G = H / Hkv;
  const Q* qp = q.data_ptr<Q>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const bool* rp = real ? real->data_ptr<bool>() : nullptr;
  const int64_t rb = real ? real->stride(0) : 0, rs = real ? real->stride(1) : 0;
  O* op = out.data_ptr<O>();
  each_item<Scratch<T>>(B * Hkv, {}, [&](int64_t i, int64_t after, Scratch<T>& t) {  // every item reads S keys: no order needed; `after` runs next
    const int64_t b = i / Hkv, h = i % Hkv;
    const Run<T> next = after < 0 ? Run<T>{nullptr, 0} : Run<T>{kp + (after / Hkv) * k.stride(0) + (after % Hkv) * k.stride(1), S};  // its keys
    t.keys.assign(1, {kp + b * k.stride(0) + h * k.stride(1), S});  // one run each: the scratch's, no allocation per item
    t.values.assign(1, {vp + b * v.stride(0) + h * v.stride(1), S});
    const bool* r = nullptr;
    if (rp != nullptr) {
      t.mask.resize(S);
      for (int64_t j = 0; j < S; ++j) t.mask[j] = rp[b * rb + j * rs];
      r = reinterpret_cast<const bool*>(t.mask.data());
    }
    attend_head<T, Q, O>(qp + (b * H + h * G) * D, t.keys, t.values, k.stride(2), v.stride(2), r, S, G, D, Dv, scale, terms.cap,
                         terms.slopes_at(b, H, h * G), terms.sinks_at(h * G), op + (b * H + h * G) * Dv, t, next);
  });
}

// q (N, Hkv, G, D) contiguous, pools (Hkv, P, D) and (Hkv, P, Dv) contiguous (8-bit rows: D + 4 and Dv + 4 elements, the
// scale last; float32 queries), tables (N, nb) long, seen_from/seen_to (N,); the terms as dense's (a row of slopes per
// sequence where batched), a sequence's query at position seen_to - 1 of its table
template <typename T, typename Q>
void paged(const at::Tensor& q, const at::Tensor& kp_, const at::Tensor& vp_, const at::Tensor& tables, const at::Tensor& from,
           const at::Tensor& to, int64_t bs, at::Tensor& out, float scale, const ScoreTerms& terms) {
  const int64_t N = q.size(0), Hkv = q.size(1), G = q.size(2), D = q.size(3), Dv = vp_.size(2) - ROW_EXTRA<T>, P = kp_.size(1);
  const int64_t ks = D + ROW_EXTRA<T>, vs = Dv + ROW_EXTRA<T>;  // a pool row's elements (8-bit rows: the values, then the scale)
  const int64_t nb = tables.size(1);
  const Q* qp = q.data_ptr<Q>();
  const T* kp = kp_.data_ptr<T>();
  const T* vp = vp_.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* fp = from.data_ptr<int64_t>();
  const int64_t* sp = to.data_ptr<int64_t>();
  Q* op = out.data_ptr<Q>();
  std::vector<int64_t> cost(N * Hkv);
  for (int64_t i = 0; i < N * Hkv; ++i) cost[i] = sp[i / Hkv] - fp[i / Hkv];  // keys read
  // fn(slot, count, joined) for each block's share of sequence n's keys, in order (count keys from pool slot `slot`;
  // joined: it follows the last share in the pool, the same run), until fn returns false
  const auto shares = [&](int64_t n, auto fn) {
    for (int64_t j = fp[n], end = -1; j < sp[n];) {  // keys fp[n] <= j < sp[n] of the table; end: the slot past the last share
      const int64_t slot = tp[n * nb + j / bs] * bs + j % bs, count = std::min(bs - j % bs, sp[n] - j);
      if (!fn(slot, count, slot == end)) return;
      end = slot + count;
      j += count;
    }
  };
  const auto first_run = [&](int64_t i) {  // item i's first run of key rows
    Run<T> r{nullptr, 0};
    shares(i / Hkv, [&](int64_t slot, int64_t count, bool joined) {
      if (r.n > 0 && !joined) return false;
      if (r.n == 0) r.p = kp + (i % Hkv) * P * ks + slot * ks;
      r.n += count;
      return true;
    });
    return r;
  };
  each_item<Scratch<T>>(N * Hkv, cost, [&](int64_t i, int64_t after, Scratch<T>& t) {  // `after` runs next
    const int64_t n = i / Hkv, h = i % Hkv;
    const int64_t j0 = fp[n], j1 = sp[n];  // keys j0 <= j < j1 of the table
    t.keys.clear();
    t.values.clear();
    shares(n, [&](int64_t slot, int64_t count, bool joined) {
      if (joined) {  // the next block of the pool: the same run, read as one stream
        t.keys.back().n += count;
        t.values.back().n += count;
      } else {
        t.keys.push_back({kp + h * P * ks + slot * ks, count});
        t.values.push_back({vp + h * P * vs + slot * vs, count});
      }
      return true;
    });
    attend_head<T, Q, Q>(qp + i * G * D, t.keys, t.values, ks, vs, nullptr, std::max<int64_t>(j1 - j0, 0), G, D, Dv, scale, terms.cap,
                         terms.slopes_at(n, Hkv * G, h * G), terms.sinks_at(h * G), op + i * G * Dv, t,
                         after < 0 ? Run<T>{nullptr, 0} : first_run(after));
  });
}

// softcap: scores become softcap * tanh(score / softcap) (0: none); sinks: (H,) float32 logits, one a query head, or none;
// alibi: (1 or B, H) float32 slopes, the scores less slope * the key's distance from the query (at position S - 1), or none
// decode_attention over the first S slots of the caches k and v (S <= L; real (B, L) or none), the output in `dtype`: q's,
// or float32 for bfloat16 q (each value rounded to bfloat16 first, as .to(float32) of q's output would read it)
at::Tensor attend_first(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& real, int64_t S,
                        at::ScalarType dtype, double scale, double softcap, const std::optional<at::Tensor>& sinks,
                        const std::optional<at::Tensor>& alibi) {
  const ScoreTerms terms = score_terms("decode_attention", q.size(0), q.size(1), softcap, sinks, alibi);
  const at::Tensor qc = q.contiguous();
  const bool rows8 = k.scalar_type() == at::kChar;  // 8-bit rows (float32 queries)
  const bool widened = k.scalar_type() == at::kBFloat16 && dtype == at::kFloat;
  at::Tensor out = at::empty({q.size(0), q.size(1), 1, v.size(3) - (rows8 ? 4 : 0)}, q.options().dtype(widened ? at::kFloat : q.scalar_type()));  // (B, H, 1, Dv)
  const float s = static_cast<float>(scale);
  if (widened) {
    dense<c10::BFloat16, c10::BFloat16, float>(qc, k, v, real, S, out, s, terms);
  } else if (k.scalar_type() == at::kBFloat16) {
    dense<c10::BFloat16, c10::BFloat16>(qc, k, v, real, S, out, s, terms);
  } else if (rows8) {
    dense<int8_t, float>(qc, k, v, real, S, out, s, terms);
  } else {
    dense<float, float>(qc, k, v, real, S, out, s, terms);
  }
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& real,
                            double scale, double softcap, const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& alibi) {
  return attend_first(q, k, v, real, k.size(2), q.scalar_type(), scale, softcap, sinks, alibi);
}

// The terms as decode_attention's: sinks (H,), alibi (1 or N, H) for H = Hkv * G query heads, each key's distance from
// its sequence's query at position seen_to - 1
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& tables,
                                  const at::Tensor& seen_from, const at::Tensor& seen_to, int64_t block_size, double scale,
                                  double softcap, const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& alibi) {
  const ScoreTerms terms = score_terms("paged_decode_attention", q.size(0), q.size(1) * q.size(2), softcap, sinks, alibi);
  const at::Tensor qc = q.contiguous();
  const bool rows8 = k_pool.scalar_type() == at::kChar;  // 8-bit rows (float32 queries)
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v_pool.size(2) - (rows8 ? 4 : 0)}, q.options());  // (N, Hkv, G, Dv)
  const float s = static_cast<float>(scale);
  const bool bf16_pool = k_pool.scalar_type() == at::kBFloat16, bf16_q = q.scalar_type() == at::kBFloat16;
  if (rows8) {
    paged<int8_t, float>(qc, k_pool, v_pool, tables, seen_from, seen_to, block_size, out, s, terms);
  } else if (bf16_pool && bf16_q) {
    paged<c10::BFloat16, c10::BFloat16>(qc, k_pool, v_pool, tables, seen_from, seen_to, block_size, out, s, terms);
  } else if (bf16_pool) {
    paged<c10::BFloat16, float>(qc, k_pool, v_pool, tables, seen_from, seen_to, block_size, out, s, terms);
  } else if (bf16_q) {
    paged<float, c10::BFloat16>(qc, k_pool, v_pool, tables, seen_from, seen_to, block_size, out, s, terms);
  } else {
    paged<float, float>(qc, k_pool, v_pool, tables, seen_from, seen_to, block_size, out, s, terms);
  }
  return out;
}

// How at::addcmul_ rounds x + a * b in torch's kernels for this machine's CPU capability: once (a fused multiply-add:
// the AVX2 and AVX-512 kernels, as GCC builds them) or twice (the product, then the sum). Asked once of the op itself,
// on values where the two differ, in rope.rotate's layouts: a run of vectors and a scalar tail, a table shared by the
// rows and one per row. kNeither where it gave neither everywhere (then decode_step keeps the ATen ops).
enum class Rounding { kNeither, kOnce, kTwice };

Rounding addcmul_rounding() {
  static const Rounding answer = [] {
    const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat);
    bool once = true, twice = true;
    for (const int64_t rows : {1, 2}) {  // (1, R): one table for all rows; (B, 1, 1, R): a table per row
      const int64_t R = 80, h = R / 2, n = rows * 5 * R;  // h = 40: vectors, then a tail (as a head size of 80 would)
      const at::Tensor x = at::arange(n, f32).mul_(0.7373).sin_().mul_(3.f).view({rows, 5, 1, R});
      const at::Tensor table = at::arange(rows * R, f32).mul_(1.618).cos_().view(rows == 1 ? at::IntArrayRef{1, R} : at::IntArrayRef{rows, 1, 1, R});
      at::Tensor out = x * table;
      const at::Tensor before = out.clone();
      out.slice(-1, 0, h).addcmul_(x.slice(-1, h, R), table.slice(-1, 0, h));
      const at::Tensor o = out.contiguous(), b = before.contiguous(), t = table.expand_as(x).contiguous();
      for (int64_t i = 0; i < n; ++i) {
        if (i % R >= h) continue;
        const float a = b.data_ptr<float>()[i], p = x.data_ptr<float>()[i + h], c = t.data_ptr<float>()[i], got = o.data_ptr<float>()[i];
        volatile float product = p * c;  // (volatile: rounded on its own, not fused into the sum)
        once &= got == std::fma(p, c, a);
        twice &= got == a + product;
      }
    }
    return once ? Rounding::kOnce : twice ? Rounding::kTwice : Rounding::kNeither;
  }();
  return answer;
}

// x·cos + partner·sin, rounded as at::addcmul_ rounds (its product x·cos rounded first, as `work * cos` is)
template <Rounding mode>
inline float turn(float x, float c, float partner, float s) {
  if constexpr (mode == Rounding::kOnce) {
    return std::fma(partner, s, x * c);
  } else {
    volatile float first = x * c, product = partner * s;  // (volatile: each rounded on its own, neither fused into the sum)
    return first + product;
  }
}

// One row of D floats stored as the cache holds it: cast to S, or, for an 8-bit cache, rounded to int8 with the row's
// scale (max |x| / 127, after the values): x / scale rounded to nearest, ties to even, as torch.round; a row of zeros,
// or one holding inf or NaN, stored as zeros with its scale (0, inf or NaN: read back as 0 or NaN). The same bits as
// headwise.cache.quantize_rows.
template <typename S>
inline void store_row(const float* x, int64_t D, S* out) {
  if constexpr (std::is_same_v<S, int8_t>) {
    float top = 0.f;
    bool nan = false;
    for (int64_t d = 0; d < D; ++d) {
      nan |= std::isnan(x[d]);
      top = std::max(top, std::fabs(x[d]));
    }
    const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : top / 127.f;
    const bool zeros = !(scale > 0.f) || std::isinf(scale);
    for (int64_t d = 0; d < D; ++d) {
      out[d] = zeros ? int8_t{0} : static_cast<int8_t>(std::clamp(std::nearbyint(x[d] / scale), -127.f, 127.f));
    }
    __builtin_memcpy(out + D, &scale, sizeof scale);
  } else {
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<S>(x[d]);
  }
}

// What the kernel's queries are for a cache of S: S itself, or float32 for an 8-bit cache.
template <typename S>
using QueryOf = std::conditional_t<std::is_same_v<S, int8_t>, float, S>;

// Where row b's new token goes in a cache (B, Hkv, L, D): slot `start` of the row's own cache, or, for a paged pool
// seen as (1, Hkv, P, D) and rows that are sequences, slot `slots[b]` of the pool. Head i's row lies i * stride(1) on.
struct Slots {
  const int64_t* slots;  // nullptr: slot `start` of row b
  int64_t start;
  int64_t at(const at::Tensor& cache, int64_t b) const {
    return slots != nullptr ? slots[b] * cache.stride(2) : b * cache.stride(0) + start * cache.stride(2);
  }
};

// decode_step's rotation and write where its ATen ops would give these bits: q (B, H, 1, D) and k (B, Hkv, 1, D) in T,
// turned (where `c` is given) by float32 tables c and s ((1, D) or (B, 1, 1, D), rows contiguous, `row` apart) in
// float32 and rounded to T, then stored as the cache's S holds them: the queries (B, H, 1, D) for the kernel, the
// keys and v written at `where`.
template <typename T, typename S, Rounding mode>
void turn_and_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const float* c, const float* s, int64_t row,
                    at::Tensor& k_cache, at::Tensor& v_cache, const Slots& where, at::Tensor& queries) {
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), D = q.size(3), Dv = v.size(3), h = D / 2;
  QueryOf<S>* qo = queries.data_ptr<QueryOf<S>>();
  S* kc = k_cache.data_ptr<S>();
  S* vc = v_cache.data_ptr<S>();
  const auto at_slot = [&](S* cache, const at::Tensor& t, int64_t b, int64_t i) { return cache + where.at(t, b) + i * t.stride(1); };
  std::vector<float> work(std::max(D, Dv));
  for (int64_t b = 0; b < B; ++b) {
    const float* cb = c + b * row;
    const float* sb = s + b * row;
    const auto turned = [&](const T* x, float* out) {  // one head's D values, each rounded to T
      if (c == nullptr) {
        for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(x[d]);
        return;
      }
      for (int64_t d = 0; d < h; ++d) {
        const float x1 = static_cast<float>(x[d]), x2 = static_cast<float>(x[d + h]);
        out[d] = static_cast<float>(static_cast<T>(turn<mode>(x1, cb[d], x2, sb[d])));
        out[d + h] = static_cast<float>(static_cast<T>(turn<mode>(x2, cb[d + h], x1, sb[d + h])));
      }
    };
    for (int64_t i = 0; i < H; ++i) {
      turned(q.data_ptr<T>() + b * q.stride(0) + i * q.stride(1), work.data());
      store_row(work.data(), D, qo + (b * H + i) * D);
    }
    for (int64_t i = 0; i < Hkv; ++i) {
      turned(k.data_ptr<T>() + b * k.stride(0) + i * k.stride(1), work.data());
      store_row(work.data(), D, at_slot(kc, k_cache, b, i));
      const T* vr = v.data_ptr<T>() + b * v.stride(0) + i * v.stride(1);
      for (int64_t d = 0; d < Dv; ++d) work[d] = static_cast<float>(vr[d]);
      store_row(work.data(), Dv, at_slot(vc, v_cache, b, i));
    }
  }
}

// k (B, Hkv, 1, D) float32, rows contiguous, stored at `where` of an 8-bit cache (B, Hkv, L, D + 4) (store_row).
void store_rows8(const at::Tensor& k, at::Tensor& cache, const Slots& where) {
  const int64_t B = k.size(0), Hkv = k.size(1), D = k.size(3);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < Hkv; ++i) {
      store_row(k.data_ptr<float>() + b * k.stride(0) + i * k.stride(1), D, cache.data_ptr<int8_t>() + where.at(cache, b) + i * cache.stride(1));
    }
  }
}

// The queries after turn_and_write (in the cache's dtype; float32 for an 8-bit cache), or None where its conditions do
// not hold (then the ATen ops): float32 or bfloat16 q, k, v, and caches of either or 8-bit rows, rows contiguous; where tables are given, a whole-head rotation by float32
// tables of one row or one per row, and an addcmul_ whose rounding is known.
std::optional<at::Tensor> turned_and_written(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& cos,
                                             const std::optional<at::Tensor>& sin, at::Tensor& k_cache, at::Tensor& v_cache, const Slots& where) {
  const auto T = q.scalar_type(), S = k_cache.scalar_type();
  const auto ok = [](at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; };
  const int64_t B = q.size(0), D = q.size(3);
  if (!ok(T) || !(ok(S) || S == at::kChar) || k.scalar_type() != T || v.scalar_type() != T || v_cache.scalar_type() != S || k.size(3) != D
      || q.stride(3) != 1 || k.stride(3) != 1 || v.stride(3) != 1 || k_cache.stride(3) != 1 || v_cache.stride(3) != 1) {
    return std::nullopt;
  }
  const Rounding mode = cos.has_value() ? addcmul_rounding() : Rounding::kOnce;  // (no tables: no rounding to match)
  const float *c = nullptr, *s = nullptr;
  int64_t row = 0;
  if (cos.has_value()) {
    const at::Tensor &ct = *cos, &st = *sin;
    const bool shared = ct.dim() == 2 && ct.size(0) == 1, per_row = ct.dim() == 4 && ct.size(0) == B && ct.size(2) == 1;
    if (mode == Rounding::kNeither || D % 2 != 0 || ct.scalar_type() != at::kFloat || st.scalar_type() != at::kFloat
        || ct.sizes() != st.sizes() || ct.size(-1) != D || !ct.is_contiguous() || !st.is_contiguous() || !(shared || per_row)) {
      return std::nullopt;
    }
    c = ct.data_ptr<float>();
    s = st.data_ptr<float>();
    row = per_row ? D : 0;
  }
  at::Tensor queries = at::empty({B, q.size(1), 1, D}, q.options().dtype(S == at::kChar ? at::kFloat : S));  // (B, H, 1, D)
  const auto run = [&](auto t, auto s_) {
    using TT = decltype(t);
    using SS = decltype(s_);
    if (mode == Rounding::kOnce) {
      turn_and_write<TT, SS, Rounding::kOnce>(q, k, v, c, s, row, k_cache, v_cache, where, queries);
    } else {
      turn_and_write<TT, SS, Rounding::kTwice>(q, k, v, c, s, row, k_cache, v_cache, where, queries);
    }
  };
  const bool tf = T == at::kFloat, sf = S == at::kFloat;
  if (S == at::kChar) tf ? run(float{}, int8_t{}) : run(c10::BFloat16{}, int8_t{});
  else if (tf && sf) run(float{}, float{});
  else if (tf) run(float{}, c10::BFloat16{});
  else if (sf) run(c10::BFloat16{}, float{});
  else run(c10::BFloat16{}, c10::BFloat16{});
  return queries;
}

// turned_and_written's work in ATen ops, in the order the Python step runs them (where its loop would not give their
// bits): q and k turned as rope.rotate turns them, k and v written at `where` as the cache holds them (`slots` (B,):
// the pool's slots, else `where.start`) -> the queries in the cache's dtype (float32 for 8-bit rows).
at::Tensor turned_and_written_aten(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& cos,
                                   const std::optional<at::Tensor>& sin, at::Tensor& k_cache, at::Tensor& v_cache, const Slots& where,
                                   const std::optional<at::Tensor>& slots) {
  const auto stored = k_cache.scalar_type();
  at::Tensor queries = q, keys = k;
  if (cos.has_value()) {  // rope.rotate: x·cos, each half adding the other half's product in place
    const at::Tensor qk = at::cat({q, k}, 1);  // (B, H + Hkv, 1, D)
    const bool half = qk.scalar_type() == at::kBFloat16 || qk.scalar_type() == at::kHalf;
    const at::Tensor work = half ? qk.to(at::kFloat) : qk;  // (B, H + Hkv, 1, D) float32
    const int64_t h = cos->size(-1) / 2;
    at::Tensor out = work * *cos;
    out.slice(-1, 0, h).addcmul_(work.slice(-1, h, 2 * h), sin->slice(-1, 0, h));  // x1·cos - x2·sin
    out.slice(-1, h, 2 * h).addcmul_(work.slice(-1, 0, h), sin->slice(-1, h, 2 * h));  // x2·cos + x1·sin
    if (half) out = out.to(qk.scalar_type());
    queries = out.slice(1, 0, q.size(1));  // (B, H, 1, D)
    keys = out.slice(1, q.size(1), q.size(1) + k.size(1));  // (B, Hkv, 1, D)
  }
  if (stored == at::kChar) {  // 8-bit rows: rounded as turn_and_write rounds them, the queries in float32
    store_rows8(keys.to(at::kFloat).contiguous(), k_cache, where);
    store_rows8(v.to(at::kFloat).contiguous(), v_cache, where);
    return queries.to(at::kFloat);
  }
  if (slots.has_value()) {  // the pool (1, Hkv, P, D): row b's token at slot slots[b], as PagedBatch's index_copy_
    k_cache.select(0, 0).index_copy_(1, *slots, keys.select(2, 0).transpose(0, 1).to(stored));  // (Hkv, B, D)
    v_cache.select(0, 0).index_copy_(1, *slots, v.select(2, 0).transpose(0, 1).to(stored));
  } else {
    k_cache.slice(2, where.start, where.start + 1).copy_(keys.to(stored));
    v_cache.slice(2, where.start, where.start + 1).copy_(v.to(stored));
  }
  return queries.to(stored);
}

// A decode step's attention after its projections, in one call: q (B, H, 1, D), k (B, Hkv, 1, D) and v (B, Hkv, 1, Dv)
// (views of the projections' output), turned by (cos, sin) where given (rope.rotate's "rotate_half" of all D dims),
// written at slot `start` of the caches (B, Hkv, L, D) and (B, Hkv, L, Dv) in their dtype (8-bit rows: D + 4 and
// Dv + 4 int8, store_row), then the kernel over slots
// 0 .. start, `real` (B, L) marking the tokens where the cache holds padding, the terms (softcap, sinks, ALiBi) as
// decode_attention's -> (B, 1, H * Dv), the heads merged. The
// same bits as the Python steps it replaces (headwise.functional.decode_kernel_call): the rotation and the write in
// one loop that rounds as their ATen ops do (turned_and_written), else those ops in their order; one call where they
// were some twenty.
at::Tensor decode_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& cos,
                       const std::optional<at::Tensor>& sin, at::Tensor k_cache, at::Tensor v_cache,
                       const std::optional<at::Tensor>& real, int64_t start, double scale, double softcap,
                       const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& alibi) {
  const Slots where{nullptr, start};
  std::optional<at::Tensor> turned = turned_and_written(q, k, v, cos, sin, k_cache, v_cache, where);  // in one pass, or:
  if (!turned.has_value()) turned = turned_and_written_aten(q, k, v, cos, sin, k_cache, v_cache, where, std::nullopt);
  const at::Tensor context = attend_first(*turned, k_cache, v_cache, real, start + 1, q.scalar_type(), scale, softcap, sinks, alibi)
                                 .to(q.scalar_type());  // (B, H, 1, Dv) over slots 0 .. start (a float32 step over a bfloat16 cache: no copy)
  return context.transpose(1, 2).reshape({q.size(0), 1, -1});  // (B, 1, H * Dv)
}

// A paged batch's decode step after its projections, in one call, every sequence feeding one token: q (1, H, N, D),
// k (1, Hkv, N, D) and v (1, Hkv, N, Dv) (views of the projections' output, token n of sequence n), turned by (cos,
// sin) (1, 1, N, D) where given, written at the pools' `slots` (N,) (Hkv, P, D) and (Hkv, P, Dv) (8-bit rows as
// decode_step writes them), then the one call over the pool (paged_decode_attention): query `rows[n]` over its block
// table `tables[n]`, keys seen_to[n] - window .. seen_to[n] - 1 (from 0 without a window) -> (1, N, H * Dv), the
// heads merged; the terms as paged_decode_attention's. The same ops as the Python step (headwise.functional's paged batch path: PagedBatch's write, the
// queries gathered by rows in the pool's dtype and widened, the call, the context in the pool's dtype placed at the
// rows and rounded to q's): the same bits.
at::Tensor paged_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& cos,
                      const std::optional<at::Tensor>& sin, at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& slots,
                      const at::Tensor& rows, const at::Tensor& tables, const at::Tensor& seen_to, std::optional<int64_t> window,
                      int64_t block_size, double scale, double softcap, const std::optional<at::Tensor>& sinks,
                      const std::optional<at::Tensor>& alibi) {
  const int64_t H = q.size(1), N = q.size(2), D = q.size(3), Hkv = k.size(1);
  const at::Tensor qn = q.select(0, 0).transpose(0, 1).unsqueeze(2);  // (N, H, 1, D): sequence n as row n
  const at::Tensor kn = k.select(0, 0).transpose(0, 1).unsqueeze(2);  // (N, Hkv, 1, D)
  const at::Tensor vn = v.select(0, 0).transpose(0, 1).unsqueeze(2);  // (N, Hkv, 1, Dv)
  std::optional<at::Tensor> c, s;
  if (cos.has_value()) {
    c = cos->reshape({N, 1, 1, cos->size(-1)});  // (1, 1, N, D) -> (N, 1, 1, D): a table per row
    s = sin->reshape({N, 1, 1, sin->size(-1)});
  }
  at::Tensor kp = k_pool.unsqueeze(0), vp = v_pool.unsqueeze(0);  // (1, Hkv, P, D): the pool as one row's cache
  const at::Tensor at_slots = slots.contiguous();
  const Slots where{at_slots.data_ptr<int64_t>(), 0};
  std::optional<at::Tensor> turned = turned_and_written(qn, kn, vn, c, s, kp, vp, where);  // (N, H, 1, D) in one pass, or:
  if (!turned.has_value()) turned = turned_and_written_aten(qn, kn, vn, c, s, kp, vp, where, at_slots);
  const at::Tensor order = rows.contiguous();
  const int64_t* at_row = order.const_data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) TORCH_CHECK(at_row[n] >= 0 && at_row[n] < N, "paged_step: rows must index the batch's ", N, " tokens");
  const at::Tensor t = turned->contiguous();  // (N, H, 1, D) in the pool's dtype (float32 for 8-bit rows)
  TORCH_CHECK((t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "paged_step: q and the pool must be float32 or bfloat16 (or 8-bit rows), got ", q.scalar_type(), " and ", k_pool.scalar_type());
  at::Tensor queries = at::empty({N, Hkv, H / Hkv, D}, q.options().dtype(at::kFloat));  // (N, Hkv, G, D): row n is token rows[n], widened
  const int64_t width = H * D;
  const auto gather = [&](auto* src) {  // as index_select(0, rows) then .to(float32)
    float* qo = queries.data_ptr<float>();
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t i = 0; i < width; ++i) qo[n * width + i] = static_cast<float>(src[at_row[n] * width + i]);
    }
  };
  t.scalar_type() == at::kBFloat16 ? gather(t.const_data_ptr<c10::BFloat16>()) : gather(t.const_data_ptr<float>());
  const at::Tensor to = seen_to.contiguous();
  const at::Tensor from = window.has_value() ? (to - *window).clamp_min(0) : at::zeros_like(to);  // (N,)
  const at::Tensor out = paged_decode_attention(queries, k_pool, v_pool, tables.contiguous(), from, to, block_size, scale, softcap, sinks,
                                                alibi);  // (N, Hkv, G, Dv)
  const int64_t wide = N > 0 ? out.numel() / N : 0;  // H * Dv
  at::Tensor placed = at::empty({1, N, wide}, q.options());  // (1, N, H * Dv)
  const float* o = out.const_data_ptr<float>();
  const bool pool16 = k_pool.scalar_type() == at::kBFloat16;  // what the pool takes: bfloat16, else float32 (8-bit rows too)
  const auto place = [&](auto* dst) {  // each context rounded to what the pool takes, then to q's dtype, at its row (index_copy_)
    using Q = std::remove_pointer_t<decltype(dst)>;
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t i = 0; i < wide; ++i) {
        const float x = o[n * wide + i];
        dst[at_row[n] * wide + i] = static_cast<Q>(pool16 ? static_cast<float>(c10::BFloat16(x)) : x);
      }
    }
  };
  q.scalar_type() == at::kBFloat16 ? place(placed.data_ptr<c10::BFloat16>()) : place(placed.data_ptr<float>());
  return placed;  // (1, N, H * Dv): row rows[n] from n
}

}  // namespace

// addcmul_rounding's answer as a number (0 neither, 1 once, 2 twice), for the tests.
int64_t rotation_rounding() { return static_cast<int64_t>(addcmul_rounding()); }

TORCH_LIBRARY_IMPL(headwise, CompositeExplicitAutograd, m) { m.impl("rotation_rounding", &rotation_rounding); }

TORCH_LIBRARY_IMPL(headwise, CPU, m) {
  m.impl("decode_step", &decode_step);
  m.impl("decode_attention", &decode_attention);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_step", &paged_step);
}
