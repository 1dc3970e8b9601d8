// The float32 and bfloat16 GEMMs of cpu_gemm.cpp for x86 CPUs with AVX2 but not AVX-512 (built into
// the same library; see there for the layouts, which are the same, and cpu_kernels.cpp for the build).

#include "cpu_kernels.h"

#if defined(PPSERVE_AVX2) && !defined(__AVX512F__)

namespace {

using namespace ppserve;

// float_gemm on 256-bit vectors, for CPUs without AVX-512: the same layout and the same sums, each
// output one fused multiply-add per k in order, so that its results are bitwise those of the
// AVX-512 build and a row's do not depend on its batch. A group's 32 rows are four registers: one
// activation row takes all four (batch 1: four independent sums a k, a pass over the weights at
// memory speed); more rows take the group in two halves of 16 (lanes 0-15 lie in one cache line of
// each k, 16-31 in the next), six rows at a time, so that 12 accumulators fit the 16 registers.
// The loops are unrolled because otherwise GCC kept the accumulators on the stack, stored every k,
// and the GEMM fell well behind oneDNN's from 32 rows on; unrolled, it is the fastest or near it at
// every row count (docs/benchmarks.md#on-a-cpu-with-avx2-alone).
constexpr int64_t kFLanes = 32;
constexpr int kFRows = 6;
constexpr int64_t kFChunk = 256;
// Prefetching. A chunk's first pass over a group is the one that brings the group's weights from
// memory (the later passes find them in L2); it runs slower than memory only by its arithmetic, and
// the hardware prefetcher alone left it waiting on memory (Zen 3: decoding 32 rows from weights in
// memory took 1.3x as long as from weights in cache). So that pass prefetches its own lines kAhead
// k ahead (12 KB; at a group's end, the start of the next group, which follows it in memory): 12%
// less time at 32 rows, 13-20% at 4 and 8, no change at 256 (Zen 3). Not the one-row pass, which
// streams at memory speed and which prefetching made 9% slower.
constexpr int64_t kAhead = 96;
// A chunk of a few rows (a decode batch: at most kSpreadRows) makes few passes over a group, and the
// first of them, waiting on memory, was a large part of its time. So there every pass instead asks
// for a share of the lines of the group this thread takes next, a line every few k, into L2: those
// weights arrive while this group's arithmetic runs. All of SmolLM2's linears, weights in memory
// (Zen 3, alternating): 16 and 32 rows 13-22% less time, 48 rows 12%, 64 rows 0-8%, 96 rows
// nothing. Larger chunks keep kAhead, and so does the bfloat16 GEMM, whose widening arithmetic already
// hides the memory (no gain there).
constexpr int64_t kSpreadRows = 64;

// One pass's share of the next group's lines: one line every `every` iterations from `at` (none
// where `at` is null: the pass then runs the loop without step()).
struct Ahead {
  const char* at;
  int64_t every;
  int64_t countdown;
  [[gnu::always_inline]] inline void step() {
    if (--countdown == 0) {
      _mm_prefetch(at, _MM_HINT_T1);
      at += 64;
      countdown = every;
    }
  }
};

// Pass `pass` of `passes` over a group whose loop runs `iterations` times: its share of the next
// group's `bytes` at `next` (null: none).
inline Ahead ahead_share(const void* next, int64_t bytes, int64_t iterations, int64_t pass, int64_t passes) {
  if (next == nullptr) return {nullptr, 1, 1};
  const int64_t share = (bytes / 64 + passes - 1) / passes;  // lines
  const int64_t every = std::max<int64_t>(1, iterations / share);
  return {static_cast<const char*>(next) + pass * share * 64, every, every};
}

// Rows x[0, R) against `V` registers of the group from lane 8 * first: out[V * i + j] = the rows'
// sums for lanes 8 * (first + j) .. + 7.
template <int R, int V, bool Spread>
[[gnu::always_inline]] inline void float_group(const float* x, int64_t K, const float* w, bool fetch, Ahead ahead,
                                               int first, __m256* out) {
  __m256 acc[V * R];
#pragma GCC unroll 24
  for (int i = 0; i < V * R; ++i) acc[i] = _mm256_setzero_ps();
  w += 8 * first;
  for (int64_t k = 0; k < K; ++k) {
    if (fetch)
#pragma GCC unroll 4
      for (int j = 0; j < V; j += 2) _mm_prefetch(reinterpret_cast<const char*>(w + (k + kAhead) * kFLanes + 8 * j), _MM_HINT_T0);
    if constexpr (Spread) ahead.step();
    __m256 wj[V];
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) wj[j] = _mm256_loadu_ps(w + k * kFLanes + 8 * j);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 xi = _mm256_broadcast_ss(x + i * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < V; ++j) acc[V * i + j] = _mm256_fmadd_ps(xi, wj[j], acc[V * i + j]);
    }
  }
#pragma GCC unroll 24
  for (int i = 0; i < V * R; ++i) out[i] = acc[i];
}

template <int R, bool Spread>
[[gnu::always_inline]] inline void half_rows(int rows, const float* x, int64_t K, const float* w, bool fetch,
                                             Ahead ahead, int first, __m256* acc) {
  if constexpr (R == 1) {
    float_group<1, 2, Spread>(x, K, w, fetch, ahead, first, acc);
  } else if (rows == R) {
    float_group<R, 2, Spread>(x, K, w, fetch, ahead, first, acc);
  } else {
    half_rows<R - 1, Spread>(rows, x, K, w, fetch, ahead, first, acc);
  }
}

template <bool Spread>
[[gnu::always_inline]] inline void float_pass_as(int rows, const float* x, int64_t K, const float* w, bool fetch,
                                                 Ahead ahead, int half, __m256* acc) {
  if (half < 0) {
    float_group<1, 4, Spread>(x, K, w, fetch, ahead, 0, acc);
  } else {
    half_rows<kFRows, Spread>(rows, x, K, w, fetch, ahead, 2 * half, acc);
  }
}

// One pass over the group's weights (`half` -1: all 32 lanes, one row; else lanes 16 * half .. + 15),
// a call of its own (float_pass's reason above, in the AVX-512 build). Two loops: with the spread's
// countdown in it, the loop of larger chunks ran 12% slower.
[[gnu::noinline]] void float_pass(int rows, const float* x, int64_t K, const float* w, bool fetch, Ahead ahead,
                                  int half, __m256* acc) {
  if (ahead.at == nullptr) {
    float_pass_as<false>(rows, x, K, w, fetch, ahead, half, acc);
  } else {
    float_pass_as<true>(rows, x, K, w, fetch, ahead, half, acc);
  }
}

inline __m256i lane_mask8(int64_t lanes) {  // the first `lanes` (0 to 8) of eight
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(lanes, 0, 8))), index);
}

template <bool Silu>
void float_gemm(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t groups = (N + kFLanes - 1) / kFLanes;
  for (int64_t c0 = 0; c0 < M; c0 += kFChunk) {
    const int64_t c1 = std::min(M, c0 + kFChunk);
    shared_for(groups, [&](int64_t g, int64_t next) {
      const int64_t n0 = g * kFLanes, lanes = std::min(kFLanes, N - n0);
      const float* wg = w + g * K * kFLanes;
      // a few rows: every pass prefetches a share of the next group (see kSpreadRows)
      const bool spread = c1 - c0 > 1 && c1 - c0 <= kSpreadRows;
      const float* wn = spread && next >= 0 ? w + next * K * kFLanes : nullptr;
      const int64_t passes = 2 * ((c1 - c0 + kFRows - 1) / kFRows) - ((c1 - c0) % kFRows == 1);  // (one row: one)
      int64_t pass = 0;
      __m256i masks[4];
      __m256 b[4];
      for (int j = 0; j < 4; ++j) {
        masks[j] = lane_mask8(lanes - 8 * j);
        b[j] = bias == nullptr ? _mm256_setzero_ps() : _mm256_maskload_ps(bias + n0 + 8 * j, masks[j]);
      }
      for (int64_t r0 = c0; r0 < c1; r0 += kFRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kFRows, c1 - r0));
        const bool fetch = !spread && r0 == c0 && c1 > c0 + 1;  // the chunk's first pass (see kAhead)
        __m256 v[4 * kFRows];  // row i's lanes 8j .. 8j + 7 at 4i + j, bias added
        if (rows == 1) {
          float_pass(1, x + r0 * K, K, wg, fetch, ahead_share(wn, K * kFLanes * 4, K, pass++, passes), -1, v);
        } else {
          for (int half = 0; half < 2; ++half) {
            __m256 acc[2 * kFRows];
            const Ahead ahead = ahead_share(wn, K * kFLanes * 4, K, pass++, passes);
            float_pass(rows, x + r0 * K, K, wg, fetch, ahead, half, acc);
            for (int i = 0; i < rows; ++i) v[4 * i + 2 * half] = acc[2 * i], v[4 * i + 2 * half + 1] = acc[2 * i + 1];
          }
        }
        for (int i = 0; i < rows; ++i) {
          for (int j = 0; j < 4; ++j) v[4 * i + j] = _mm256_add_ps(v[4 * i + j], b[j]);
          if constexpr (Silu) {  // lanes 0-15 gate, 16-31 up
            float* out = y + (r0 + i) * (N / 2) + g * 16;
            _mm256_storeu_ps(out, _mm256_mul_ps(silu8(v[4 * i]), v[4 * i + 2]));
            _mm256_storeu_ps(out + 8, _mm256_mul_ps(silu8(v[4 * i + 1]), v[4 * i + 3]));
          } else {
            float* out = y + (r0 + i) * N + n0;
            if (lanes == kFLanes) {  // a masked store is microcoded on AMD: ~5% of a prefill on Zen 3
              for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + 8 * j, v[4 * i + j]);
            } else {
              for (int j = 0; j < 4; ++j) _mm256_maskstore_ps(out + 8 * j, masks[j], v[4 * i + j]);
            }
          }
        }
      }
    });
  }
}

// bfloat16 weights and activations on AVX2, which has no bfloat16 arithmetic: the AVX-512 BF16
// build's layout (per group, [K / 2][32] pairs of inputs), each pair widened to two float vectors
// (a bfloat16 is a float's high half: the even input's by a shift, the odd one's by a mask) and
// multiplied in float, accumulated in float32 and rounded to bfloat16 once, with the bias. At batch
// 1 the weights are read at half float32's bytes. Every output is one sum over k in order, so a
// row's result does not depend on its batch (it need not equal the AVX-512 BF16 build's, whose
// dot products add a pair's two products first).
template <int R, int V>
[[gnu::always_inline]] inline void bf16_group(const uint16_t* x, int64_t K, const uint32_t* w, bool fetch, int first,
                                              __m256* out) {
  __m256 acc[V * R];
#pragma GCC unroll 16
  for (int i = 0; i < V * R; ++i) acc[i] = _mm256_setzero_ps();
  w += 8 * first;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t p = 0; p < K / 2; ++p) {
    if (fetch)
#pragma GCC unroll 4
      for (int j = 0; j < V; j += 2) _mm_prefetch(reinterpret_cast<const char*>(w + (p + kAhead) * kFLanes + 8 * j), _MM_HINT_T0);
    __m256 even[V], odd[V];
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * kFLanes + 8 * j));
      even[j] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
      odd[j] = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 x0 = _mm256_set1_ps(to_float(x[i * K + 2 * p])), x1 = _mm256_set1_ps(to_float(x[i * K + 2 * p + 1]));
#pragma GCC unroll 4
      for (int j = 0; j < V; ++j) acc[V * i + j] = _mm256_fmadd_ps(x1, odd[j], _mm256_fmadd_ps(x0, even[j], acc[V * i + j]));
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < V * R; ++i) out[i] = acc[i];
}

constexpr int kBRows = 4;  // rows a half-group pass: 8 accumulators, 4 widened weight registers

template <int R>
[[gnu::always_inline]] inline void bf16_half_rows(int rows, const uint16_t* x, int64_t K, const uint32_t* w,
                                                  bool fetch, int first, __m256* acc) {
  if constexpr (R == 1) {
    bf16_group<1, 2>(x, K, w, fetch, first, acc);
  } else if (rows == R) {
    bf16_group<R, 2>(x, K, w, fetch, first, acc);
  } else {
    bf16_half_rows<R - 1>(rows, x, K, w, fetch, first, acc);
  }
}

[[gnu::noinline]] void bf16_pass(int rows, const uint16_t* x, int64_t K, const uint32_t* w, bool fetch, int half,
                                 __m256* acc) {
  if (half < 0) {
    bf16_group<1, 4>(x, K, w, fetch, 0, acc);
  } else {
    bf16_half_rows<kBRows>(rows, x, K, w, fetch, 2 * half, acc);
  }
}

// float_gemm<false>'s loop on bfloat16 (float_gemm_bf16's layout): K even, y: [M, N].
void bf16_gemm(const uint16_t* x, const uint32_t* w, const uint16_t* bias, uint16_t* y, int64_t M, int64_t N,
               int64_t K) {
  const int64_t groups = (N + kFLanes - 1) / kFLanes;
  for (int64_t c0 = 0; c0 < M; c0 += kFChunk) {
    const int64_t c1 = std::min(M, c0 + kFChunk);
    shared_for(groups, [&](int64_t g, int64_t) {
      const int64_t n0 = g * kFLanes, lanes = std::min(kFLanes, N - n0);
      const uint32_t* wg = w + g * (K / 2) * kFLanes;
      float b[kFLanes] = {};
      for (int64_t l = 0; l < lanes && bias != nullptr; ++l) b[l] = to_float(bias[n0 + l]);
      for (int64_t r0 = c0; r0 < c1; r0 += kBRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kBRows, c1 - r0));
        const bool fetch = r0 == c0 && c1 > c0 + 1;  // as float_gemm's
        __m256 v[4 * kBRows];  // row i's lanes 8j .. 8j + 7 at 4i + j
        if (rows == 1) {
          bf16_pass(1, x + r0 * K, K, wg, fetch, -1, v);
        } else {
          for (int half = 0; half < 2; ++half) {
            __m256 acc[2 * kBRows];
            bf16_pass(rows, x + r0 * K, K, wg, fetch, half, acc);
            for (int i = 0; i < rows; ++i) v[4 * i + 2 * half] = acc[2 * i], v[4 * i + 2 * half + 1] = acc[2 * i + 1];
          }
        }
        for (int i = 0; i < rows; ++i) {
          alignas(32) uint16_t out[kFLanes];
          for (int j = 0; j < 4; ++j) store8(out + 8 * j, round8<uint16_t>(_mm256_add_ps(v[4 * i + j], _mm256_loadu_ps(b + 8 * j))));
          std::memcpy(y + (r0 + i) * N + n0, out, lanes * sizeof(uint16_t));
        }
      }
    });
  }
}

}  // namespace

extern "C" {

void float_gemm_f32(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  float_gemm<false>(x, w, bias, y, M, N, K);
}
void float_gemm_silu_f32(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N,
                         int64_t K) {
  float_gemm<true>(x, w, bias, y, M, N, K);
}
void float_gemm_bf16(const uint16_t* x, const uint32_t* w, const uint16_t* bias, uint16_t* y, int64_t M, int64_t N,
                     int64_t K) {
  bf16_gemm(x, w, bias, y, M, N, K);
}

}  // extern "C"

#endif  // AVX2 without AVX-512
