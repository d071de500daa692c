// Greedy decoding's token in one op: each row's index of its largest logit, the index torch's argmax gives (the first
// largest; a NaN counts as largest, so the first NaN), for float32 or bfloat16 rows. torch's argmax walks a row one
// element at a time on the CPU, and the chunked amax-then-argmax that replaced it takes eight ops, each a dispatch whose
// code and data a decode step has pushed out of the caches by then (docs: decoding, the small ops on a shared host).
// One pass here, 16 lanes at a time in four sets (each lane keeps its largest value and the index it first came at),
// then the lanes' largest and the first index that holds it. Built at run time with headwise's other ops
// (headwise.native); the schema and what it is given are decided in headwise.models.generate (`greedy`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "../backends/vectors.h"

namespace {

using namespace headwise_vectors;

typedef int i32x16 __attribute__((vector_size(64)));

// Lanes that keep their largest value and the index it first came at (a lane takes a value only when it is larger:
// an equal one later keeps the first); a NaN is never larger, so NaNs are only marked.
struct Lanes {
  f16v top;
  i32x16 at = {}, nan = {};
  Lanes() {
    constexpr float lowest = -std::numeric_limits<float>::infinity();
    top = f16v{lowest, lowest, lowest, lowest, lowest, lowest, lowest, lowest,
               lowest, lowest, lowest, lowest, lowest, lowest, lowest, lowest};
  }
  void take(f16v x, i32x16 here) {
    const i32x16 larger = x > top;
    top = larger ? x : top;
    at = larger ? here : at;
    nan |= x != x;
  }
};

// The first index of row's (n values) largest value, a NaN counting as largest. Four sets of lanes, 64 values a
// pass (one set's compare and blends wait on the last: four keep the loads coming).
template <typename T>
int64_t first_largest(const T* row, int64_t n) {
  Lanes lanes[4];
  i32x16 here = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  int64_t j = 0;
  for (; j + 64 <= n; j += 64, here += 64) {
    lanes[0].take(load16(row + j), here);
    lanes[1].take(load16(row + j + 16), here + 16);
    lanes[2].take(load16(row + j + 32), here + 32);
    lanes[3].take(load16(row + j + 48), here + 48);
  }
  for (; j + 16 <= n; j += 16, here += 16) lanes[0].take(load16(row + j), here);
  float best = -std::numeric_limits<float>::infinity();
  int64_t index = 0;  // (a row of nothing but -inf: index 0, as argmax)
  bool nan = false;
  for (const Lanes& set : lanes) {
    for (int lane = 0; lane < 16; ++lane) {  // the largest, and the first index that holds it
      nan |= set.nan[lane] != 0;
      if (set.top[lane] > best || (set.top[lane] == best && set.at[lane] < index)) {
        best = set.top[lane];
        index = set.at[lane];
      }
    }
  }
  for (; j < n; ++j) {  // the last n % 16, after every lane's index
    const float x = static_cast<float>(row[j]);
    nan |= x != x;
    if (x > best) {
      best = x;
      index = j;
    }
  }
  if (nan) {
    for (j = 0; j < n; ++j) {
      const float x = static_cast<float>(row[j]);
      if (x != x) return j;
    }
  }
  return index;
}

// o[b] = first_largest of row b of logits (B, V) of T, rows in parallel
template <typename T>
void rows(const at::Tensor& logits, int64_t* o) {
  const int64_t B = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  const T* p = logits.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / V);  // a task reads some 64K logits or more
  at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) o[b] = first_largest(p + b * stride, V);
  });
}

// logits (B, V) float32 or bfloat16, rows contiguous (stride(1) == 1), V >= 1, V < 2**31 -> (B,) int64
at::Tensor greedy(const at::Tensor& logits) {
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  AT_DISPATCH_SWITCH(logits.scalar_type(), "headwise::greedy",
                     AT_DISPATCH_CASE(at::kFloat, [&] { rows<float>(logits, out.data_ptr<int64_t>()); })
                     AT_DISPATCH_CASE(at::kBFloat16, [&] { rows<c10::BFloat16>(logits, out.data_ptr<int64_t>()); }));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(headwise, CPU, m) { m.impl("greedy", &greedy); }
