// RMSNorm's rows in one op, bit for bit torch's rms_norm on the CPU (a composite of six ops, eight in bfloat16, each a
// dispatch): the squares x² rounded to float32, summed in the order of ATen's float sum over a contiguous row (its
// cascade: 8-float vectors in four interleaved partial sums, each adding a level every 16 steps; the leftover
// elements and the lanes then added one by one), divided by N, plus eps, r = 1 / sqrt of that; then x * r rounded
// to x's dtype (float32 or bfloat16), or with a float32 weight (float32 rows only) (x * r) * w. Built at run time
// with headwise's other ops (headwise.native); the schema and the checks of what it is given live in
// headwise.models.llama, which sends it rows of fewer elements than ATen's grain (32768), so that torch too sums
// each row whole, in one thread.
#pragma GCC optimize("fp-contract=off")  // a square is rounded before it is added, as torch's pow then sum

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>

namespace {

// The width of ATen's sum kernel: its AVX2 build's Vectorized<float> (the AVX-512 build of that kernel is not
// dispatched: REGISTER_DISPATCH without ALSO_REGISTER_AVX512_DISPATCH), and the default build's (32 bytes).
constexpr int64_t kLanes = 8;
typedef float lanes_v __attribute__((vector_size(4 * kLanes)));

int64_t ceil_log2(int64_t x) {  // ATen's utils::CeilLog2
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// ATen's multi_row_sum over items load(i * 4 + k), k < 4: four partial sums, each a cascade of four levels.
template <typename V, typename Load>
std::array<V, 4> four_sums(const Load& load, int64_t size) {
  constexpr int levels = 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / levels);
  const int64_t step = int64_t{1} << power;
  const int64_t mask = step - 1;
  V acc[levels][4];
  for (auto& level : acc)
    for (auto& a : level) a = V{};
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] += load(i * 4 + k);
    for (int j = 1; j < levels; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = V{};
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k] += load(i * 4 + k);
  for (int j = 1; j < levels; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k] += acc[j][k];
  return {acc[0][0], acc[0][1], acc[0][2], acc[0][3]};
}

// ATen's row_sum: the items as a (-1, 4) array, its columns' sums, the leftover items into the first, then the columns added.
template <typename V, typename Load>
V row_sum(const Load& load, int64_t size) {
  const int64_t rows = size / 4;
  std::array<V, 4> sums = four_sums<V>(load, rows);
  for (int64_t i = rows * 4; i < size; ++i) sums[0] += load(i);
  for (int k = 1; k < 4; ++k) sums[0] += sums[k];
  return sums[0];
}

template <typename T>
float squared(const T* x, int64_t i) {
  const float v = static_cast<float>(x[i]);
  return v * v;
}

// torch's float32 sum of the squares of one contiguous row of n elements (cascade_sum's inner reductions).
template <typename T>
float sum_of_squares(const T* x, int64_t n) {
  if (n < kLanes) return row_sum<float>([&](int64_t i) { return squared(x, i); }, n);  // scalar_inner_sum
  const int64_t vectors = n / kLanes;  // vectorized_inner_sum
  const lanes_v lanes = row_sum<lanes_v>(
      [&](int64_t i) {
        lanes_v v;
        for (int64_t l = 0; l < kLanes; ++l) v[l] = squared(x, i * kLanes + l);
        return v;
      },
      vectors);
  float total = 0.0f;
  for (int64_t i = vectors * kLanes; i < n; ++i) total += squared(x, i);
  for (int64_t l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

template <typename T>
void normed_rows(const T* x, T* out, const float* weight, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * n;
      T* o = out + r * n;
      const float mean = sum_of_squares(row, n) / static_cast<float>(n);
      const float s = 1.0f / std::sqrt(mean + eps);
      if (weight != nullptr) {
        for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>((static_cast<float>(row[i]) * s) * weight[i]);
      } else {
        for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(static_cast<float>(row[i]) * s);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "headwise::rms_norm: float32 or bfloat16 rows");
  const at::Tensor rows = x.contiguous();
  at::Tensor out = at::empty_like(rows);
  const int64_t n = rows.size(-1);
  if (rows.numel() == 0) return out;
  const float e = static_cast<float>(eps);
  if (rows.scalar_type() == at::kFloat) {
    at::Tensor w;
    if (weight.has_value()) {
      w = weight->contiguous();
      TORCH_CHECK(w.scalar_type() == at::kFloat && w.numel() == n, "headwise::rms_norm: a float32 weight of the rows' width");
    }
    normed_rows(rows.data_ptr<float>(), out.data_ptr<float>(), weight.has_value() ? w.data_ptr<float>() : nullptr, rows.numel() / n, n, e);
  } else {
    TORCH_CHECK(!weight.has_value(), "headwise::rms_norm: bfloat16 rows take no weight (it multiplies their rounded result)");
    normed_rows(rows.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), nullptr, rows.numel() / n, n, e);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(headwise, CPU, m) { m.impl("rms_norm", &rms_norm); }
