// A GEMM for the few rows of a decode step (and a prompt's many): out (M, N) = x (M, K) . weight (N, K)^T + bias, over
// the weight packed once in panels of 32 output columns (pack_panels), k-major. Each panel is read from
// memory once, a step of k at a time (one 128-byte line), while a pass's rows of x (up to PASS_ROWS, or ROWS), broadcast
// one value (or one pair, or four) at a time, are multiplied into rows x 32 sums held in registers; more rows
// take the panel again from the core's cache (float32 and widened panels: KBLOCK_BYTES of it at a time, each block
// read by every pass of rows before the next), a chunk of rows (CHUNK_BYTES of x) at a time for a
// prompt. The panels are split between torch's threads.
//
// - float32: panels (ceil(N/32), K, 32); sums over k in order, in float32.
// - bfloat16: panels (ceil(N/32), K + K % 2, 32), each step a pair of k for every column ((k, k+1) side by
//   side, K padded with a zero); one vdpbf16ps adds a pair's two products (exact in float32) to each float32
//   sum; the sum plus the bias is rounded to bfloat16 once. Without vdpbf16ps (built for torch's AVX2 kernels,
//   or a CPU without AVX512-BF16) x is widened to float32 once a call and each step of the panel in registers (the
//   even k's and the odd k's), its two products added as vdpbf16ps adds them: the same sums.
//   On a CPU with AMX's bfloat16 tiles a call of TILE_ROWS rows or more runs in them instead: 16 steps
//   of a panel are a tile of the weight as tdpbf16ps wants it (loaded with a 128-byte stride), 16 rows
//   by 32 k of x another, two blocks of 16 rows at a time (tiles_by_panel).
// - int8 weights, bfloat16 x: int8 panels in the bfloat16 layout, a quarter of the bytes; each step's 64
//   values widened in registers to bfloat16 (exact: |w| <= 128 has 8 significant bits), then the same
//   vdpbf16ps (without AVX512-BF16: widened to float32, as above; on the AVX2 build, from WIDEN_ROWS rows, the
//   whole panel widened once into a bfloat16 panel, taken as bfloat16's: the same sums); the
//   sums rounded to bfloat16 (no bias: the caller scales them). In AMX tiles (INT8_TILE_ROWS rows or more) each
//   tile's 16 steps are widened so into a 2 KB buffer first.
// - int8 weights, int8 x, on a CPU without AVX512-VNNI (any with AVX2): int8 panels in the bfloat16 layout, each
//   step's pairs widened to int16 in registers and x's pairs too (once a call); one vpmaddwd adds a pair's two products
//   (exact) for 8 columns, a vpaddd adds them to the int32 sums (words_by_panel, WORD_ROWS rows a pass).
// - int8 weights, int8 x, with AVX512-VNNI: uint8 panels (ceil(N/32), K rounded up to 4, 32), each step
//   four k for every column, each weight stored as w + 128 (vpdpbusd multiplies unsigned bytes by signed
//   ones); one vpdpbusd adds four products to each int32 sum, and 128 times the row's sum of x is taken
//   off after: the exact integer sums (M, N), as torch._int_mm gives (int32 arithmetic wraps, so this
//   holds wherever the true sums fit an int32; no bias: the caller scales them).
// While a panel is read, the lines AHEAD bytes further on (the rest of it, then the thread's next panel) are asked
// into the cache: a step's arithmetic at many rows outlasts the hardware prefetchers' pace, and at one to three rows
// Intel's prefetchers alone fell behind too. The last panel is zero-padded. Built at run time by headwise.native with
// the instruction set torch's own kernels use; the ops' schemas and checks live on the Python side
// (headwise.linear.panels).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "../backends/vectors.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int LANES = 16;   // floats per register
constexpr int ROWS = 8;     // 8 rows x 2 registers of sums: 16 of the 32 registers
#else
constexpr int LANES = 8;    // AVX2 (or the compiler's own split of 8-float vectors)
constexpr int ROWS = 3;     // 3 rows x 4 registers of sums: 12 of the 16 registers
#endif
// bfloat16 or int8 panels without vdpbf16ps: each step widened in registers (the even k's and the odd k's, a mask), two
// broadcasts of x a row, so on AVX2 only 2 rows' sums fit in the 16 registers (3 spill theirs to memory)
constexpr int WIDE_ROWS = LANES == 8 ? 2 : ROWS;
// A float32 or bfloat16 panel under AVX-512 (multiply-adds, or vdpbf16ps): up to PASS_ROWS rows a pass, 28 registers of
// sums, 2 for the panel's step, 1 for a row's broadcast (more rows a pass: more arithmetic under each line read from
// memory, fewer passes over the panel); a call's rows split into passes as even as may be (even_rows). int8 panels keep
// ROWS (each step widened in registers takes more of them).
constexpr int PASS_ROWS = LANES == 16 ? 14 : ROWS;
template <typename W>
constexpr int pair_rows = std::is_same_v<W, int8_t> ? ROWS : PASS_ROWS;
inline int64_t even_rows(int64_t m, int64_t most) {
  const int64_t passes = std::max<int64_t>(1, (m + most - 1) / most);
  return std::max<int64_t>(1, (m + passes - 1) / passes);
}
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
constexpr int64_t PANEL = 32;           // output columns per panel
constexpr int VECS = PANEL / LANES;     // registers per row of a panel
constexpr int64_t AHEAD = 8192;         // bytes: how far ahead of the step being read the next are asked into the cache

// The step of `bytes` bytes at p, AHEAD bytes further on, asked into the cache (past the last panel: a hint, no fault).
template <int64_t bytes>
inline void ahead(const void* p) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(static_cast<const char*>(p) + AHEAD + off);
}

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// M rows' sums as a pass left them in sums (M, PANEL), for the next block of the panel's k's (inlined: the sums stay in registers)
template <int M>
__attribute__((always_inline)) inline void resumed(vec (&acc)[M][VECS], const float* sums) {
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < VECS; ++j) acc[m][j] = load(sums + m * PANEL + j * LANES);
  }
}

// sums (M, PANEL) (+)= x (M rows, row stride K) . panel (steps, PANEL), float32: from the sums already there where `resume`
template <int M>
void rows_by_panel(const float* x, int64_t K, const float* panel, int64_t steps, float* sums, bool resume) {
  vec acc[M][VECS] = {};
  if (resume) resumed(acc, sums);
  for (int64_t k = 0; k < steps; ++k) {
    ahead<PANEL * sizeof(float)>(panel + k * PANEL);
    vec w[VECS];
#pragma GCC unroll 4
    for (int j = 0; j < VECS; ++j) w[j] = load(panel + k * PANEL + j * LANES);
#pragma GCC unroll 16
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

#if defined(__x86_64__)
// One step of a panel (a pair of k for its 32 columns) as two registers of bfloat16 pairs: columns 0-15, 16-31.
__attribute__((target("avx512f,avx512bf16"))) inline void pair_step(const c10::BFloat16* p, __m512bh& w0, __m512bh& w1) {
  w0 = (__m512bh)_mm512_loadu_si512(p);
  w1 = (__m512bh)_mm512_loadu_si512(p + 32);
}

// int8: 16 values at a time widened to int32, then float32, then two registers' worth rounded (exactly) to bfloat16.
__attribute__((target("avx512f,avx512bf16"))) inline __m512 widened(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));  // (16,)
}

__attribute__((target("avx512f,avx512bf16"))) inline void pair_step(const int8_t* p, __m512bh& w0, __m512bh& w1) {
  w0 = _mm512_cvtne2ps_pbh(widened(p + 16), widened(p));       // the second argument fills lanes 0-15
  w1 = _mm512_cvtne2ps_pbh(widened(p + 48), widened(p + 32));
}

// One step of a panel's LANES columns (LANES pairs of k) widened to two float32 vectors, without vdpbf16ps: the even k's
// and the odd k's. A bfloat16 is the top half of its float32; an int8 pair is one int16, sign-extended, then each byte.
typedef uint32_t uvec __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef int32_t svec __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef int16_t hvec __attribute__((vector_size(LANES * sizeof(int16_t))));

inline void widened_pairs(const c10::BFloat16* p, vec& even, vec& odd) {
  uvec u;
  std::memcpy(&u, p, sizeof u);
  even = (vec)(u << 16);
  odd = (vec)(u & 0xFFFF0000u);
}

inline void widened_pairs(const int8_t* p, vec& even, vec& odd) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  // one vpmovsxwd from memory (GCC splits the generic 8 x int16 -> int32 conversion into four instructions)
  const __m256i s = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));  // (odd << 8 | even byte)
  even = (vec)_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(s, 24), 24));
  odd = (vec)_mm256_cvtepi32_ps(_mm256_srai_epi32(s, 8));
#else
  hvec h;
  std::memcpy(&h, p, sizeof h);
  const svec s = __builtin_convertvector(h, svec);  // (odd << 8 | even byte), sign-extended
  even = __builtin_convertvector((svec)((uvec)s << 24) >> 24, vec);
  odd = __builtin_convertvector(s >> 8, vec);
#endif
}

// pairs_by_panel's sums without vdpbf16ps, for x (M rows of Kp, row stride Kp) widened to float32 once for the call, each
// pair's odd k first (`swapped`): each pair's two products (exact in float32) added to the float32 sums as vdpbf16ps
// adds them, the odd k's first, on the compiler's vectors of torch's instruction set
template <int M, typename W>
void widened_pairs_by_panel(const float* x, int64_t Kp, const W* panel, int64_t steps, float* sums, bool resume) {
  vec acc[M][VECS] = {};
  if (resume) resumed(acc, sums);
  for (int64_t kk = 0; kk < steps / 2; ++kk) {
    ahead<2 * PANEL * sizeof(W)>(panel + kk * 2 * PANEL);
#pragma GCC unroll 4
    for (int j = 0; j < VECS; ++j) {
      vec even, odd;
      widened_pairs(panel + kk * 2 * PANEL + j * 2 * LANES, even, odd);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        acc[m][j] += x[m * Kp + 2 * kk] * odd;
        acc[m][j] += x[m * Kp + 2 * kk + 1] * even;
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < VECS; ++j) std::memcpy(sums + m * PANEL + j * LANES, &acc[m][j], sizeof(vec));
  }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// widened_pairs_by_panel's sums for bfloat16 panels on the AVX2 build, M = 1-3 rows: each step read twice (from the
// first-level cache), its odd k's widened for each register of columns and added to every row's sums, then its even
// k's, so that one broadcast a row is live rather than two: 3 rows' 12 sums, 3 broadcasts and the widened register fill
// the 16. Each sum adds the same products in the same order (the same bits). Written in assembly: GCC, given this loop
// in intrinsics, kept the mask in a register and spilled sums to the stack (slower than 2 rows a pass; docs/performance/decode.md), and
// its 1- and 2-row code moved between builds. The broadcasts sit in ymm12-14, the widened step in ymm15.
alignas(32) constexpr uint32_t HIGH_HALVES[8] = {0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u,
                                                 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u};  // a pair's odd k

#define HW_B0 "12"  // row r's broadcast: ymm(12 + r)
#define HW_B1 "13"
#define HW_B2 "14"
#define HW_FMA(r, j) "vfmadd231ps %%ymm15, %%ymm" HW_B##r ", %[a" #r #j "]\n\t"  // a[r][j] += broadcast r * widened
#define HW_FMAS1(j) HW_FMA(0, j)
#define HW_FMAS2(j) HW_FMAS1(j) HW_FMA(1, j)
#define HW_FMAS3(j) HW_FMAS2(j) HW_FMA(2, j)
#define HW_BROADCAST1(at) "vbroadcastss " at "(%[x]), %%ymm12\n\t"
#define HW_BROADCAST2(at) HW_BROADCAST1(at) "vbroadcastss " at "(%[x],%[row]), %%ymm13\n\t"
#define HW_BROADCAST3(at) HW_BROADCAST2(at) "vbroadcastss " at "(%[x],%[row],2), %%ymm14\n\t"
#define HW_HALF(M, j, at, widen) "vmovdqu " at "(%[w]), %%ymm15\n\t" widen HW_FMAS##M(j)
#define HW_ODD "vpand %[high], %%ymm15, %%ymm15\n\t"
#define HW_EVEN "vpslld $16, %%ymm15, %%ymm15\n\t"
#define HW_STEP(M)                                                                                  \
  "prefetcht0 %c[ahead](%[w])\n\t"                                                                  \
  "prefetcht0 %c[ahead]+64(%[w])\n\t"                                                               \
  HW_BROADCAST##M("0") /* x swapped: each pair's odd k first */                                     \
  HW_HALF(M, 0, "0", HW_ODD) HW_HALF(M, 1, "32", HW_ODD) HW_HALF(M, 2, "64", HW_ODD) HW_HALF(M, 3, "96", HW_ODD) \
  HW_BROADCAST##M("4")                                                                              \
  HW_HALF(M, 0, "0", HW_EVEN) HW_HALF(M, 1, "32", HW_EVEN) HW_HALF(M, 2, "64", HW_EVEN) HW_HALF(M, 3, "96", HW_EVEN)
#define HW_SUMS1 [a00] "+x"(a00), [a01] "+x"(a01), [a02] "+x"(a02), [a03] "+x"(a03)
#define HW_SUMS2 HW_SUMS1, [a10] "+x"(a10), [a11] "+x"(a11), [a12] "+x"(a12), [a13] "+x"(a13)
#define HW_SUMS3 HW_SUMS2, [a20] "+x"(a20), [a21] "+x"(a21), [a22] "+x"(a22), [a23] "+x"(a23)
#define HW_READS                                                                                    \
  : [w] "r"(w), [x] "r"(x + k), [row] "r"(Kp * sizeof(float)),                                       \
    [high] "m"(*reinterpret_cast<const __m256i*>(HIGH_HALVES)), [ahead] "i"(AHEAD)                    \
  : "xmm12", "xmm13", "xmm14", "xmm15", "memory"

template <int M>
void halves_by_panel(const float* x, int64_t Kp, const c10::BFloat16* panel, int64_t steps, float* sums, bool resume) {
  static_assert(M >= 1 && M <= 3);
  // 12 variables, not an array: GCC kept an array of them in memory where the function was not inlined (slower)
  const auto start = [&](int m, int j) { return resume && m < M ? _mm256_loadu_ps(sums + m * PANEL + j * LANES) : _mm256_setzero_ps(); };
  __m256 a00 = start(0, 0), a01 = start(0, 1), a02 = start(0, 2), a03 = start(0, 3), a10 = start(1, 0), a11 = start(1, 1),
         a12 = start(1, 2), a13 = start(1, 3), a20 = start(2, 0), a21 = start(2, 1), a22 = start(2, 2), a23 = start(2, 3);
  const char* w = reinterpret_cast<const char*>(panel);
  for (int64_t k = 0; k < steps; k += 2, w += 2 * PANEL * sizeof(c10::BFloat16)) {
    if constexpr (M == 3) {
      asm(HW_STEP(3) : HW_SUMS3 HW_READS);
    } else if constexpr (M == 2) {
      asm(HW_STEP(2) : HW_SUMS2 HW_READS);
    } else {
      asm(HW_STEP(1) : HW_SUMS1 HW_READS);
    }
  }
  const __m256 a[3][VECS] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}};
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < VECS; ++j) _mm256_storeu_ps(sums + m * PANEL + j * LANES, a[m][j]);
  }
}
#undef HW_READS
#undef HW_SUMS3
#undef HW_SUMS2
#undef HW_SUMS1
#undef HW_STEP
#undef HW_EVEN
#undef HW_ODD
#undef HW_HALF
#undef HW_BROADCAST3
#undef HW_BROADCAST2
#undef HW_BROADCAST1
#undef HW_FMAS3
#undef HW_FMAS2
#undef HW_FMAS1
#undef HW_FMA
#undef HW_B2
#undef HW_B1
#undef HW_B0
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// An int8 panel of `pairs` steps widened into a bfloat16 panel's (pairs, PANEL, 2), 16 values at a time: each int8
// exactly, as a bfloat16 (8 significant bits): the sums over it are the int8 panel's, the widening done once for many rows.
void widen_panel(const int8_t* panel, int64_t pairs, c10::BFloat16* out) {
  const auto top = [](const int8_t* p) {  // 8 int8 -> the top halves of their float32s, one per int32
    return _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))), 16);
  };
  for (int64_t i = 0; i < pairs * 2 * PANEL; i += 16) {
    const __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(top(panel + i), top(panel + i + 8)), 0xD8);  // (16,) in order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), h);
  }
}
#endif

// sums (M, PANEL) = x (M rows of `pairs` bfloat16 pairs, each pair one int32) . panel (pairs, PANEL, 2) of bfloat16 or int8
template <int M, typename W>
__attribute__((target("avx512f,avx512bf16"))) void pairs_by_panel(const int32_t* x, int64_t pairs, const W* panel, float* sums) {
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < pairs; ++kk) {
    ahead<2 * PANEL * sizeof(W)>(panel + kk * 2 * PANEL);
    __m512bh w0, w1;
    pair_step(panel + kk * 2 * PANEL, w0, w1);
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const __m512bh xm = (__m512bh)_mm512_set1_epi32(x[m * pairs + kk]);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xm, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xm, w1);
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm512_storeu_ps(sums + m * PANEL, acc[m][0]);
    _mm512_storeu_ps(sums + m * PANEL + 16, acc[m][1]);
  }
}

// AMX: whether the CPU has bfloat16 tiles and Linux lets this process use them (asked once: arch_prctl).
bool has_bf16_tiles() {
  static const bool ok = [] {
    constexpr long REQ_XCOMP_PERM = 0x1023, XTILEDATA = 18;  // arch_prctl's request, the tiles' state component
    return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && syscall(SYS_arch_prctl, REQ_XCOMP_PERM, XTILEDATA) == 0;
  }();
  return ok;
}

// The tiles tiles_by_panel uses for rows in two blocks, m0 <= 16 and m1 <= 16 (m1 = 0: one block, its tiles left
// unconfigured): 0 and 1 = x's rows (32 bfloat16 each), 2 and 3 = the panel's next 16 steps for columns 0-15 and 16-31
// (16 rows of 16 pairs), 4 and 5 = the first block's sums for those columns, 6 and 7 = the second's (float32).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile"))) void load_tiles(int64_t m0, int64_t m1) {
  TileConfig c;
  const int64_t rows[8] = {m0, m1, 16, 16, m0, m0, m1, m1};
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows[t]);
    c.colsb[t] = rows[t] ? 64 : 0;
  }
  asm volatile("ldtilecfg %0" : : "m"(c));  // (GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of c only)
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

// sums (m0 + m1, PANEL) = x (m0 + m1 rows of Kp bfloat16) . panel (Kp / 2, PANEL, 2) of bfloat16 or int8, with the tiles
// loaded for m0 and m1 (load_tiles; TWO: m1 > 0): 32 k a step in AMX tiles (one tdpbf16ps per block and 16 columns, each
// step of the panel loaded once for both blocks; an int8 step widened to bfloat16 first, exactly), the last Kp % 32 by
// vdpbf16ps
template <bool TWO, typename W>
__attribute__((target("avx512f,avx512bf16,amx-tile,amx-bf16"))) void tiles_by_panel(const c10::BFloat16* x, int64_t Kp, int64_t m,
                                                                                   const W* panel, float* sums) {
  constexpr int64_t STEP = 16 * 2 * PANEL;  // a tile's 16 steps of the panel: 16 pairs of k for its 32 columns
  const int64_t steps = Kp / 32, pairs = Kp / 2;
  alignas(64) c10::BFloat16 widened_step[std::is_same_v<W, int8_t> ? STEP : 1];  // int8 panels: one step in bfloat16
  _tile_zero(4);
  _tile_zero(5);
  if constexpr (TWO) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t s = 0; s < steps; ++s) {
    const W* step = panel + s * STEP;
    const char* w = reinterpret_cast<const char*>(step);  // 16 steps of 128 bytes: 32 columns' pairs
    if constexpr (std::is_same_v<W, int8_t>) {
      for (int64_t j = 0; j < 16; ++j) {
        ahead<2 * PANEL>(step + j * 2 * PANEL);
        __m512bh w0, w1;
        pair_step(step + j * 2 * PANEL, w0, w1);
        _mm512_store_si512(widened_step + j * 2 * PANEL, (__m512i)w0);
        _mm512_store_si512(widened_step + j * 2 * PANEL + PANEL, (__m512i)w1);
      }
      w = reinterpret_cast<const char*>(widened_step);
    }
    _tile_loadd(2, w, 128);
    _tile_loadd(3, w + 64, 128);
    _tile_loadd(0, x + s * 32, Kp * 2);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    if constexpr (TWO) {
      _tile_loadd(1, x + 16 * Kp + s * 32, Kp * 2);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  _tile_stored(4, sums, PANEL * sizeof(float));
  _tile_stored(5, sums + 16, PANEL * sizeof(float));
  if constexpr (TWO) {
    _tile_stored(6, sums + 16 * PANEL, PANEL * sizeof(float));
    _tile_stored(7, sums + 16 * PANEL + 16, PANEL * sizeof(float));
  }
  const int32_t* xi = reinterpret_cast<const int32_t*>(x);  // a pair of bfloat16 as one int32
  for (int64_t i = 0; i < m && steps * 16 < pairs; ++i) {
    __m512 a0 = _mm512_loadu_ps(sums + i * PANEL), a1 = _mm512_loadu_ps(sums + i * PANEL + 16);
    for (int64_t kk = steps * 16; kk < pairs; ++kk) {
      __m512bh w0, w1;
      pair_step(panel + kk * 2 * PANEL, w0, w1);
      const __m512bh xm = (__m512bh)_mm512_set1_epi32(xi[i * pairs + kk]);
      a0 = _mm512_dpbf16_ps(a0, xm, w0);
      a1 = _mm512_dpbf16_ps(a1, xm, w1);
    }
    _mm512_storeu_ps(sums + i * PANEL, a0);
    _mm512_storeu_ps(sums + i * PANEL + 16, a1);
  }
}

// 16 int32 sums: a vector type of its own, so GCC keeps each in one register (through __m512i, which it holds as
// 8 int64, every vpdpbusd cost a register copy).
typedef int32_t ivec __attribute__((vector_size(64)));

// sums (M, PANEL) = x (M rows of `quads` int8 quads, each quad one int32) . panel (quads, PANEL, 4) of w + 128, int32
template <int M>
__attribute__((target("avx512f,avx512vnni"))) void quads_by_panel(const int32_t* x, int64_t quads, const uint8_t* panel, int32_t* sums) {
  ivec acc[M][2] = {};
  for (int64_t kk = 0; kk < quads; ++kk) {
    const uint8_t* step = panel + kk * 4 * PANEL;
    ahead<4 * PANEL>(step);
    const __m512i w0 = _mm512_loadu_si512(step), w1 = _mm512_loadu_si512(step + 64);  // columns 0-15, 16-31
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512i xm = _mm512_set1_epi32(x[m * quads + kk]);
      acc[m][0] = (ivec)_mm512_dpbusd_epi32((__m512i)acc[m][0], w0, xm);
      acc[m][1] = (ivec)_mm512_dpbusd_epi32((__m512i)acc[m][1], w1, xm);
    }
  }
  std::memcpy(sums, acc, sizeof acc);  // row m's 32 sums at sums + m * PANEL
}
#endif

#if defined(__x86_64__)
// The int8 x path on a CPU without AVX512-VNNI (any with AVX2): WORD_ROWS rows a pass, each 4 registers of 8 int32 sums
// (a third row's sums, its broadcast, the widened step and a product would need 17 of the 16 registers: GCC spills a
// sum, and 3 rows a pass ran slower than 2; docs: decoding)
constexpr int WORD_ROWS = 2;
constexpr int VECS_I = PANEL / 8;  // registers of 8 int32 sums a row of a panel

// sums (M, PANEL) (+)= x (M rows of int8 pairs widened to int16, each pair one int32; row stride `stride` pairs) . panel
// (pairs, PANEL, 2) of int8, int32, from the sums already there where `resume`: each step's 8 columns' pairs widened to
// int16 in a register, one vpmaddwd adds a pair's two products (exact: |w x| <= 2^14) for each column, a vpaddd adds them
// to its sum (int32 arithmetic wraps, as vpdpbusd's: the exact sums wherever they fit an int32).
template <int M>
__attribute__((target("avx2"))) void words_by_panel(const int32_t* x, int64_t stride, const int8_t* panel, int64_t pairs, int32_t* sums, bool resume) {
  __m256i acc[M][VECS_I];
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < VECS_I; ++j) {
      acc[m][j] = resume ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums + m * PANEL + j * 8)) : _mm256_setzero_si256();
    }
  }
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const int8_t* step = panel + kk * 2 * PANEL;
    ahead<2 * PANEL>(step);
#pragma GCC unroll 4
    for (int j = 0; j < VECS_I; ++j) {
      const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step + j * 16)));  // 8 columns' pairs
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) acc[m][j] = _mm256_add_epi32(acc[m][j], _mm256_madd_epi16(w, _mm256_set1_epi32(x[m * stride + kk])));
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < VECS_I; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + m * PANEL + j * 8), acc[m][j]);
  }
}
#endif

// One call per block of at most MAX rows: the row count a template argument, so the sums stay in registers.
template <int MAX = ROWS, typename Rows>
void by_rows(int64_t m, Rows rows) {
  if constexpr (MAX > 1) {
    if (m < MAX) return by_rows<MAX - 1>(m, rows);
  }
  return rows(std::integral_constant<int, MAX>{});
}

// A pass over a panel reads KBLOCK_BYTES of it before the next rows' pass reads the same: each pass but the first finds
// them in the first-level cache (32 KB or more on x86 CPUs), where passes over the whole panel read it from the second
// level (or memory) again, with no memory read under their multiply-adds. The sums wait in memory between blocks, exact:
// each still adds the same products in the same order (the same bits).
constexpr int64_t KBLOCK_BYTES = 8192;

// The block's m rows in passes of size(rows left) rows, at most R, over the panel's K k's kblock at a time (all at once
// where one pass takes every row): pass(rows, i, k0, kb) for the rows from i (rows an integral_constant), k's k0..k0+kb.
template <int R, typename Size, typename Pass>
void passes(int64_t m, int64_t K, int64_t kblock, Size size, Pass pass) {
  if (m <= R) kblock = K;
  for (int64_t k0 = 0;; k0 += kblock) {  // (K = 0: one block of none, the sums zero)
    const int64_t kb = std::min(kblock, K - k0);
    for (int64_t i = 0, r; i < m; i += r) {
      r = size(m - i);
      by_rows<R>(r, [&](auto rows) { pass(rows, i, k0, kb); });
    }
    if (k0 + kb >= K) break;
  }
}

// What one task of parallel_for keeps between its blocks: the AMX tiles it has configured (for `tile_rows` rows; 0: none),
// released when the task ends, and the int8 panel it last widened to bfloat16 (`widened_from`, into `widened`).
struct Task {
  int64_t tile_rows = 0;
  const void* widened_from = nullptr;
  std::vector<c10::BFloat16> widened;
  // room for `size` values at a 64-byte boundary, as torch's tensors start (a step of 128 bytes in two cache lines, not
  // three: from 16-byte boundaries the kernels' loads split lines and ran slower)
  c10::BFloat16* widened_panel(int64_t size) {
    widened.resize(size + 32);
    return reinterpret_cast<c10::BFloat16*>((reinterpret_cast<uintptr_t>(widened.data()) + 63) & ~uintptr_t{63});
  }
  Task() = default;
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;
  ~Task() {
#if defined(__x86_64__)
    if (tile_rows) release_tiles();
#endif
  }
};

#if defined(__x86_64__)
// sums (m, PANEL) = m rows of bfloat16 x (row stride Kp) . a panel of W (bfloat16 or int8): in AMX tiles where `tiles`
// (configured for m rows first where they are not yet), else by vdpbf16ps where the CPU has it (`wide` null), else
// widened to float32 (`wide`: the same rows of x widened to float32, each pair swapped): each step of the panel in
// registers for every WIDE_ROWS rows; on the AVX2 build halves_by_panel's 3 rows at a time over a bfloat16 panel, and
// over an int8 panel widened once into the task's bfloat16 panel from WIDEN_ROWS rows (an int8 step takes 6
// instructions to widen in registers, a bfloat16 one 2: below it, widened_pairs_by_panel).
constexpr int64_t WIDEN_ROWS = 6;

template <typename W>
void pair_sums(const c10::BFloat16* x, const float* wide, int64_t Kp, int64_t m, const W* panel, float* sums, Task& task, bool tiles) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  if (wide != nullptr && (std::is_same_v<W, c10::BFloat16> || m >= WIDEN_ROWS || task.widened_from == panel)) {
    const c10::BFloat16* p = reinterpret_cast<const c10::BFloat16*>(panel);
    if constexpr (std::is_same_v<W, int8_t>) {
      c10::BFloat16* widened = task.widened_panel(Kp * PANEL);
      if (task.widened_from != panel) {
        widen_panel(panel, Kp / 2, widened);
        task.widened_from = panel;
      }
      p = widened;
    }
    // 4 rows: 2 + 2 (a pass of 1 row costs about one of 2)
    const auto size = [](int64_t left) { return left == 4 ? 2 : std::min<int64_t>(3, left); };
    passes<3>(m, Kp, KBLOCK_BYTES / (PANEL * sizeof(c10::BFloat16)), size, [&](auto rows, int64_t i, int64_t k0, int64_t kb) {
      halves_by_panel<decltype(rows)::value>(wide + i * Kp + k0, Kp, p + k0 * PANEL, kb, sums + i * PANEL, k0 > 0);
    });
    return;
  }
#endif
  if (wide != nullptr) {
    const auto size = [](int64_t left) { return std::min<int64_t>(WIDE_ROWS, left); };
    passes<WIDE_ROWS>(m, Kp, KBLOCK_BYTES / (PANEL * sizeof(W)), size, [&](auto rows, int64_t i, int64_t k0, int64_t kb) {
      widened_pairs_by_panel<decltype(rows)::value>(wide + i * Kp + k0, Kp, panel + k0 * PANEL, kb, sums + i * PANEL, k0 > 0);
    });
    return;
  }
  if (!tiles) {
    const int32_t* xi = reinterpret_cast<const int32_t*>(x);  // a pair of bfloat16 as one int32
    return by_rows<pair_rows<W>>(m, [&](auto rows) { pairs_by_panel<decltype(rows)::value>(xi, Kp / 2, panel, sums); });
  }
  if (m != task.tile_rows) {
    const int64_t m0 = std::min<int64_t>(16, m);
    load_tiles(m0, m - m0);
    task.tile_rows = m;
  }
  if (m > 16) {
    tiles_by_panel<true>(x, Kp, m, panel, sums);
  } else {
    tiles_by_panel<false>(x, Kp, m, panel, sums);
  }
}
#endif

#if defined(__x86_64__)
// sums (m, PANEL) = m rows of int8 x widened to int16 pairs (row stride Kp / 2 pairs) . an int8 pair panel (Kp / 2, PANEL,
// 2): words_by_panel's exact int32 sums, WORD_ROWS rows a pass, KBLOCK_BYTES of the panel at a time
void word_sums(const int32_t* x, int64_t Kp, int64_t m, const int8_t* panel, int32_t* sums) {
  const auto size = [](int64_t left) { return std::min<int64_t>(WORD_ROWS, left); };
  passes<WORD_ROWS>(m, Kp / 2, KBLOCK_BYTES / (2 * PANEL), size, [&](auto rows, int64_t i, int64_t k0, int64_t kb) {
    words_by_panel<decltype(rows)::value>(x + i * (Kp / 2) + k0, Kp / 2, panel + k0 * 2 * PANEL, kb, sums + i * PANEL, k0 > 0);
  });
}
#endif

// The bfloat16 x paths are built (x86: vdpbf16ps where the CPU has it, else the pairs widened to float32).
constexpr bool x86() {
#if defined(__x86_64__)
  return true;
#else
  return false;
#endif
}

// What the CPU runs (asked of the CPU, not of the build): false off x86.
#if defined(__x86_64__)
#define CPU_HAS(feature) __builtin_cpu_supports(feature)
#else
#define CPU_HAS(feature) false
#endif

// The CPU runs AVX512-BF16's pair dot products (the bfloat16 path's one instruction).
bool has_bf16_pairs() { return CPU_HAS("avx512bf16"); }

// bfloat16 x by vdpbf16ps (and AVX-512's bfloat16 store): the library built for AVX-512 (torch's kernels run it) on a CPU
// with AVX512-BF16; else the pairs widened to float32 (where torch's kernels run AVX2, whatever the CPU has).
bool native_pairs() { return LANES == 16 && has_bf16_pairs(); }

// The CPU runs AVX512-VNNI's byte dot products (the int8 x path's one instruction).
bool has_vnni() { return CPU_HAS("avx512vnni"); }

// The CPU runs AVX2 (the int8 x path's words_by_panel, where it has no AVX512-VNNI).
bool has_avx2() { return CPU_HAS("avx2"); }

#if defined(__linux__)
constexpr size_t HUGE_PAGE = size_t{1} << 21;
constexpr size_t SLAB = size_t{32} << 20;       // bytes of huge pages the packed weights under 2 MiB share
constexpr size_t SLAB_FROM = size_t{256} << 10;  // packed weights from this size take a slab's pages

// `bytes` (a multiple of 4 KiB) of memory of its own starting at a 2 MiB boundary, asked of Linux in transparent huge
// pages (madvise MADV_HUGEPAGE, before anything is written to it), or nullptr. A hint: where the kernel's THP setting is
// "never" the pages stay 4 KiB, as does the last partial 2 MiB. Given back by munmap(p, bytes).
char* huge_mapping(size_t bytes) {
  const size_t span = bytes + HUGE_PAGE;
  void* mapped = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) return nullptr;
  char* const base = static_cast<char*>(mapped);
  char* const p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + HUGE_PAGE - 1) & ~uintptr_t{HUGE_PAGE - 1});
  const size_t head = static_cast<size_t>(p - base);
  if (head > 0) munmap(base, head);
  if (span - head > bytes) munmap(p + bytes, span - head - bytes);
  madvise(p, bytes, MADV_HUGEPAGE);
  return p;
}

// Packed weights from SLAB_FROM to 2 MiB, one after another (each at a 4 KiB boundary) in SLABs of huge pages: a slab is
// given back when the last weight in it is freed and a newer slab has taken its place. Space a freed weight held is not
// taken again, so a slab's memory is what its weights took until all of them go.
class Slabs {
 public:
  // (where, the slab holding it) for `bytes`, or nullptr where no slab could be mapped
  std::pair<char*, std::shared_ptr<char>> take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!slab_ || used_ + bytes > SLAB) {
      char* p = huge_mapping(SLAB);
      if (p == nullptr) return {nullptr, nullptr};
      slab_ = std::shared_ptr<char>(p, [](char* q) { munmap(q, SLAB); });
      used_ = 0;
    }
    char* p = slab_.get() + used_;
    used_ += bytes;
    return {p, slab_};
  }

 private:
  std::mutex mutex_;
  std::shared_ptr<char> slab_;  // the slab new weights go to
  size_t used_ = 0;
};
#endif

// An empty contiguous CPU tensor whose memory, from 256 KiB, lies in transparent huge pages: from 2 MiB a mapping of its
// own (huge_mapping), below it a share of a slab; smaller ones torch's. A decode step streams every packed weight from
// memory once, and in 4 KiB pages each 4 KiB read is a TLB entry of its own (docs: decoding, huge pages).
at::Tensor in_huge_pages(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype);
#if defined(__linux__)
  const size_t bytes = (static_cast<size_t>(c10::multiply_integers(sizes)) * c10::elementSize(dtype) + 4095) / 4096 * 4096;
  if (bytes >= HUGE_PAGE) {
    if (char* p = huge_mapping(bytes)) return at::from_blob(p, sizes, [bytes](void* q) { munmap(q, bytes); }, options);
  } else if (bytes >= SLAB_FROM) {
    static Slabs* const slabs = new Slabs;  // (never destroyed: weights freed at exit still hold their slabs)
    auto [p, slab] = slabs->take(bytes);
    if (p != nullptr) return at::from_blob(p, sizes, [slab](void*) mutable { slab.reset(); }, options);
  }
#endif
  return at::empty(sizes, options);
}

// (N, K) -> (ceil(N / 32), K', 32) for x of x_dtype (by default the weight's, bfloat16 for an int8 weight):
// K' = K (float32), K + K % 2 (bfloat16 x; int8 x on a CPU without AVX512-VNNI: int8 pairs, words_by_panel's), K
// rounded up to 4 (int8 x with AVX512-VNNI: uint8 panels of w + 128)
at::Tensor pack_panels(const at::Tensor& weight, std::optional<at::ScalarType> x_dtype) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(weight.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar),
              "pack_panels: weight must be a 2-D float32, bfloat16 or int8 tensor, got ", weight.dim(), "-D ", dtype);
  const bool int8_x = x_dtype == at::kChar, quads = int8_x && has_vnni();
  TORCH_CHECK(!x_dtype.has_value() || *x_dtype == (dtype == at::kChar && !int8_x ? at::kBFloat16 : dtype),
              "pack_panels: x_dtype must be the weight's dtype (bfloat16 or int8 for an int8 weight), got weight ", dtype,
              " and x_dtype ", *x_dtype);
  const int64_t group = quads ? 4 : dtype == at::kFloat ? 1 : 2;  // k side by side in a step, for each column
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + PANEL - 1) / PANEL, Kp = (K + group - 1) / group * group;
  at::Tensor padded = at::zeros({P * PANEL, Kp}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  if (quads) padded = padded.view(at::kByte).bitwise_xor(128);  // w + 128 as uint8 (two's complement's top bit flipped)
  at::Tensor out = in_huge_pages({P, Kp, PANEL}, padded.scalar_type());  // p, step, j * group
  out.view({P, Kp / group, PANEL, group}).copy_(padded.view({P, PANEL, Kp / group, group}).permute({0, 2, 1, 3}));  // p, step, j, group
  return out;
}

// The rows of x one pass over the panels takes: about CHUNK_BYTES of them (rows of row_bytes), a multiple of ROWS. A
// prompt's rows would otherwise stream from memory again for every panel; a chunk stays in the core's cache.
constexpr int64_t CHUNK_BYTES = int64_t{1} << 19;
inline int64_t chunk_rows(int64_t row_bytes, int64_t block) {
  return std::max<int64_t>(block, CHUNK_BYTES / std::max<int64_t>(1, row_bytes) / block * block);
}

// bfloat16 x by bfloat16 or int8 panels on a CPU with AMX's bfloat16 tiles: calls of TILE_ROWS rows or more run in tiles,
// blocks of TILE_BLOCK rows (two tiles of 16); fewer rows keep vdpbf16ps (as fast there, and faster on a panel in the cache).
// int8 panels from INT8_TILE_ROWS: their vdpbf16ps path widens each step again for every block of rows (at one row the
// tiles were no faster).
constexpr int64_t TILE_BLOCK = 32;
constexpr int64_t TILE_ROWS = 4;
constexpr int64_t INT8_TILE_ROWS = 2;

// GELU inside the GEMM (panels_linear_gelu): on each block's float32 sums plus the bias, before they are stored (and, in
// bfloat16, rounded once), LANES values at a time, with the attention kernels' e^x (Cephes' expf); GELU "none" x Phi(x) with Phi(x) = erfc(-x / sqrt 2) / 2 by the Chebyshev fit of Numerical Recipes'
// erfcc (fractional error under 1.2e-7 everywhere, so the negative tail keeps its digits); "tanh" 0.5 x (1 + tanh u),
// u = sqrt(2 / pi) (x + 0.044715 x^3), written x sigmoid(2u) and the sigmoid from e^-|2u| (no cancellation, no overflow).
enum Gelu : int64_t { NO_GELU = 0, GELU_ERF = 1, GELU_TANH = 2 };

// e^x for x <= 0: 0 below -87.3 (NaN stays NaN), the attention kernels' (backends/vectors.h)
inline vec exp_of(const vec x) { return headwise_vectors::exp_of<vec, svec>(x); }

// 1 / d for d in [1, 2]
inline vec reciprocal(const vec d) {
#if defined(__AVX512F__)
  const vec y = (vec)_mm512_rcp14_ps((__m512)d);  // 2^-14 relative error, then one Newton step
  return y + y * (1.0f - d * y);
#else
  return 1.0f / d;
#endif
}

inline vec gelu_tanh(vec x) {
  const vec s = 1.5957691216f * (x + 0.044715f * (x * x * x));  // 2u
  const vec e = exp_of(s < 0.0f ? s : -s);                        // e^-|2u|
  const vec q = reciprocal(1.0f + e);                              // sigmoid(|2u|)
  return x * (s < 0.0f ? e * q : q);
}

inline vec gelu_erf(vec x) {
  const vec z = (x < 0.0f ? -x : x) * 0.70710678f;  // |x| / sqrt 2
  const vec t = 1.0f / (1.0f + 0.5f * z);
  vec p = vec{} + 0.17087277f;
  for (const float c : {-0.82215223f, 1.48851587f, -1.13520398f, 0.27886807f, -0.18628806f, 0.09678418f, 0.37409196f, 1.00002368f}) {
    p = p * t + c;
  }
  const vec half_tail = 0.5f * t * exp_of(p * t - 1.26551223f - z * z);  // erfc(|x| / sqrt 2) / 2 = Phi(-|x|)
  return x * (x < 0.0f ? half_tail : 1.0f - half_tail);
}

// sums (m, PANEL) <- GELU(sums + bias) for the block's rows, the bias (its `width` values, or none) added in float32 as
// store adds it; store then takes no bias
template <typename T>
void activate(float* sums, int64_t m, int64_t width, const T* bias, Gelu gelu) {
  alignas(64) float b[PANEL] = {};
  for (int64_t j = 0; bias != nullptr && j < width; ++j) b[j] = static_cast<float>(bias[j]);
  for (int64_t i = 0; i < m; ++i) {
    for (int j = 0; j < VECS; ++j) {
      float* s = sums + i * PANEL + j * LANES;
      const vec v = load(s) + load(b + j * LANES);
      const vec g = gelu == GELU_ERF ? gelu_erf(v) : gelu_tanh(v);
      std::memcpy(s, &g, sizeof g);
    }
  }
}

// out[r + i, n0 + j] = sums[i, j] + bias[n0 + j] for the block's rows and the panel's real columns
template <typename T>
void store(const float* sums, int64_t m, int64_t width, const T* bias, T* out, int64_t N) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < width; ++j) {
      const float s = sums[i * PANEL + j];
      out[i * N + j] = static_cast<T>(bias != nullptr ? s + static_cast<float>(bias[j]) : s);
    }
  }
}

#if defined(__x86_64__)
// store's bfloat16 output, 16 columns at a time: the bias widened to float32 and added, each sum rounded to nearest even
// by vcvtneps2bf16 (as c10::BFloat16 rounds, but that a float32 sum under 2^-126 rounds to zero)
// (16,) bfloat16 at p -> float32, zeros where k is off (a function of its own: a lambda would not get the target)
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 widened(__mmask16 k, const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void store(const float* sums, int64_t m, int64_t width, const c10::BFloat16* bias,
                                                                  c10::BFloat16* out, int64_t N) {
  const auto mask = [](int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1); };
  const __mmask16 lo = mask(width), hi = mask(width - 16);
  const __m512 b0 = bias != nullptr ? widened(lo, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias != nullptr ? widened(hi, bias + 16) : _mm512_setzero_ps();
  for (int64_t i = 0; i < m; ++i) {
    const __m512 s0 = _mm512_loadu_ps(sums + i * PANEL), s1 = _mm512_loadu_ps(sums + i * PANEL + 16);
    const __m512 v0 = bias != nullptr ? _mm512_add_ps(s0, b0) : s0, v1 = bias != nullptr ? _mm512_add_ps(s1, b1) : s1;
    _mm256_mask_storeu_epi16(out + i * N, lo, (__m256i)_mm512_cvtneps_pbh(v0));
    _mm256_mask_storeu_epi16(out + i * N + 16, hi, (__m256i)_mm512_cvtneps_pbh(v1));
  }
}
#endif

// bfloat16 x (M, Kp) widened to float32 for the paths without vdpbf16ps, once a call, each pair's two k swapped (the odd
// k first, the order vdpbf16ps adds their products in): (M, Kp) float32
at::Tensor swapped_pairs(const at::Tensor& x) {
  return x.view({x.size(0), x.size(1) / 2, 2}).flip(-1).to(at::kFloat).view({x.size(0), x.size(1)});
}

// panels_linear, and panels_linear_gelu with `gelu` (float32 and bfloat16 x)
at::Tensor panels_gemm(const at::Tensor& x_, const at::Tensor& panels, const std::optional<at::Tensor>& bias_, int64_t N, Gelu gelu) {
  const auto xt = x_.scalar_type(), pt = panels.scalar_type();
  // int8 x: quads (uint8 panels, AVX512-VNNI) or words (int8 pair panels, AVX2)
  const bool pairs = xt == at::kBFloat16, quads = xt == at::kChar && pt == at::kByte, words = xt == at::kChar && pt == at::kChar;
  const bool int8 = pt == at::kChar || pt == at::kByte;
  TORCH_CHECK(x_.dim() >= 1 && (xt == at::kFloat || pairs || quads || words)
              && ((pt == xt && xt != at::kChar) || (pairs && pt == at::kChar) || quads || words)
              && panels.dim() == 3 && panels.size(2) == PANEL && panels.is_contiguous(),
              "panels_linear: x must be float32, bfloat16 or int8 and panels pack_panels' output for it (float32, bfloat16, "
              "int8 for bfloat16 x, uint8 or int8 for int8 x), got x ", xt, ", panels ", pt, " of shape ", panels.sizes());
  TORCH_CHECK(!int8 || !bias_.has_value(), "panels_linear: int8 panels take no bias (their sums are scaled after)");
  const int64_t K = x_.size(-1), P = panels.size(0), Kp = panels.size(1), group = quads ? 4 : pairs || words ? 2 : 1;
  TORCH_CHECK(Kp == (K + group - 1) / group * group && N >= 0 && (N + PANEL - 1) / PANEL == P,
              "panels_linear: panels of shape ", panels.sizes(), " do not hold a weight of ", N, " rows by ", K);
  TORCH_CHECK(!bias_.has_value() || (bias_->scalar_type() == xt && bias_->numel() == N),
              "panels_linear: bias must hold ", N, " values of x's dtype");
  TORCH_CHECK(!pairs || x86(), "panels_linear: bfloat16 x needs an x86 CPU");
  TORCH_CHECK(!quads || has_vnni(), "panels_linear: int8 x by uint8 panels needs a CPU with AVX512-VNNI");
  TORCH_CHECK(!words || has_avx2(), "panels_linear: int8 x by int8 panels needs a CPU with AVX2");
  at::Tensor x = x_.reshape({-1, K}).contiguous();  // (M, K)
  if (Kp != K) x = at::constant_pad_nd(x, {0, Kp - K});  // (M, K'): zeros to fill the last pair or quad
  const int64_t M = x.size(0);
  std::vector<int64_t> sizes = x_.sizes().vec();
  sizes.back() = N;
  at::Tensor out = at::empty({M, N}, x.options().dtype(xt == at::kChar ? at::kInt : xt));  // (M, N): int32 sums for int8 x
  if (words) x = x.to(at::kShort);  // (M, K'): each pair of int16 one int32 (words_by_panel's broadcast)
  std::vector<uint32_t> offsets(quads ? M : 0);  // 128 times each row's sum: what the weights' offset added (mod 2^32)
  for (int64_t i = 0; i < (quads ? M : 0); ++i) {
    const int8_t* row = x.const_data_ptr<int8_t>() + i * Kp;
    offsets[i] = 128u * static_cast<uint32_t>(std::accumulate(row, row + Kp, int64_t{0}));
  }
  const at::Tensor bias = bias_.has_value() ? bias_->contiguous() : at::Tensor();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, Kp * PANEL));  // ~256 KB of float32 a task
  const void* xp = x.data_ptr();
  const void* pp = panels.data_ptr();
  const void* bp = bias.defined() ? bias.data_ptr() : nullptr;
  void* op = out.data_ptr();
#if defined(__x86_64__)
  const bool native = pairs && native_pairs();
  const bool tiles = native && M >= (int8 ? INT8_TILE_ROWS : TILE_ROWS) && has_bf16_tiles();
#else
  const bool native = false, tiles = false;
#endif
  const at::Tensor wide = pairs && !native ? swapped_pairs(x) : at::Tensor();  // (M, K')
  const float* wp = wide.defined() ? wide.const_data_ptr<float>() : nullptr;
  const int64_t block = tiles || wp != nullptr || words || (!pairs && !quads) ? TILE_BLOCK : pairs && !int8 ? even_rows(M, PASS_ROWS) : ROWS, chunk = chunk_rows(Kp * x.element_size(), block);
  for (int64_t r0 = 0; r0 < M; r0 += chunk) {  // (a decode step's few rows: one chunk)
    const int64_t r1 = std::min(M, r0 + chunk);
    at::parallel_for(0, P, grain, [&](int64_t begin, int64_t end) {
      alignas(64) float sums[TILE_BLOCK * PANEL];
      alignas(64) int32_t isums[TILE_BLOCK * PANEL];  // int8 x's: ROWS (quads) or TILE_BLOCK (words) rows
      Task task;
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * PANEL, width = std::min(PANEL, N - n0);
        for (int64_t r = r0; r < r1; r += block) {
          const int64_t m = std::min<int64_t>(block, r1 - r);
          if (pairs) {
#if defined(__x86_64__)
            using T = c10::BFloat16;
            const T* xr = static_cast<const T*>(xp) + r * Kp;
            if (int8) {
              pair_sums(xr, wp != nullptr ? wp + r * Kp : nullptr, Kp, m, static_cast<const int8_t*>(pp) + p * Kp * PANEL, sums, task, tiles);
            } else {
              pair_sums(xr, wp != nullptr ? wp + r * Kp : nullptr, Kp, m, static_cast<const T*>(pp) + p * Kp * PANEL, sums, task, tiles);
            }
            const T* b = bp != nullptr ? static_cast<const T*>(bp) + n0 : nullptr;
            T* o = static_cast<T*>(op) + r * N + n0;
            if (gelu != NO_GELU) {
              activate(sums, m, width, b, gelu);
              b = nullptr;
            }
            native ? store(sums, m, width, b, o, N) : store<T>(sums, m, width, b, o, N);
#endif
          } else if (quads) {
#if defined(__x86_64__)
            const int32_t* xr = static_cast<const int32_t*>(xp) + r * (Kp / 4);  // four int8 as one int32
            const uint8_t* panel = static_cast<const uint8_t*>(pp) + p * Kp * PANEL;
            by_rows(m, [&](auto rows) { quads_by_panel<decltype(rows)::value>(xr, Kp / 4, panel, isums); });
            int32_t* o = static_cast<int32_t*>(op) + r * N + n0;
            for (int64_t i = 0; i < m; ++i) {
              for (int64_t j = 0; j < width; ++j) o[i * N + j] = static_cast<int32_t>(static_cast<uint32_t>(isums[i * PANEL + j]) - offsets[r + i]);
            }
#endif
          } else if (words) {
#if defined(__x86_64__)
            word_sums(static_cast<const int32_t*>(xp) + r * (Kp / 2), Kp, m, static_cast<const int8_t*>(pp) + p * Kp * PANEL, isums);
            int32_t* o = static_cast<int32_t*>(op) + r * N + n0;
            for (int64_t i = 0; i < m; ++i) std::memcpy(o + i * N, isums + i * PANEL, width * sizeof(int32_t));
#endif
          } else {
            const float* xr = static_cast<const float*>(xp) + r * K;
            const float* panel = static_cast<const float*>(pp) + p * K * PANEL;
            const auto size = [](int64_t left) { return even_rows(left, PASS_ROWS); };
            passes<PASS_ROWS>(m, K, KBLOCK_BYTES / (PANEL * sizeof(float)), size, [&](auto rows, int64_t i, int64_t k0, int64_t kb) {
              rows_by_panel<decltype(rows)::value>(xr + i * K + k0, K, panel + k0 * PANEL, kb, sums + i * PANEL, k0 > 0);
            });
            const float* b = bp != nullptr ? static_cast<const float*>(bp) + n0 : nullptr;
            if (gelu != NO_GELU) {
              activate(sums, m, width, b, gelu);
              b = nullptr;
            }
            store(sums, m, width, b, static_cast<float*>(op) + r * N + n0, N);
          }
        }
      }
    });
  }
  return out.view(sizes);
}

at::Tensor panels_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias, int64_t N) {
  return panels_gemm(x, panels, bias, N, NO_GELU);
}

// F.gelu(panels_linear(...), approximate) with the GELU on the float32 sums plus the bias, before they are stored
at::Tensor panels_linear_gelu(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias, int64_t N,
                              c10::string_view approximate) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || (x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16),
              "panels_linear_gelu: x and panels must be float32 or bfloat16 (a GELU after int8 sums is the caller's), got x ",
              x.scalar_type(), ", panels ", panels.scalar_type());
  TORCH_CHECK(approximate == "none" || approximate == "tanh", "panels_linear_gelu: approximate must be \"none\" or \"tanh\", got \"",
              approximate, "\"");
  return panels_gemm(x, panels, bias, N, approximate == "none" ? GELU_ERF : GELU_TANH);
}

// out (M, N) of an Int8Linear call's whole epilogue: for each panel p and block of at most `rows` rows from r,
// block(m, r, p, sums, task) fills the block's PANEL sums of each row (float32 or int32; task: what the task keeps),
// then out[r + i, n] = value(r + i, n, sum) in float32, stored in out's dtype (float32 or bfloat16); the panels split
// between torch's threads.
template <typename S, typename Block, typename Value>
void scaled_panels(int64_t M, int64_t N, int64_t P, int64_t Kp, int64_t rows, at::Tensor& out, Block block, Value value) {
  void* op = out.data_ptr();
  const bool to_bf16 = out.scalar_type() == at::kBFloat16;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, Kp * PANEL));
  at::parallel_for(0, P, grain, [&](int64_t begin, int64_t end) {
    alignas(64) S sums[TILE_BLOCK * PANEL];
    Task task;
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * PANEL, width = std::min(PANEL, N - n0);
      for (int64_t r = 0; r < M; r += rows) {
        const int64_t m = std::min<int64_t>(rows, M - r);
        block(m, r, p, sums, task);
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < width; ++j) {
            const float o = value(r + i, n0 + j, sums[i * PANEL + j]);
            if (to_bf16) {
              static_cast<c10::BFloat16*>(op)[(r + i) * N + n0 + j] = c10::BFloat16(o);
            } else {
              static_cast<float*>(op)[(r + i) * N + n0 + j] = o;
            }
          }
        }
      }
    }
  });
}

// What both whole-call ops check and read: x (..., K) float32 or bfloat16, panels of `panel` dtype packed for `group`
// k a step (pack_panels' output for that x), N float32 scales and an optional float32 bias, the CPU flag the panels need.
struct WholeCall {
  int64_t K, P, Kp;
  std::vector<int64_t> sizes;  // the output's: x's, N last
  at::Tensor scales, bias;     // contiguous
  const float* sp;
  const float* bp;             // nullptr: no bias
};

WholeCall whole_call(const char* op, const at::Tensor& x, const at::Tensor& panels, at::ScalarType panel, int64_t group,
                     const at::Tensor& scales, const std::optional<at::Tensor>& bias, int64_t N, bool flag, const char* needs) {
  const auto xt = x.scalar_type();
  TORCH_CHECK(x.dim() >= 1 && (xt == at::kFloat || xt == at::kBFloat16) && panels.scalar_type() == panel && panels.dim() == 3
              && panels.size(2) == PANEL && panels.is_contiguous(), op, ": x must be float32 or bfloat16 and panels pack_panels' ",
              panel, " output for it, got x ", xt, ", panels ", panels.scalar_type(), " of shape ", panels.sizes());
  const int64_t K = x.size(-1), P = panels.size(0), Kp = panels.size(1);
  TORCH_CHECK(Kp == (K + group - 1) / group * group && N >= 0 && (N + PANEL - 1) / PANEL == P, op, ": panels of shape ",
              panels.sizes(), " do not hold a weight of ", N, " rows by ", K);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == N && (!bias.has_value() || (bias->scalar_type() == at::kFloat
              && bias->numel() == N)), op, ": scales (and bias) must hold ", N, " float32 values");
  TORCH_CHECK(flag, op, ": needs a CPU with ", needs);
  WholeCall c{K, P, Kp, x.sizes().vec(), scales.contiguous(), bias.has_value() ? bias->contiguous() : at::Tensor(), nullptr, nullptr};
  c.sizes.back() = N;
  c.sp = c.scales.const_data_ptr<float>();
  c.bp = c.bias.defined() ? c.bias.const_data_ptr<float>() : nullptr;
  return c;
}

// x (..., K) float32 or bfloat16 as (M, Kp) bfloat16 rows, a zero past K: each float32 rounded to nearest even, as
// torch's .to(bfloat16) rounds it (a NaN stays a NaN), in one loop here: at a decode step's one row the conversion's
// dispatch through ATen cost more than the rounding.
at::Tensor bf16_rows(const at::Tensor& x_, int64_t K, int64_t Kp) {
  const at::Tensor x = x_.reshape({-1, K}).contiguous();  // (M, K)
  if (x.scalar_type() == at::kBFloat16) return Kp == K ? x : at::constant_pad_nd(x, {0, Kp - K});
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, Kp}, x.options().dtype(at::kBFloat16));  // (M, K')
  const float* xp = x.const_data_ptr<float>();
  c10::BFloat16* op = out.mutable_data_ptr<c10::BFloat16>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) op[m * Kp + k] = c10::BFloat16(xp[m * K + k]);
    for (int64_t k = K; k < Kp; ++k) op[m * Kp + k] = c10::BFloat16(0.f);
  }
  return out;
}

// Int8Linear's decode call in one op (bfloat16 x's arithmetic): x (..., K) float32 or bfloat16 rounded to bfloat16, times
// int8 panels packed for bfloat16 x, each float32 sum rounded to bfloat16 once, then sum * scale (+ bias, one fused
// multiply-add: torch's addcmul on CPUs with AVX-512) in float32, in x's dtype: headwise.quantize's numbers, bit for bit.
at::Tensor panels_int8_scaled(const at::Tensor& x_, const at::Tensor& panels, const at::Tensor& scales,
                              const std::optional<at::Tensor>& bias_, int64_t N) {
  const WholeCall c = whole_call("panels_int8_scaled", x_, panels, at::kChar, 2, scales, bias_, N, x86(), "an x86 CPU");
  const int64_t Kp = c.Kp;
  const at::Tensor x = bf16_rows(x_, c.K, Kp);  // (M, K'): torch's rounding, a zero to fill the last pair
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x_.options());  // (M, N)
  const c10::BFloat16* xp = x.const_data_ptr<c10::BFloat16>();
  const int8_t* pp = panels.const_data_ptr<int8_t>();
#if defined(__x86_64__)
  const bool native = native_pairs();  // as panels_linear decides: the same sums
  const bool tiles = native && M >= INT8_TILE_ROWS && has_bf16_tiles();
  const at::Tensor wide = native ? at::Tensor() : swapped_pairs(x);  // (M, K')
  const float* wp = wide.defined() ? wide.const_data_ptr<float>() : nullptr;
  scaled_panels<float>(M, N, c.P, Kp, tiles || wp != nullptr ? TILE_BLOCK : ROWS, out, [&](int64_t m, int64_t r, int64_t p, float* sums, Task& t) {
    pair_sums(xp + r * Kp, wp != nullptr ? wp + r * Kp : nullptr, Kp, m, pp + p * Kp * PANEL, sums, t, tiles);
  }, [&](int64_t, int64_t n, float sum) {
    const float y = static_cast<float>(c10::BFloat16(sum));  // the sum rounded once
    return c.bp != nullptr ? std::fma(y, c.sp[n], c.bp[n]) : y * c.sp[n];
  });
#endif
  return out.view(c.sizes);
}

#if defined(__x86_64__)
// Row i of x (K float32) rounded to int8 as headwise.quantize's _int8_rows does: its scale max|x| times float32's 1/127
// (at least float32's tiny), each value divided by it and rounded half to even; the int8 values (Kp, a zero past K) into
// q, the scale returned. Finite x: torch's numbers, bit for bit; a NaN in the row makes its scale NaN, as torch's amax
// does (max instructions drop a NaN: it is looked for apart), and so does an infinity (_int8_rows too: its scale would
// be infinite and its values NaN, rounded to whatever int8), so the row's outputs are NaN.
__attribute__((target("avx2"))) float int8_row(const float* x, int64_t K, int64_t Kp, int8_t* q) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 top = _mm256_setzero_ps(), nan = _mm256_setzero_ps();  // nan: all ones in a lane that met one
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v));
  }
  alignas(32) float tops[8];
  _mm256_store_ps(tops, top);
  float amax = _mm256_movemask_ps(nan) ? std::numeric_limits<float>::quiet_NaN() : *std::max_element(tops, tops + 8);
  for (; k < K; ++k) amax = std::isnan(x[k]) ? x[k] : std::isnan(amax) ? amax : std::max(amax, std::fabs(x[k]));
  if (std::isinf(amax)) amax = std::numeric_limits<float>::quiet_NaN();
  const float scale = std::max(amax * static_cast<float>(1.0 / 127), std::numeric_limits<float>::min());
  const __m256 s = _mm256_set1_ps(scale);
  for (k = 0; k + 8 <= K; k += 8) {
    const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i i = _mm256_cvtps_epi32(r);  // (8,) in [-127, 127]
    const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));  // (8,) int16
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(h, h));  // (8,) int8
  }
  for (; k < K; ++k) q[k] = static_cast<int8_t>(std::nearbyint(x[k] / scale));
  for (; k < Kp; ++k) q[k] = 0;
  return scale;
}
#endif

// Int8Linear's decode call with int8 activations in one op: each row of x (float32 or bfloat16, widened) rounded to int8
// by its own scale (int8_row), the exact int32 sums over uint8 quad panels (AVX512-VNNI) or int8 pair panels (AVX2),
// then each sum as float32 times the row's scale, times the channel's, plus the bias, each a float32 rounding (no fused
// multiply-add: torch's in-place ops), in x's dtype: headwise.quantize's numbers, bit for bit, for finite x.
at::Tensor panels_int8_rows_scaled(const at::Tensor& x_, const at::Tensor& panels, const at::Tensor& scales,
                                   const std::optional<at::Tensor>& bias_, int64_t N) {
  const bool words = panels.scalar_type() == at::kChar;  // else quads
  const WholeCall c = whole_call("panels_int8_rows_scaled", x_, panels, words ? at::kChar : at::kByte, words ? 2 : 4, scales, bias_, N,
                                 words ? has_avx2() : has_vnni(), words ? "AVX2" : "AVX512-VNNI");
  const int64_t K = c.K, Kp = c.Kp;
  const at::Tensor x = x_.reshape({-1, K}).to(at::kFloat).contiguous();  // (M, K)
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x_.options());  // (M, N)
  std::vector<int8_t> q(M * Kp);
  std::vector<float> row_scales(M);
  std::vector<uint32_t> offsets(M);  // quads: 128 times each row's sum, what the weights' offset added (mod 2^32)
#if defined(__x86_64__)
  for (int64_t i = 0; i < M; ++i) {
    row_scales[i] = int8_row(x.const_data_ptr<float>() + i * K, K, Kp, q.data() + i * Kp);
    offsets[i] = words ? 0 : 128u * static_cast<uint32_t>(std::accumulate(q.data() + i * Kp, q.data() + (i + 1) * Kp, int64_t{0}));
  }
  const std::vector<int16_t> wide(words ? q.begin() : q.end(), q.end());  // words: (M, K') int16, each pair one int32
  const int32_t* xp = reinterpret_cast<const int32_t*>(words ? static_cast<const void*>(wide.data()) : q.data());  // a pair or a quad
  const void* pp = panels.const_data_ptr();
  scaled_panels<int32_t>(M, N, c.P, Kp, words ? TILE_BLOCK : ROWS, out, [&](int64_t m, int64_t r, int64_t p, int32_t* sums, Task&) {
    if (words) return word_sums(xp + r * (Kp / 2), Kp, m, static_cast<const int8_t*>(pp) + p * Kp * PANEL, sums);
    const uint8_t* panel = static_cast<const uint8_t*>(pp) + p * Kp * PANEL;
    by_rows(m, [&](auto rows) { quads_by_panel<decltype(rows)::value>(xp + r * (Kp / 4), Kp / 4, panel, sums); });
  }, [&](int64_t i, int64_t n, int32_t sum) {
    const int32_t exact = static_cast<int32_t>(static_cast<uint32_t>(sum) - offsets[i]);
    float o = static_cast<float>(exact) * row_scales[i];
    o = o * c.sp[n];
    if (c.bp != nullptr) {
      asm("" : "+x"(o));  // the product rounded before the sum: no fused multiply-add
      o = o + c.bp[n];
    }
    return o;
  });
#endif
  return out.view(c.sizes);
}

}  // namespace

TORCH_LIBRARY_IMPL(headwise, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panels_linear", &panels_linear);
  m.impl("panels_linear_gelu", &panels_linear_gelu);
  m.impl("panels_int8_scaled", &panels_int8_scaled);
  m.impl("panels_int8_rows_scaled", &panels_int8_rows_scaled);
}
