// A float32 GEMM for the few rows of a decode step: out (M, N) = x (M, K) . weight (N, K)^T + bias,
// over the weight packed once in panels of 32 output columns, k-major (pack_panels: (ceil(N/32), K, 32),
// the last panel zero-padded). Each panel is read from memory once, a step of k at a time (one
// 128-byte line), while ROWS rows of x, broadcast one value at a time, are multiplied into ROWS x 32
// float32 sums held in registers; more rows take the panel again from the core's cache. Sums run
// over k in order, in float32. The panels are split between torch's threads. Built at run time by
// headwise.native with the instruction set torch's own kernels use; the ops' schemas and checks
// live on the Python side (headwise.linear.panels).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace {

#if defined(__AVX512F__)
constexpr int LANES = 16;   // floats per register
constexpr int ROWS = 8;     // 8 rows x 2 registers of sums: 16 of the 32 registers
#else
constexpr int LANES = 8;    // AVX2 (or the compiler's own split of 8-float vectors)
constexpr int ROWS = 2;     // 2 rows x 4 registers of sums: 8 of the 16 registers
#endif
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
constexpr int64_t PANEL = 32;           // output columns per panel
constexpr int VECS = PANEL / LANES;     // registers per row of a panel

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}


// sums (M, PANEL) = x (M rows, row stride K) . panel (K, PANEL)
template <int M>
void rows_by_panel(const float* x, int64_t K, const float* panel, float* sums) {
  vec acc[M][VECS] = {};
  for (int64_t k = 0; k < K; ++k) {
    vec w[VECS];
#pragma GCC unroll 4
    for (int j = 0; j < VECS; ++j) w[j] = load(panel + k * PANEL + j * LANES);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const float xm = x[m * K + k];
#pragma GCC unroll 4
      for (int j = 0; j < VECS; ++j) acc[m][j] += xm * w[j];
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < VECS; ++j) std::memcpy(sums + m * PANEL + j * LANES, &acc[m][j], sizeof(vec));
  }
}

void rows_by_panel(int64_t m, const float* x, int64_t K, const float* panel, float* sums) {
  static_assert(ROWS == 8 || ROWS == 2, "one case per row count below ROWS");
  switch (m) {
    case 1: return rows_by_panel<1>(x, K, panel, sums);
#if defined(__AVX512F__)
    case 2: return rows_by_panel<2>(x, K, panel, sums);
    case 3: return rows_by_panel<3>(x, K, panel, sums);
    case 4: return rows_by_panel<4>(x, K, panel, sums);
    case 5: return rows_by_panel<5>(x, K, panel, sums);
    case 6: return rows_by_panel<6>(x, K, panel, sums);
    case 7: return rows_by_panel<7>(x, K, panel, sums);
#endif
    default: return rows_by_panel<ROWS>(x, K, panel, sums);
  }
}

at::Tensor pack_panels(const at::Tensor& weight) {  // (N, K) -> (ceil(N / 32), K, 32) float32, zero-padded
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + PANEL - 1) / PANEL;
  at::Tensor padded = at::zeros({P * PANEL, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, PANEL, K}).transpose(1, 2).contiguous();
}

at::Tensor panels_linear(const at::Tensor& x_, const at::Tensor& panels, const std::optional<at::Tensor>& bias_, int64_t N) {
  const int64_t K = x_.size(-1), P = panels.size(0);
  const at::Tensor x = x_.reshape({-1, K}).contiguous();  // (M, K)
  const int64_t M = x.size(0);
  std::vector<int64_t> sizes = x_.sizes().vec();
  sizes.back() = N;
  at::Tensor out = at::empty({M, N}, x.options());  // (M, N)
  const at::Tensor bias = bias_.has_value() ? bias_->contiguous() : at::Tensor();
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, K * PANEL));  // ~256 KB of weights a task
  at::parallel_for(0, P, grain, [&](int64_t begin, int64_t end) {
    float sums[ROWS * PANEL];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * PANEL, width = std::min(PANEL, N - n0);
      for (int64_t r = 0; r < M; r += ROWS) {
        const int64_t m = std::min<int64_t>(ROWS, M - r);
        rows_by_panel(m, xp + r * K, K, pp + p * K * PANEL, sums);
        for (int64_t i = 0; i < m; ++i) {
          float* row = op + (r + i) * N + n0;
          const float* s = sums + i * PANEL;
          if (bp != nullptr) {
            for (int64_t j = 0; j < width; ++j) row[j] = s[j] + bp[n0 + j];
          } else {
            std::memcpy(row, s, width * sizeof(float));
          }
        }
      }
    }
  });
  return out.view(sizes);
}

}  // namespace

TORCH_LIBRARY_IMPL(headwise, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panels_linear", &panels_linear);
}
