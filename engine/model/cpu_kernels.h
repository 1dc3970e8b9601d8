// What the kernel sources share (cpu_kernels.cpp, cpu_gemm.cpp): the headers they use, and a
// bfloat16 stored as the high half of a float32, converted as torch converts it.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ppserve {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {  // bfloat16: the high half of a float32
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // round to nearest even, as torch's .to(bfloat16)
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *p = static_cast<uint16_t>((bits >> 16) | 0x40);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *p = static_cast<uint16_t>(bits >> 16);
}

// Elementwise work is split over threads only when there is enough of it to pay for waking them.
constexpr int64_t kParallelElements = 1 << 15;

#if defined(__AVX512F__)
// exp(x) for SiLU (silu_mul, float_gemm_silu) and decode attention's softmax, within 2 float32
// ulps, the library's own because libmvec's expf was a large share of silu_mul's time at prefill
// sizes (docs/benchmarks.md#against-vllm-and-llamacpp). 2^n e^r with
// n = round(x log2 e) and |r| <= ln 2 / 2 (ln 2 in two parts, so that r is exact), e^r by Cephes'
// expf polynomial, and 2^n applied by scalef, which overflows to infinity and underflows to zero
// as exp does. x is clamped first (min/max with x second keep NaN).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), _mm512_min_ps(_mm512_set1_ps(89.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// Sixteen floats rounded to bfloat16 values (to nearest even, NaN kept, as `store`), still floats.
inline __m512 round_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), bits, _mm512_set1_epi32(0x400000));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// SiLU(x) = x / (1 + e^-x), the one expression silu_mul and float_gemm_silu both compute, so that
// their results are bitwise equal.
inline __m512 silu16(__m512 x) {
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same on 256-bit vectors, for x86 CPUs without AVX-512 (every helper computes what its
// 512-bit namesake computes, lane for lane). AVX2 has no scalef: 2^n is applied as two powers of
// two of half the exponent each, both normal floats, so that only the last multiply rounds.
#define PPSERVE_AVX2 1
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-104.0f), _mm256_min_ps(_mm256_set1_ps(89.0f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_cvtps_epi32(n);  // NaN x: garbage here, but p is NaN already
  const __m256i e1 = _mm256_srai_epi32(e, 1), e2 = _mm256_sub_epi32(e, e1);
  auto pow2 = [](__m256i k) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23)); };
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(e1)), pow2(e2));
}

inline __m256 round_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 kept = _mm256_castsi256_ps(_mm256_or_si256(bits, _mm256_set1_epi32(0x400000)));
  const __m256 out = _mm256_blendv_ps(_mm256_castsi256_ps(r), kept, nan);
  return _mm256_and_ps(out, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline __m256 silu8(__m256 x) {
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // bfloat16 -> float: into the high half
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(uint16_t* p, __m256 x) {  // x already a bfloat16 value (round8)
  const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
template <typename T>
inline __m256 round8(__m256 x) {  // eight floats rounded to T and back
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return round_bf16(x);
  }
}
inline float reduce_add8(__m256 a) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
inline float reduce_max8(__m256 a) {
  const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
}
#endif

// Items [0, n) over the calling thread's OpenMP team, as `omp parallel for schedule(static)` splits
// them (one contiguous range per thread, each taken in order from its front), except that a thread
// whose range is done then takes the items still left at the back of the others', one at a time.
// Why: at batch 1 a GEMM is a pass over its weights at memory speed, a region so short that one
// wake-up is a sizeable part of it, and the server's other threads (its host, event loops, ZeroMQ's
// I/O) wake on these same cores every token. Each wake-up stops one thread of the team; under a
// static split the other one then waited at the region's end for as long, and a served step took
// longer than the same step in one process. A dynamic schedule would have covered for it too, but
// interleaved items break each thread's sequential stream through the weights, which made a step
// slower. Beside a busy process this takes less time than the static split; alone, the same.
// Which thread computes an item does not change its result. f(item, next): `next` is the item
// that thread most likely takes after this one (for its prefetches), or -1. n < 2^32. `f` must not
// call shared_for with the same `F` (its ranges are per calling thread and per `F`).
template <typename F>
void shared_for(int64_t n, F&& f) {
  // Per thread, its range's front (low 32 bits) and back (high 32 bits), in one word so that the
  // owner (front) and a thief (back) never take the same item; a cache line each.
  struct alignas(64) Range {
    std::atomic<uint64_t> v;
  };
  const int team = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), n)));
  thread_local std::vector<Range> mine;
  if (mine.size() < static_cast<size_t>(team)) mine = std::vector<Range>(team);
  Range* const ranges = mine.data();  // the calling thread's (in the team, `mine` names each thread's own)
  for (int t = 0; t < team; ++t) {  // before the region: its start is a barrier
    const uint64_t front = n * t / team, back = n * (t + 1) / team;
    ranges[t].v.store(front | back << 32, std::memory_order_relaxed);
  }
  auto take = [ranges](int victim, bool from_front) -> int64_t {
    std::atomic<uint64_t>& r = ranges[victim].v;
    uint64_t cur = r.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = cur & 0xffffffffu, back = cur >> 32;
      if (front >= back) return -1;
      const uint64_t taken = from_front ? (front + 1) | back << 32 : front | (back - 1) << 32;
      if (r.compare_exchange_weak(cur, taken, std::memory_order_relaxed)) {
        return static_cast<int64_t>(from_front ? front : back - 1);
      }
    }
  };
#pragma omp parallel num_threads(team)
  {
    // (a team smaller than asked for leaves ranges without an owner: the others take them)
    const int me = omp_get_thread_num();
    for (int64_t i; (i = take(me, true)) >= 0;) f(i, i + 1 < n ? i + 1 : -1);
    for (int d = 1; d < team; ++d) {  // then the others' leftovers, from their backs
      for (int64_t i; (i = take((me + d) % team, false)) >= 0;) f(i, i - 1);
    }
  }
}

}  // namespace ppserve

// The GEMMs each CPU gets (cpu_gemm.cpp): float32 with AVX-512 or AVX2, the quantized ones with VNNI too.
#if defined(__AVX512F__) || defined(PPSERVE_AVX2)
#define PPSERVE_FLOAT_GEMM 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PPSERVE_QUANT_GEMM 1
#endif
// bfloat16: with the CPU's bfloat16 dot products (AVX-512 BF16), or AVX2 widening the weights to float.
#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)) || defined(PPSERVE_AVX2)
#define PPSERVE_BF16_GEMM 1
#endif

// The kernels that decode_step.cpp strings together (their comments are where they are defined:
// cpu_kernels.cpp, cpu_gemm.cpp and gguf_gemm.cpp), in float32 (f32) and bfloat16 (bf16, as uint16_t).
extern "C" {
#define PPSERVE_DECLARE_KERNELS(SUFFIX, T)                                                                            \
  void decode_attention_##SUFFIX(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lens,      \
                                 T* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,           \
                                 int64_t block_size, int64_t max_blocks, float scale, int64_t window);               \
  void rms_norm_##SUFFIX(T* h, const T* add, const T* weight, T* out, int64_t rows, int64_t dim, float eps);          \
  void silu_mul_##SUFFIX(const T* gate_up, T* out, int64_t rows, int64_t dim);                                       \
  void gelu_mul_##SUFFIX(const T* gate_up, T* out, int64_t rows, int64_t dim);                                       \
  void rope_write_kv_##SUFFIX(T* q, int64_t q_stride, T* k, int64_t k_stride, const T* v, int64_t v_stride,           \
                              const T* cos, const T* sin, const int64_t* slots, T* k_cache, T* v_cache, int64_t n,  \
                              int64_t heads, int64_t kv_heads, int64_t head_dim);                                    \
  void quant_gemm_q4_##SUFFIX(const T* x, const uint8_t* w, const uint16_t* scales, const uint16_t* mins,            \
                              const T* bias, T* y, int64_t M, int64_t N, int64_t K);                                 \
  void quant_gemm_q8_##SUFFIX(const T* x, const uint8_t* w, const uint16_t* scales, const uint16_t* mins,            \
                              const T* bias, T* y, int64_t M, int64_t N, int64_t K);                                 \
  void gguf_linear_##SUFFIX(const T* x, int64_t M, int64_t K, int64_t parts, const int64_t* types,                    \
                            const uint8_t* const* weights, const int64_t* rows, const T* bias, T* y);
PPSERVE_DECLARE_KERNELS(f32, float)
PPSERVE_DECLARE_KERNELS(bf16, uint16_t)
#undef PPSERVE_DECLARE_KERNELS
void float_gemm_f32(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K);
void float_gemm_silu_f32(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K);
void float_gemm_bf16(const uint16_t* x, const uint32_t* w, const uint16_t* bias, uint16_t* y, int64_t M, int64_t N,
                     int64_t K);
}
