// The GEMMs of the CPU kernel library (built with cpu_kernels.cpp into one library, see there):
// y = x @ W.T + b for x: [M, K], W: [N, K] as a linear layer holds it, y: [M, N], every operand
// row-major and contiguous, W repacked once at load into the kernel's own layout.
//
// - float_gemm (float32; AVX2's in cpu_gemm_avx2.cpp): W in groups of 32 output rows, input-major within a group, so that at
//   each input k one load brings the 32 rows' weights and each activation row adds x[m][k] times
//   them into two registers: no horizontal sums, and one code path from batch 1 (a pass over the
//   weights at memory speed) to prefill (8 rows per pass, the weights of a group kept in cache).
//   float_gemm_silu: the same for an MLP's gate and up projections, SiLU(gate) * up its output.
//   float_gemm_bf16: bfloat16, the same layout by pairs of inputs (AVX-512 BF16's dot products, or
//   AVX2 widening each pair to float).
// - quant_gemm_q4 / quant_gemm_q8: W kept as 4- or 8-bit integers (built only where the CPU has
//   AVX-512 VNNI).

#include "cpu_kernels.h"

namespace {

using namespace ppserve;

#if defined(PPSERVE_FLOAT_GEMM) && defined(__AVX512F__)

// Float32 weights, per group of 32 output rows: [K][32], row n0 + l's input k at k * 32 + l (the
// last group padded with zero rows). Every output is one sum over k in order, fused multiply-adds
// into a float32 accumulator whatever M is, so a row's result does not depend on what else is in
// the batch: a request's tokens come out the same alone and in any micro-batch (the pipeline's
// split into stages changes the batches, and PP=1 and PP=P stay bitwise equal).
// Against oneDNN's packed float32 linear it is faster at batch 1, where a step is a pass over the
// weights, and at decode batches (the next group's weights fetched during the current one's
// passes), and level at prefill sizes (`python -m benchmarks quant`:
// docs/models.md#quantized-weights).
constexpr int64_t kFLanes = 32;   // output rows per group: two 16-lane registers
constexpr int kFRows = 8;         // activation rows per pass over a group's weights
constexpr int64_t kFChunk = 256;  // activation rows whose passes share a group's weights in cache

// One group against activation rows x[0, R): out[2i + h] lane l = y[i][16h + l] (without bias).
// With `next` (the next group's weights), their lines are asked into the cache on the way.
template <int R>
[[gnu::always_inline]] inline void float_group(const float* x, int64_t K, const float* w, const float* next,
                                               __m512* out) {
  __m512 acc[2 * R];
  for (int i = 0; i < 2 * R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if (next != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(next + k * kFLanes), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + k * kFLanes + 16), _MM_HINT_T1);
    }
    const __m512 w0 = _mm512_loadu_ps(w + k * kFLanes), w1 = _mm512_loadu_ps(w + k * kFLanes + 16);
    for (int i = 0; i < R; ++i) {
      const __m512 xi = _mm512_set1_ps(x[i * K + k]);
      acc[2 * i] = _mm512_fmadd_ps(xi, w0, acc[2 * i]);
      acc[2 * i + 1] = _mm512_fmadd_ps(xi, w1, acc[2 * i + 1]);
    }
  }
  for (int i = 0; i < 2 * R; ++i) out[i] = acc[i];
}

#if defined(PPSERVE_BF16_GEMM) && defined(__AVX512BF16__)
// The same GEMM on bfloat16 weights and activations, with the CPU's bfloat16 dot products
// (vdpbf16ps: a lane adds the products of a pair of inputs). Per group of 32 output rows the
// weights are [K / 2][32] pairs: at input pair p one 64-byte load brings 16 rows' pairs, and each
// activation row's pair, broadcast, adds two products into every lane. Accumulated in float32 with
// the bias added there and the output rounded to bfloat16 once, as oneDNN's bfloat16 linear does.
// Each row's sums run over K in the same order whatever the batch, as float_gemm's do. Against
// oneDNN's bfloat16 linear it is faster at a few rows, where oneDNN's kernels read the weights
// well below the memory's speed, and level at prefill sizes; and a decode step no longer calls
// back into Python for its linears (docs/benchmarks.md#against-vllm-and-llamacpp).
template <int R>
[[gnu::always_inline]] inline void float_group(const uint16_t* x, int64_t K, const uint32_t* w,
                                               const uint32_t* next, __m512* out) {
  __m512 acc[2 * R];
  for (int i = 0; i < 2 * R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    if (next != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(next + p * kFLanes), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + p * kFLanes + 16), _MM_HINT_T1);
    }
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + p * kFLanes));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + p * kFLanes + 16));
    for (int i = 0; i < R; ++i) {
      uint32_t pair;
      std::memcpy(&pair, x + i * K + 2 * p, sizeof pair);
      const __m512bh xi = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
      acc[2 * i] = _mm512_dpbf16_ps(acc[2 * i], xi, w0);
      acc[2 * i + 1] = _mm512_dpbf16_ps(acc[2 * i + 1], xi, w1);
    }
  }
  for (int i = 0; i < 2 * R; ++i) out[i] = acc[i];
}
#endif

// X, W: float, float (float32) or uint16_t, uint32_t (bfloat16 values and pairs of them).
template <int R, typename X, typename W>
[[gnu::always_inline]] inline void float_rows(int rows, const X* x, int64_t K, const W* w, const W* next,
                                              __m512* acc) {
  // the rows' accumulators stay in registers: one instance per count, inlined (or `acc` would be
  // memory, read and written at every FMA)
  if constexpr (R == 1) {
    float_group<1>(x, K, w, next, acc);
  } else if (rows == R) {
    float_group<R>(x, K, w, next, acc);
  } else {
    float_rows<R - 1>(rows, x, K, w, next, acc);
  }
}

// One pass over a group's weights, a call of its own: inlined into the GEMM's loop, with the bias
// and the masks live around it, GCC kept one of the two weight registers on the stack and read it
// back for every FMA, which slowed it at prefill sizes on AMD Zen 4
// (docs/benchmarks.md#against-vllm-and-llamacpp).
template <typename X, typename W>
[[gnu::noinline]] void float_pass(int rows, const X* x, int64_t K, const W* w, const W* next, __m512* acc) {
  float_rows<kFRows>(rows, x, K, w, next, acc);
}

inline __mmask16 lane_mask(int64_t lanes) { return lanes >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << lanes) - 1); }

// With Silu, W is an MLP's gate and up projections with every group's lanes 0-15 gate rows and
// 16-31 the same rows of up (engine/model/linear.py interleaves them; N a multiple of 32), and y is
// [M, N / 2]: SiLU(gate) * up, as silu_mul computes it from the float32 outputs, so bitwise equal
// to that pair of calls. It saves writing and reading back the [M, N] product: at a 2048-token
// prefill of the 0.5B shape, 80 MB a layer.
template <bool Silu>
void float_gemm(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t groups = (N + kFLanes - 1) / kFLanes;
  for (int64_t c0 = 0; c0 < M; c0 += kFChunk) {
    const int64_t c1 = std::min(M, c0 + kFChunk);
    shared_for(groups, [&](int64_t g, int64_t after) {
      const int64_t n0 = g * kFLanes, lanes = std::min(kFLanes, N - n0);
      const __mmask16 m0 = lane_mask(lanes), m1 = lane_mask(std::max<int64_t>(0, lanes - 16));
      const __m512 b0 = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, bias + n0);
      const __m512 b1 = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, bias + n0 + 16);
      for (int64_t r0 = c0; r0 < c1; r0 += kFRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kFRows, c1 - r0));
        __m512 acc[2 * kFRows];
        // A group's first pass waits on memory for its weights and the later ones find them in
        // cache, computing; the second pass brings in the next group's (the thread's next), so
        // that the next group's first pass computes too. With a single pass (up to 8 rows), it
        // brings them in itself: two streams from memory rather than one, which helps at a few
        // rows (batch 1 is at memory speed either way).
        const bool fetch_next = (r0 == c0 + kFRows || c1 - c0 <= kFRows) && after >= 0;
        const float* next = fetch_next ? w + after * K * kFLanes : nullptr;
        float_pass(rows, x + r0 * K, K, w + g * K * kFLanes, next, acc);
        for (int i = 0; i < rows; ++i) {
          const __m512 lo = _mm512_add_ps(acc[2 * i], b0), hi = _mm512_add_ps(acc[2 * i + 1], b1);
          if constexpr (Silu) {
            _mm512_storeu_ps(y + (r0 + i) * (N / 2) + g * 16, _mm512_mul_ps(silu16(lo), hi));
          } else {
            float* out = y + (r0 + i) * N + n0;
            _mm512_mask_storeu_ps(out, m0, lo);
            _mm512_mask_storeu_ps(out + 16, m1, hi);
          }
        }
      }
    });
  }
}

#if defined(PPSERVE_BF16_GEMM) && defined(__AVX512BF16__)
inline void store_bf16(uint16_t* p, __mmask16 mask, __m512 x) {
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16(x)), 16)));
}

// float_gemm<false> on bfloat16 (its group loop above, with float_gemm_bf16's layout): K even, y: [M, N].
void bf16_gemm(const uint16_t* x, const uint32_t* w, const uint16_t* bias, uint16_t* y, int64_t M, int64_t N,
               int64_t K) {
  const int64_t groups = (N + kFLanes - 1) / kFLanes;
  for (int64_t c0 = 0; c0 < M; c0 += kFChunk) {
    const int64_t c1 = std::min(M, c0 + kFChunk);
    shared_for(groups, [&](int64_t g, int64_t after) {
      const int64_t n0 = g * kFLanes, lanes = std::min(kFLanes, N - n0);
      const __mmask16 m0 = lane_mask(lanes), m1 = lane_mask(std::max<int64_t>(0, lanes - 16));
      auto load_bias = [&](__mmask16 m, int64_t at) {  // bfloat16 -> float: into the high half
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bias + at)), 16));
      };
      const __m512 b0 = bias == nullptr ? _mm512_setzero_ps() : load_bias(m0, n0);
      const __m512 b1 = bias == nullptr ? _mm512_setzero_ps() : load_bias(m1, n0 + 16);
      for (int64_t r0 = c0; r0 < c1; r0 += kFRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kFRows, c1 - r0));
        __m512 acc[2 * kFRows];
        const bool fetch_next = (r0 == c0 + kFRows || c1 - c0 <= kFRows) && after >= 0;  // as float_gemm's
        const uint32_t* next = fetch_next ? w + after * (K / 2) * kFLanes : nullptr;
        float_pass(rows, x + r0 * K, K, w + g * (K / 2) * kFLanes, next, acc);
        for (int i = 0; i < rows; ++i) {
          uint16_t* out = y + (r0 + i) * N + n0;
          store_bf16(out, m0, _mm512_add_ps(acc[2 * i], b0));
          store_bf16(out + 16, m1, _mm512_add_ps(acc[2 * i + 1], b1));
        }
      }
    });
  }
}
#endif  // AVX-512 BF16
#endif  // AVX-512

#if defined(PPSERVE_QUANT_GEMM)

// Weight-only quantized GEMM, the way llama.cpp does its quantized dot products: the activations
// are rounded to int8 in blocks of 32 (one scale each, max |x| / 127) and multiplied with the
// integer weights in int32 (vpdpbusd: 64 byte products per instruction), and only the block sums
// are scaled in float. The weights are laid out (engine/model/quantized.py packs them) so that one
// 512-bit register holds 4 weights of each of 16 output rows: for a block of 32 inputs, 8 products
// against the broadcast activations give the 16 rows' block sums in the 16 lanes, with no
// horizontal sums anywhere. Per group of 16 rows and block of 32 inputs:
//   int4: 256 bytes, 64-byte chunk c: lane l's byte k = w[l][4c + k] | w[l][4c + 16 + k] << 4 (0..15);
//         scales and mins fp16 [16] each, w = q * scale + min (GGUF's Q4_1; Q4_0's min is -8 scale)
//   int8: 512 bytes, chunk t: lane l's byte k = w[l][4t + k] + 128 (vpdpbusd multiplies unsigned by
//         signed bytes; the 128 * sum(x) it adds is taken off again); scales fp16 [16], w = q * scale
// At batch 1 this reads the weights at about memory speed; from 32 rows on it is faster than
// torch's int4 kernel and than float32 (where oneDNN's bfloat16 runs on AMX tiles, that is faster
// from 32 rows on). `python -m benchmarks quant` times them all: docs/models.md#quantized-weights.
constexpr int64_t kQBlock = 32;  // inputs per scale, of weights and activations alike
constexpr int64_t kQLanes = 16;  // output rows per group
constexpr int kQRows = 8;        // activation rows per pass over a group's weights

struct QuantActs {
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> scale;   // [M, K / 32]
  std::vector<float> sum;     // [M, K / 32]: the block's sum of rounded x, for int4's mins
  std::vector<int32_t> corr;  // [M, K / 32]: -128 * the block's sum of q, for int8's offset
};

template <typename T>
void quantize_acts(const T* x, int64_t rows, int64_t K, QuantActs& a) {
  const int64_t blocks = K / kQBlock;
  a.q.resize(rows * K);
  a.scale.resize(rows * blocks);
  a.sum.resize(rows * blocks);
  a.corr.resize(rows * blocks);
#pragma omp parallel for if (rows * K >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = r * blocks; b < (r + 1) * blocks; ++b) {
      const T* xb = x + b * kQBlock;
      float amax = 0.0f;
      bool finite = true;
      for (int64_t j = 0; j < kQBlock; ++j) {
        amax = std::max(amax, std::fabs(to_float(xb[j])));
        finite = finite && std::isfinite(to_float(xb[j]));
      }
      // A NaN or infinity cannot be rounded to int8: the block's scale carries it (a NaN) instead,
      // so that every output of the row is NaN, as the float product's would be NaN or infinite.
      if (!finite) amax = std::numeric_limits<float>::quiet_NaN();
      // A block of values below 1e-30 rounds to zero (127 / amax would overflow for subnormals).
      const float inv = amax > 1e-30f ? 127.0f / amax : 0.0f;
      int32_t qsum = 0;
      for (int64_t j = 0; j < kQBlock; ++j) {
        // (inv 0: a NaN/infinite or all-tiny block, whose products must not reach the int cast)
        const int32_t v = inv == 0.0f ? 0 : static_cast<int32_t>(std::nearbyint(to_float(xb[j]) * inv));
        a.q[b * kQBlock + j] = static_cast<int8_t>(v);
        qsum += v;
      }
      // int4's mins multiply the rounded inputs too, so that the whole product is that of the
      // float weights with the rounded inputs: an input's rounding error then meets |w|, not
      // |q * scale| (up to 15 * scale, twice as large as |w| on average for Q4_0/Q4_1 weights).
      a.scale[b] = amax / 127.0f;
      a.sum[b] = a.scale[b] * static_cast<float>(qsum);
      a.corr[b] = -128 * qsum;
    }
  }
}

inline __m512i broadcast4(const int8_t* p) {  // 4 activation bytes into every lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

inline __m512 load_fp16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One group of 16 output rows against activation rows [m0, m0 + R): acc[i] lane l = y[m0 + i][l].
template <int Bits, int R>
void quant_group(const uint8_t* w, const uint16_t* scales, const uint16_t* mins, const QuantActs& a, int64_t m0,
                 int64_t K, __m512* acc) {
  const int64_t blocks = K / kQBlock;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i wv[8];  // wv[t] lane l: row l's inputs 4t..4t+3 of this block
    if constexpr (Bits == 4) {
      for (int c = 0; c < 4; ++c) {
        const __m512i packed = _mm512_loadu_si512(w + (b * 4 + c) * 64);
        wv[c] = _mm512_and_si512(packed, low4);
        wv[c + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
      }
    } else {
      for (int t = 0; t < 8; ++t) wv[t] = _mm512_loadu_si512(w + (b * 8 + t) * 64);
    }
    const __m512 ws = load_fp16(scales + b * kQLanes);
    for (int i = 0; i < R; ++i) {
      const int64_t ab = (m0 + i) * blocks + b;
      const int8_t* xq = a.q.data() + ab * kQBlock;
      __m512i dot = Bits == 4 ? _mm512_setzero_si512() : _mm512_set1_epi32(a.corr[ab]);
      for (int t = 0; t < 8; ++t) dot = _mm512_dpbusd_epi32(dot, wv[t], broadcast4(xq + 4 * t));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, _mm512_set1_ps(a.scale[ab])), acc[i]);
      if constexpr (Bits == 4) acc[i] = _mm512_fmadd_ps(load_fp16(mins + b * kQLanes), _mm512_set1_ps(a.sum[ab]), acc[i]);
    }
  }
}

template <int Bits, typename T>
void quant_gemm(const T* x, const uint8_t* w, const uint16_t* scales, const uint16_t* mins, const T* bias, T* y,
                int64_t M, int64_t N, int64_t K) {
  thread_local QuantActs mine;
  const QuantActs& acts = mine;  // the calling thread's (in the team, `mine` names each thread's own)
  quantize_acts(x, M, K, mine);
  const int64_t blocks = K / kQBlock, groups = (N + kQLanes - 1) / kQLanes, passes = (M + kQRows - 1) / kQRows;
  const int64_t group_bytes = blocks * (Bits == 4 ? 256 : 512);
  shared_for(passes * groups, [&](int64_t item, int64_t) {
    const int64_t p = item / groups, g = item % groups;
    const int64_t m0 = p * kQRows, rows = std::min<int64_t>(kQRows, M - m0);
    const uint8_t* wg = w + g * group_bytes;
    const uint16_t* sg = scales + g * blocks * kQLanes;
    const uint16_t* mg = Bits == 4 ? mins + g * blocks * kQLanes : nullptr;
    __m512 acc[kQRows];
    switch (rows) {  // the rows' accumulators stay in registers: one instance per count
      case 8: quant_group<Bits, 8>(wg, sg, mg, acts, m0, K, acc); break;
      case 7: quant_group<Bits, 7>(wg, sg, mg, acts, m0, K, acc); break;
      case 6: quant_group<Bits, 6>(wg, sg, mg, acts, m0, K, acc); break;
      case 5: quant_group<Bits, 5>(wg, sg, mg, acts, m0, K, acc); break;
      case 4: quant_group<Bits, 4>(wg, sg, mg, acts, m0, K, acc); break;
      case 3: quant_group<Bits, 3>(wg, sg, mg, acts, m0, K, acc); break;
      case 2: quant_group<Bits, 2>(wg, sg, mg, acts, m0, K, acc); break;
      default: quant_group<Bits, 1>(wg, sg, mg, acts, m0, K, acc); break;
    }
    const int64_t n0 = g * kQLanes, lanes = std::min<int64_t>(kQLanes, N - n0);  // the last group's padding
    for (int64_t i = 0; i < rows; ++i) {
      alignas(64) float v[kQLanes];
      _mm512_store_ps(v, acc[i]);
      T* out = y + (m0 + i) * N + n0;
      for (int64_t l = 0; l < lanes; ++l) store(out + l, bias == nullptr ? v[l] : v[l] + to_float(bias[n0 + l]));
    }
  });
}
#endif  // AVX-512 VNNI

}  // namespace

extern "C" {

#if defined(PPSERVE_FLOAT_GEMM) && defined(__AVX512F__)  // AVX2's: cpu_gemm_avx2.cpp
void float_gemm_f32(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  float_gemm<false>(x, w, bias, y, M, N, K);
}
void float_gemm_silu_f32(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N,
                         int64_t K) {
  float_gemm<true>(x, w, bias, y, M, N, K);
}
#endif

#if defined(PPSERVE_BF16_GEMM) && defined(__AVX512BF16__)
void float_gemm_bf16(const uint16_t* x, const uint32_t* w, const uint16_t* bias, uint16_t* y, int64_t M, int64_t N,
                     int64_t K) {
  bf16_gemm(x, w, bias, y, M, N, K);
}
#endif

#if defined(PPSERVE_QUANT_GEMM)
#define PPSERVE_QUANT_KERNELS(SUFFIX, T)                                                                             \
  void quant_gemm_q4_##SUFFIX(const T* x, const uint8_t* w, const uint16_t* scales, const uint16_t* mins,            \
                              const T* bias, T* y, int64_t M, int64_t N, int64_t K) {                               \
    quant_gemm<4>(x, w, scales, mins, bias, y, M, N, K);                                                              \
  }                                                                                                                   \
  void quant_gemm_q8_##SUFFIX(const T* x, const uint8_t* w, const uint16_t* scales, const uint16_t* mins,            \
                              const T* bias, T* y, int64_t M, int64_t N, int64_t K) {                               \
    quant_gemm<8>(x, w, scales, mins, bias, y, M, N, K);                                                              \
  }

PPSERVE_QUANT_KERNELS(f32, float)
PPSERVE_QUANT_KERNELS(bf16, uint16_t)
#endif

}  // extern "C"
