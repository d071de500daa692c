// A prompt's attention: T query rows per head over S keys, every key or causal (queries at positions S - T .. S - 1,
// each seeing the keys up to its own), in float32 throughout, a block of keys at a time with the softmax carried
// along (flash attention's online rescaling). Each item is one head's block of QUERY_ROWS queries: a key block
// is widened once into the item's scratch (keys transposed, values as rows), then every tile of ROWS queries
// takes it: scores as ROWS x KEY_BLOCK sums in registers over the head size, the running max and sum, the
// context as ROWS x 64 sums in registers over the block's keys. A causal item reads only the keys its rows see,
// and a tile skips a block its rows do not reach. Built by headwise.backends.prefill_kernel's first call.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "vectors.h"

namespace {

using namespace headwise_vectors;

constexpr int64_t QUERY_ROWS = 64;  // queries an item takes: each key block widened once for them
constexpr int64_t KEY_BLOCK = 64;   // keys a block: K^T and V of 64 keys in float32 stay in L1/L2 at D = 64 or 128
#ifdef __AVX512F__
constexpr int ROWS = 4;  // queries a tile: 4 x 4 score vectors, or 4 x 4 context vectors, + 4 loaded: 20 of 32 registers
#else
constexpr int ROWS = 1;  // 16 registers: one query at a time
#endif
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Scratch {
  std::vector<float> q, kt, v, w, acc, top, total, alpha;
};

template <typename T>
inline void widen_row(const T* p, int64_t n, float* out) {  // n a multiple of 16
  for (int64_t d = 0; d < n; d += 16) {
    const f16v x = load16(p + d);
    __builtin_memcpy(out + d, &x, sizeof x);
  }
}

// w[r * KEY_BLOCK + j] = scale * q[r] . key j for the tile's R rows and the block's 64 keys, kt the keys transposed (D, 64)
template <int R, int D>
inline void scores_tile(const float* q, const float* kt, float scale, float* w) {
  f16v s[R][4] = {};
  for (int d = 0; d < D; ++d) {
    f16v k[4];
    for (int c = 0; c < 4; ++c) k[c] = load16(kt + d * KEY_BLOCK + 16 * c);
    for (int r = 0; r < R; ++r) {
      const float x = q[r * D + d];
      for (int c = 0; c < 4; ++c) s[r][c] += x * k[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < 4; ++c) {
      const f16v y = s[r][c] * scale;
      __builtin_memcpy(w + r * KEY_BLOCK + 16 * c, &y, sizeof y);
    }
  }
}

// acc[r] = acc[r] * alpha[r] + sum_j w[r * KEY_BLOCK + j] * v[j] for the tile's R rows, keys j < n, 64 values at a time;
// a key of weight 0 (one a row does not see) is skipped: its value row may hold anything
template <int R>
inline void context_tile(const float* w, const float* v, int64_t n, int64_t D, const float* alpha, float* acc) {
  for (int64_t h = 0; h < D; h += 64) {
    f16v a[R][4];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < 4; ++c) a[r][c] = load16(acc + r * D + h + 16 * c) * alpha[r];
    }
    for (int64_t j = 0; j < n; ++j) {
      f16v x[4];
      for (int c = 0; c < 4; ++c) x[c] = load16(v + j * D + h + 16 * c);
      for (int r = 0; r < R; ++r) {
        const float p = w[r * KEY_BLOCK + j];
        if (p == 0.f) continue;
        for (int c = 0; c < 4; ++c) a[r][c] += p * x[c];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < 4; ++c) __builtin_memcpy(acc + r * D + h + 16 * c, &a[r][c], sizeof a[r][c]);
    }
  }
}

// The softmax carried over one more block for row r of a tile: keys j < seen of w's row are its scores (the others
// -inf); top and total the row's running max and sum; w's row becomes exp(score - new max); alpha the old sums' factor.
inline void carry(float* w, int64_t seen, float& top, float& total, float& alpha) {
  for (int64_t j = std::max<int64_t>(seen, 0); j < KEY_BLOCK; ++j) w[j] = NEG_INF;
  float m = top;
  for (int64_t j = 0; j < seen; ++j) m = std::max(m, w[j]);
  if (m == NEG_INF) {  // no key seen yet: nothing to add
    alpha = 1.f;
    std::fill(w, w + KEY_BLOCK, 0.f);
    return;
  }
  alpha = top == NEG_INF ? 0.f : std::exp(top - m);
  f16v sum = {};
  for (int64_t j = 0; j < KEY_BLOCK; j += 16) {
    const f16v e = exp16(load16(w + j) - m);
    __builtin_memcpy(w + j, &e, sizeof e);
    sum += e;
  }
  total = total * alpha + sum16(sum);
  top = m;
}

template <int D, typename T>
void item(const T* q, int64_t qs, const T* k, int64_t ks, const T* v, int64_t vs, T* out, int64_t os, int64_t rows,
          int64_t first, int64_t keys, bool causal, float scale, Scratch& t) {
  // q: the item's first query row (stride qs), first: its position; keys: the keys it reads (0 .. keys - 1)
  const int64_t padded = (rows + ROWS - 1) / ROWS * ROWS;
  t.q.assign(padded * D, 0.f);
  t.acc.assign(padded * D, 0.f);
  t.top.assign(padded, NEG_INF);
  t.total.assign(padded, 0.f);
  t.alpha.resize(ROWS);
  t.kt.resize(D * KEY_BLOCK);
  t.v.resize(KEY_BLOCK * D);
  t.w.resize(ROWS * KEY_BLOCK);
  for (int64_t r = 0; r < rows; ++r) widen_row(q + r * qs, D, t.q.data() + r * D);
  for (int64_t c0 = 0; c0 < keys; c0 += KEY_BLOCK) {
    const int64_t n = std::min(KEY_BLOCK, keys - c0);
    for (int64_t j = 0; j < n; ++j) {  // the block widened: keys transposed (D, 64), values as rows (64, D)
      const T* kr = k + (c0 + j) * ks;
      for (int64_t d = 0; d < D; ++d) t.kt[d * KEY_BLOCK + j] = static_cast<float>(kr[d]);
      widen_row(v + (c0 + j) * vs, D, t.v.data() + j * D);
    }
    for (int64_t j = n; j < KEY_BLOCK; ++j) {
      for (int64_t d = 0; d < D; ++d) t.kt[d * KEY_BLOCK + j] = 0.f;  // scores of no key: masked below
    }
    for (int64_t i0 = 0; i0 < padded; i0 += ROWS) {
      const int64_t last = first + std::min(i0 + ROWS, rows) - 1;  // the tile's last real query's position
      if (causal && c0 > last) continue;  // the block lies past every key the tile's rows see (a later tile's may not)
      scores_tile<ROWS, D>(t.q.data() + i0 * D, t.kt.data(), scale, t.w.data());
      for (int r = 0; r < ROWS; ++r) {
        const int64_t seen = causal ? std::min(n, first + i0 + r - c0 + 1) : n;  // keys of the block row r sees
        carry(t.w.data() + r * KEY_BLOCK, seen, t.top[i0 + r], t.total[i0 + r], t.alpha[r]);
      }
      const int64_t most = causal ? std::min(n, last - c0 + 1) : n;  // keys of the block the tile's last real row sees
      context_tile<ROWS>(t.w.data(), t.v.data(), most, D, t.alpha.data(), t.acc.data() + i0 * D);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = t.total[r] > 0.f ? 1.f / t.total[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[r * os + d] = static_cast<T>(t.acc[r * D + d] * inv);
  }
}

// q (B, H, T, D), k (B, Hkv, S, D), v (B, Hkv, S, D), rows contiguous; out (B, H, T, D) contiguous
template <typename T>
void prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2), G = H / Hkv;
  const int64_t blocks = (Tq + QUERY_ROWS - 1) / QUERY_ROWS, off = S - Tq;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  std::vector<int64_t> cost(B * H * blocks);
  for (int64_t i = 0; i < B * H * blocks; ++i) {  // keys read: a causal block's grow with its last query
    cost[i] = causal ? std::min(S, off + std::min(Tq, (i % blocks + 1) * QUERY_ROWS)) : S;
  }
  each_item<Scratch>(B * H * blocks, cost, [&](int64_t i, Scratch& t) {
    const int64_t b = i / (H * blocks), h = i / blocks % H, r0 = i % blocks * QUERY_ROWS;
    const int64_t rows = std::min(QUERY_ROWS, Tq - r0), hk = h / G;
    const T* qi = qp + b * q.stride(0) + h * q.stride(1) + r0 * q.stride(2);
    const T* ki = kp + b * k.stride(0) + hk * k.stride(1);
    const T* vi = vp + b * v.stride(0) + hk * v.stride(1);
    T* oi = op + ((b * H + h) * Tq + r0) * D;
    const int64_t keys = causal ? std::min(S, off + r0 + rows) : S;
    if (D == 64) {
      item<64, T>(qi, q.stride(2), ki, k.stride(2), vi, v.stride(2), oi, D, rows, off + r0, keys, causal, scale, t);
    } else {
      item<128, T>(qi, q.stride(2), ki, k.stride(2), vi, v.stride(2), oi, D, rows, off + r0, keys, causal, scale, t);
    }
  });
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale) {
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());  // (B, H, T, Dv)
  if (q.scalar_type() == at::kBFloat16) {
    prefill<c10::BFloat16>(q, k, v, causal, static_cast<float>(scale), out);
  } else {
    prefill<float>(q, k, v, causal, static_cast<float>(scale), out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(headwise, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
