// A prompt's attention: T query rows per head over S keys, every key or causal (queries at positions S - T .. S - 1,
// each seeing the keys up to its own; with a window W, only the last W of them), in float32 throughout, a block of keys at a time with the softmax carried
// along (flash attention's online rescaling). Each item is one head's block of QUERY_ROWS queries, held transposed
// (16 queries to a vector); each key block is widened once into the item's scratch. Scores: 32 queries x 8 keys of
// sums in registers, a key's value broadcast against 16 queries' values at a time (no transposed keys); the softmax
// of 16 queries at a time, along their lanes; the context: 4 queries x 64 values of sums in registers over the
// block's keys (then the rest of a head of 80 or 96). Head sizes: 32, 64, 80, 96, 128, 256, each built on its own. A
// causal item reads only the keys its queries see, and skips what a tile's queries do not reach (past
// its last query, before its first query's window). A head's sink logit (gpt-oss's) joins each row's sum at the end.
// Padded keys (a row's flags, False = padding) are seen by no query: those before its first real key and after its
// last are not read, those between are masked. A softcap (Gemma 2's) takes each score to cap * tanh(score / cap), and
// ALiBi (BLOOM's, MPT's) takes slope * |the query's position - the key's| from it.
// bfloat16 on a CPU with AVX512-BF16 (the library built for AVX-512): the scores from the queries and keys as they are,
// each pair of the head's elements by one vdpbf16ps (its two products exact in float32, added to the float32 sums),
// the keys not widened; the softmax and the context as above.
// Built by headwise.backends.prefill_kernel's first call.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "vectors.h"

namespace {

using namespace headwise_vectors;

constexpr int64_t QUERY_ROWS = 64;  // queries an item takes: each key block widened once for them
constexpr int64_t KEY_BLOCK = 64;   // keys a block: keys and values of 64 keys in float32 stay in L2 at D = 64 to 256
constexpr int64_t LANES = 16;       // queries a vector of scores holds
constexpr int KEYS = 8;             // keys a score tile sums at once (x 2 vectors of queries: 16 sums in registers)
#ifdef __AVX512F__
constexpr int ROWS = 4;  // queries a context tile: 4 x 4 vectors of sums + 4 loaded, of 32 registers
#else
constexpr int ROWS = 1;  // 16 registers: one query at a time
#endif
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Scratch {
  std::vector<float> qt, k, v, w, acc, top, total, alpha;
  std::vector<uint32_t> pairs;  // bfloat16 queries in pairs (scores_pairs)
};

template <typename T>
inline void widen_row(const T* p, int64_t n, float* out) {  // n a multiple of 16
  for (int64_t d = 0; d < n; d += 16) {
    const f16v x = load16(p + d);
    __builtin_memcpy(out + d, &x, sizeof x);
  }
}

inline void store16(float* p, f16v x) { __builtin_memcpy(p, &x, sizeof x); }

inline f16v lane_index() {
  f16v x;
  for (int i = 0; i < 16; ++i) x[i] = static_cast<float>(i);
  return x;
}

// w[j * QUERY_ROWS + r] = scale * q[r] . key j for 2 vectors of queries (qt: the item's queries transposed, offset to
// the first; w offset likewise) and KEYS keys from k (rows of D): each sum taken over SPAN elements of the head size
// in registers (the last span the rest of the head: 16 at D = 80), the spans' sums added in order (a chain of D / SPAN
// + SPAN roundings, not D: float32 error as a blocked GEMM's, where the head is wide and the scores large)
constexpr int SPAN = 32;
template <int D>
inline void scores_tile(const float* qt, const float* k, float scale, float* w) {
  static_assert(D % 16 == 0, "head sizes are multiples of 16");
  for (int d0 = 0; d0 < D; d0 += SPAN) {
    f16v s[2][KEYS] = {};
    const int end = D % SPAN == 0 ? d0 + SPAN : std::min(d0 + SPAN, D);  // (a whole span where every span is: the same loops)
    for (int d = d0; d < end; ++d) {
      const f16v a = load16(qt + d * QUERY_ROWS), b = load16(qt + d * QUERY_ROWS + LANES);
      for (int j = 0; j < KEYS; ++j) {
        const float x = k[j * D + d];
        s[0][j] += a * x;
        s[1][j] += b * x;
      }
    }
    for (int j = 0; j < KEYS; ++j) {
      for (int h = 0; h < 2; ++h) {
        float* out = w + j * QUERY_ROWS + h * LANES;
        const f16v sum = d0 == 0 ? s[h][j] : load16(out) + s[h][j];
        store16(out, d0 + SPAN >= D ? sum * scale : sum);
      }
    }
  }
}

#if defined(__x86_64__) && defined(__AVX512F__)
#define HEADWISE_PAIRS 1
// The CPU runs AVX512-BF16's pair dot products (asked of the CPU, once).
bool pairs_here() {
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
}

// scores_tile for bfloat16 queries and keys: pairs holds the item's queries two elements of the head to a 32-bit word,
// (D / 2, QUERY_ROWS) (offset to the first query); k the first key's row (row stride ks), rows past `last` read as row
// `last` (their scores are never used). Each pair's two products (exact in float32) added to the float32 sums by one
// vdpbf16ps, over SPAN elements in registers, the spans' sums added in order.
template <int D>
__attribute__((target("avx512f,avx512bf16"))) void scores_pairs(const uint32_t* pairs, const c10::BFloat16* k, int64_t ks, int64_t last,
                                                              float scale, float* w) {
  static_assert(D % 16 == 0, "head sizes are multiples of 16");
  const c10::BFloat16* rows[KEYS];
  for (int j = 0; j < KEYS; ++j) rows[j] = k + std::min<int64_t>(j, last) * ks;
  for (int d0 = 0; d0 < D; d0 += SPAN) {
    __m512 s[2][KEYS];
    for (int j = 0; j < KEYS; ++j) s[0][j] = s[1][j] = _mm512_setzero_ps();
    const int end = D % SPAN == 0 ? d0 + SPAN : std::min(d0 + SPAN, D);
    for (int p = d0 / 2; p < end / 2; ++p) {
      const __m512bh a = (__m512bh)_mm512_loadu_si512(pairs + p * QUERY_ROWS);
      const __m512bh b = (__m512bh)_mm512_loadu_si512(pairs + p * QUERY_ROWS + LANES);
      for (int j = 0; j < KEYS; ++j) {
        int32_t pair;
        std::memcpy(&pair, rows[j] + 2 * p, sizeof pair);
        const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
        s[0][j] = _mm512_dpbf16_ps(s[0][j], a, x);
        s[1][j] = _mm512_dpbf16_ps(s[1][j], b, x);
      }
    }
    for (int j = 0; j < KEYS; ++j) {
      for (int h = 0; h < 2; ++h) {
        float* out = w + j * QUERY_ROWS + h * LANES;
        const __m512 sum = d0 == 0 ? s[h][j] : _mm512_add_ps(_mm512_loadu_ps(out), s[h][j]);
        _mm512_storeu_ps(out, d0 + SPAN >= D ? _mm512_mul_ps(sum, _mm512_set1_ps(scale)) : sum);
      }
    }
  }
}
#else
bool pairs_here() { return false; }
#endif

// The softmax carried over one more block for 16 queries (w offset to them, rows j < n of their scores): key j is seen
// by lane i where j < n and, causal, c0 + j <= pos + i (pos the first lane's position), and with a window W > 0 also
// c0 + j > pos + i - W (a padded key's scores are -inf already). Scores become the weights exp(score - new max), 0
// where not seen (a score not computed, of a key before every lane's window, is never read); top, total their running
// max and sum; alpha the old sums' factor.
inline void carry(float* w, int64_t n, bool causal, int64_t window, int64_t c0, int64_t pos, float* top, float* total,
                  float* alpha) {
  const f16v lanes = lane_index(), ninf = f16v{} + NEG_INF;
  const f16v old = load16(top);
  f16v m = old;
  for (int64_t j = 0; j < n; ++j) {
    f16v x = load16(w + j * QUERY_ROWS);
    if (causal) x = lanes >= static_cast<float>(c0 + j - pos) ? x : ninf;  // lane i sees key c0 + j from position c0 + j on
    if (window > 0) x = lanes < static_cast<float>(c0 + j - pos + window) ? x : ninf;  // ... up to position c0 + j + W - 1
    store16(w + j * QUERY_ROWS, x);
    m = m > x ? m : x;  // (a NaN score stays in x: NaN through to the context, as any kernel gives)
  }
  const f16v none = m == ninf ? f16v{} + 1.f : f16v{};  // lanes that have seen no key yet: nothing to add
  const f16v a = none != 0.f ? f16v{} + 1.f : exp16(old - m);
  f16v sum = {};
  for (int64_t j = 0; j < n; ++j) {
    const f16v x = load16(w + j * QUERY_ROWS);
    const f16v e = x == ninf ? f16v{} : exp16(x - m);
    store16(w + j * QUERY_ROWS, e);
    sum += e;
  }
  store16(total, load16(total) * a + sum);
  store16(top, m);
  store16(alpha, a);
}

// context_tile's last C * 16 values of a head of D (80 or 96: what 64 at a time leaves), the same sums
template <int R, int C>
__attribute__((noinline)) void context_rest(const float* w, const float* v, int64_t n, int64_t D, const float* alpha, float* acc) {
  const int64_t h = D - 16 * C;
  f16v a[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) a[r][c] = load16(acc + r * D + h + 16 * c) * alpha[r];
  }
  for (int64_t j = 0; j < n; ++j) {
    f16v x[C];
    for (int c = 0; c < C; ++c) x[c] = load16(v + j * D + h + 16 * c);
    for (int r = 0; r < R; ++r) {
      const float p = w[j * QUERY_ROWS + r];
      if (p == 0.f) continue;
      for (int c = 0; c < C; ++c) a[r][c] += p * x[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) store16(acc + r * D + h + 16 * c, a[r][c]);
  }
}

// acc[r] = acc[r] * alpha[r] + sum_j w[j * QUERY_ROWS + r] * v[j] for R queries (w, alpha, acc offset to the first),
// keys j < n, 64 values at a time (then context_rest's, at D = 32, 80 or 96); a key of weight 0 (one a query does not
// see) is skipped: its value may hold anything. (The rest apart: in this loop it cost heads of 64-256 5-10% here.)
template <int R>
inline void context_tile(const float* w, const float* v, int64_t n, int64_t D, const float* alpha, float* acc) {
  if (D % 64 == 16) context_rest<R, 1>(w, v, n, D, alpha, acc);
  if (D % 64 == 32) context_rest<R, 2>(w, v, n, D, alpha, acc);
  for (int64_t h = 0; h + 64 <= D; h += 64) {
    f16v a[R][4];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < 4; ++c) a[r][c] = load16(acc + r * D + h + 16 * c) * alpha[r];
    }
    for (int64_t j = 0; j < n; ++j) {
      f16v x[4];
      for (int c = 0; c < 4; ++c) x[c] = load16(v + j * D + h + 16 * c);
      for (int r = 0; r < R; ++r) {
        const float p = w[j * QUERY_ROWS + r];
        if (p == 0.f) continue;
        for (int c = 0; c < 4; ++c) a[r][c] += p * x[c];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < 4; ++c) store16(acc + r * D + h + 16 * c, a[r][c]);
    }
  }
}

template <int D, typename T>
void item(const T* q, int64_t qs, const T* k, int64_t ks, const T* v, int64_t vs, T* out, int64_t os, int64_t rows,
          int64_t first, int64_t lo, int64_t keys, bool causal, int64_t window, const bool* real, float scale, float sink,
          float cap, float slope, Scratch& t) {
  // q: the item's first query row (stride qs), first: its position; lo .. keys - 1: the keys it reads (lo > 0: those
  // before its first query's window, or padding, left out); real: the row's key flags (nullptr: every key real); sink:
  // the head's sink logit (-inf: none); cap: the scores' softcap (0: none); slope: the head's ALiBi slope (0: none)
  constexpr bool half = std::is_same_v<T, c10::BFloat16>;
  const bool pairs = half && pairs_here();  // the scores by vdpbf16ps from the bfloat16 queries and keys
  if (!pairs) {
    t.qt.assign(D * QUERY_ROWS, 0.f);
    t.k.assign(KEY_BLOCK * D, 0.f);
  }
  t.acc.assign(QUERY_ROWS * D, 0.f);
  t.top.assign(QUERY_ROWS, NEG_INF);
  t.total.assign(QUERY_ROWS, 0.f);
  t.alpha.assign(QUERY_ROWS, 1.f);
  t.v.resize(KEY_BLOCK * D);
  t.w.resize(KEY_BLOCK * QUERY_ROWS);
  if (pairs) {  // the queries in pairs once: (D / 2, QUERY_ROWS), element 2p in a word's low half
    t.pairs.assign(D / 2 * QUERY_ROWS, 0u);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t p = 0; p < D / 2; ++p) std::memcpy(&t.pairs[p * QUERY_ROWS + r], q + r * qs + 2 * p, sizeof(uint32_t));
    }
  } else {
    for (int64_t r = 0; r < rows; ++r) {  // the queries transposed once: (D, QUERY_ROWS)
      for (int64_t d = 0; d < D; ++d) t.qt[d * QUERY_ROWS + r] = static_cast<float>(q[r * qs + d]);
    }
  }
  for (int64_t c0 = lo; c0 < keys; c0 += KEY_BLOCK) {
    const int64_t n = std::min(KEY_BLOCK, keys - c0);
    for (int64_t j = 0; j < n; ++j) {  // the block widened, keys (but for the pairs) and values as rows
      if (!pairs) widen_row(k + (c0 + j) * ks, D, t.k.data() + j * D);
      widen_row(v + (c0 + j) * vs, D, t.v.data() + j * D);
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 2 * LANES) {  // scores, 32 queries x KEYS keys a tile
      const int64_t last = first + std::min(r0 + 2 * LANES, rows) - 1;  // the tile's last real query's position
      for (int64_t j0 = 0; j0 < n; j0 += KEYS) {
        if (causal && c0 + j0 > last) break;  // these keys and the rest of the block lie past the tile's queries
        if (window > 0 && c0 + j0 + KEYS <= first + r0 - window + 1) continue;  // before the tile's first query's window
        float* w = t.w.data() + j0 * QUERY_ROWS + r0;
#ifdef HEADWISE_PAIRS
        if constexpr (half) {
          if (pairs) {
            scores_pairs<D>(t.pairs.data() + r0, k + (c0 + j0) * ks, ks, n - 1 - j0, scale, w);
            continue;
          }
        }
#endif
        scores_tile<D>(t.qt.data() + r0, t.k.data() + j0 * D, scale, w);
      }
    }
    for (int64_t j = 0; cap > 0.f && j < n; ++j) {  // capped: cap * tanh(score / cap) (scores not computed are masked later)
      for (int64_t r0 = 0; r0 < rows; r0 += LANES) {
        float* w = t.w.data() + j * QUERY_ROWS + r0;
        store16(w, cap * tanh16(load16(w) * (1.f / cap)));
      }
    }
    for (int64_t j = 0; slope != 0.f && j < n; ++j) {  // ALiBi: less slope * |the query's position - the key's|
      for (int64_t r0 = 0; r0 < rows; r0 += LANES) {
        float* w = t.w.data() + j * QUERY_ROWS + r0;
        const f16v d = lane_index() + static_cast<float>(first + r0 - (c0 + j));  // (exact: positions below 2^24)
        store16(w, load16(w) - slope * (d < 0.f ? -d : d));
      }
    }
    for (int64_t j = 0; real != nullptr && j < n; ++j) {  // a padded key's scores (which may be anything): seen by no query
      if (!real[c0 + j]) std::fill_n(t.w.data() + j * QUERY_ROWS, QUERY_ROWS, NEG_INF);
    }
    for (int64_t r0 = 0; r0 < rows; r0 += LANES) {  // the softmax, 16 queries at a time
      const int64_t seen = causal ? std::min(n, first + std::min(r0 + LANES, rows) - c0) : n;  // keys any of them sees
      carry(t.w.data() + r0, std::max<int64_t>(seen, 0), causal, window, c0, first + r0, t.top.data() + r0,
            t.total.data() + r0, t.alpha.data() + r0);
    }
    for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {  // the context, ROWS queries at a time
      const int64_t most = causal ? std::min(n, first + std::min(r0 + ROWS, rows) - c0) : n;  // keys its last query sees
      context_tile<ROWS>(t.w.data() + r0, t.v.data(), std::max<int64_t>(most, 0), D, t.alpha.data() + r0,
                         t.acc.data() + r0 * D);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // the sink joins the sum: exp(sink) beside the keys', no value (a row of no key: 0)
    const float top = t.top[r], most = std::max(top, sink);
    const float keep = std::exp(top - most);  // the keys' share of the larger of the two maxima (NaN: no key)
    const float inv = t.total[r] > 0.f && keep > 0.f ? keep / (t.total[r] * keep + std::exp(sink - most)) : 0.f;
    for (int64_t d = 0; d < D; ++d) out[r * os + d] = static_cast<T>(t.acc[r * D + d] * inv);
  }
}

// The first key the queries from position `first` on see: with a window W (> 0), first - W + 1 (not below 0), else 0
inline int64_t first_key(int64_t first, int64_t window) { return window > 0 ? std::max<int64_t>(0, first - window + 1) : 0; }

// What a call adds to its scores and softmax: each may be none
struct Terms {
  ScoreTerms scores;  // the softcap, sinks and ALiBi's slopes
  const bool* real;   // (B, S) key flags, or nullptr
};

// q (B, H, T, D), k (B, Hkv, S, D), v (B, Hkv, S, D), rows contiguous; out (B, H, T, D), stored as (B, T, H, D)
template <typename T>
void prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, int64_t window, float scale,
             const Terms& terms, at::Tensor& out) {
  const bool* real = terms.real;
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2), G = H / Hkv;
  const int64_t blocks = (Tq + QUERY_ROWS - 1) / QUERY_ROWS, off = S - Tq;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  std::vector<int64_t> start(B, 0), end(B, S);  // each row's keys from its first real one to its last (all, unpadded)
  for (int64_t b = 0; real != nullptr && b < B; ++b) {
    const bool* r = real + b * S;
    while (start[b] < S && !r[start[b]]) ++start[b];
    while (end[b] > start[b] && !r[end[b] - 1]) --end[b];
  }
  auto span = [&](int64_t b, int64_t r0, int64_t rows) {  // the keys [lo, keys) a block of rows from r0 reads
    const int64_t keys = std::min(end[b], causal ? std::min(S, off + r0 + rows) : S);
    return std::pair<int64_t, int64_t>(std::max(start[b], first_key(off + r0, window)), keys);
  };
  std::vector<int64_t> cost(B * H * blocks);
  for (int64_t i = 0; i < B * H * blocks; ++i) {  // keys read: a causal block's grow with its last query (from its window)
    const int64_t r0 = i % blocks * QUERY_ROWS;
    const auto [lo, keys] = span(i / (H * blocks), r0, std::min(QUERY_ROWS, Tq - r0));
    cost[i] = std::max<int64_t>(keys - lo, 0);
  }
  each_item<Scratch>(B * H * blocks, cost, [&](int64_t i, Scratch& t) {
    const int64_t b = i / (H * blocks), h = i / blocks % H, r0 = i % blocks * QUERY_ROWS;
    const int64_t rows = std::min(QUERY_ROWS, Tq - r0), hk = h / G;
    const T* qi = qp + b * q.stride(0) + h * q.stride(1) + r0 * q.stride(2);
    const T* ki = kp + b * k.stride(0) + hk * k.stride(1);
    const T* vi = vp + b * v.stride(0) + hk * v.stride(1);
    T* oi = op + ((b * Tq + r0) * H + h) * D;  // (B, T, H, D) storage: the heads' merge is a view
    const auto [lo, keys] = span(b, r0, rows);
    const bool* flags = real != nullptr ? real + b * S : nullptr;
    const float* sink_at = terms.scores.sinks_at(h);
    const float* slope_at = terms.scores.slopes_at(b, H, h);
    const float sink = sink_at != nullptr ? *sink_at : NEG_INF, slope = slope_at != nullptr ? *slope_at : 0.f;
    auto head = [&](auto size) {  // the item for this head size, known when compiled
      item<decltype(size)::value, T>(qi, q.stride(2), ki, k.stride(2), vi, v.stride(2), oi, H * D, rows, off + r0, lo, keys, causal,
                                     window, flags, scale, sink, terms.scores.cap, slope, t);
    };
    switch (D) {  // HEAD_SIZES
      case 32: head(std::integral_constant<int, 32>{}); break;
      case 64: head(std::integral_constant<int, 64>{}); break;
      case 80: head(std::integral_constant<int, 80>{}); break;
      case 96: head(std::integral_constant<int, 96>{}); break;
      case 128: head(std::integral_constant<int, 128>{}); break;
      default: head(std::integral_constant<int, 256>{});
    }
  });
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                             int64_t window, const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& real,
                             double softcap, const std::optional<at::Tensor>& alibi) {
  // window: W > 0 (causal only) for each query's last W keys, 0 for every key the causal rule leaves; sinks: (H,) float32
  // logits, one per query head, that join each row's softmax with no value (gpt-oss's), or none; real: (B, S) bool,
  // False = a padded key no query sees, or none (every key real); softcap: scores become softcap * tanh(score / softcap)
  // (Gemma 2's), 0 for none; alibi: (1 or B, H) float32 slopes, each score less slope * |the query's position - the
  // key's|, or none
  TORCH_CHECK(window >= 0 && (window == 0 || causal), "prefill_attention: a window W > 0 needs causal, or 0 for none, got ", window);
  const int64_t D = q.size(3);
  TORCH_CHECK((D == 32 || D == 64 || D == 80 || D == 96 || D == 128 || D == 256) && k.size(3) == D && v.size(3) == D,
              "prefill_attention: queries, keys and values of one head size 32, 64, 80, 96, 128 or 256, got ", D, ", ", k.size(3), ", ",
              v.size(3));
  TORCH_CHECK(!real.has_value() || (real->scalar_type() == at::kBool && real->is_contiguous() && real->dim() == 2 &&
                                    real->size(0) == q.size(0) && real->size(1) == k.size(2)),
              "prefill_attention: real must be a contiguous bool (B, S) tensor, False = a padded key");
  const Terms terms{score_terms("prefill_attention", q.size(0), q.size(1), softcap, sinks, alibi),
                    real.has_value() ? real->data_ptr<bool>() : nullptr};
  // (B, H, T, Dv) as a view of (B, T, H, Dv): what merging the heads reads without a copy (as torch's flash kernel gives it)
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), v.size(3)}, q.options()).transpose(1, 2);
  if (q.scalar_type() == at::kBFloat16) {
    prefill<c10::BFloat16>(q, k, v, causal, window, static_cast<float>(scale), terms, out);
  } else {
    prefill<float>(q, k, v, causal, window, static_cast<float>(scale), terms, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(headwise, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
