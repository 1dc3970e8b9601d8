// The CPU kernels of a stage's forward pass, built at first use by engine/model/cpu_kernels.py
// (g++ -O3 -march=native -fopenmp, with float reassociation allowed but NaN and infinity kept) and
// called through ctypes. OpenMP here is torch's own runtime (the same libgomp.so.1, already
// loaded), so the work is split over the calling thread's torch.set_num_threads team.
//
// - decode_attention: one query token per request, straight from the paged KV cache; keys and
//   values are read where they lie in their blocks, never gathered into a new tensor.
// - prefill_attention: the causal attention of prompt chunks, in tiles of keys (on CPUs with
//   AVX-512 BF16: bfloat16 dot products, float32 the same loops with FMAs; on AVX2: FMAs, bfloat16
//   widened to float).
// - rms_norm: the residual add and RMSNorm of a decoder layer in one pass.
// - silu_mul, gelu_mul: the MLP's SiLU(gate) * up, or GELU(gate) * up (Gemma).
// - rope_write_kv: RoPE on q and k in place of the copy, k and v stored into the cache.
// Each replaces several torch ops (and as many dispatches and passes over memory) per layer, and
// rounds where those ops round, so results stay those of the torch code they replace up to the
// order of a sum (tests/model/test_fast_paths.py). The GEMMs are in cpu_gemm.cpp.
//
// Decode attention's shapes (row-major, contiguous):
//   q, out:   [batch, heads, head_dim]
//   k, v:     [num_blocks, block_size, kv_heads, head_dim]   (one layer's cache)
//   tables:   [batch, max_blocks] int64     lens: [batch] int64 (keys per request, >= 1)
// A query at position lens[b] - 1 sees keys [lo, lens[b]) with lo = max(0, lens[b] - window)
// (window 0: no window), as transformers' causal and sliding-window masks do.

#include "cpu_kernels.h"

// glibc's vector math library has SIMD versions of expf; declaring them lets `omp simd` loops
// call them (GCC declares them itself only under -ffast-math, which would also drop NaN/Inf).
extern "C" float expf(float) __attribute__((__simd__("notinbranch")));

namespace {

using namespace ppserve;

// The probabilities are rounded to the cache's type before they weight the values, as torch's
// flash attention does for reduced precision (its P @ V is a GEMM in that type); the softmax's
// sum stays in float. This keeps bfloat16 results close to what transformers computes.
template <typename T>
float round_as(float x) {
  T r;
  store(&r, x);
  return to_float(r);
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // bfloat16 -> float: into the high half
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Sixteen floats rounded to T and back (bfloat16: to nearest even, NaN kept, as `store`).
template <typename T>
inline __m512 round16(__m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return round_bf16(x);
  }
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(uint16_t* p, __m512 x) {  // x already a bfloat16 value (round16)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
}

// The two loops over keys of a task with head_dim = 16 * NV, in registers.
//
// Scores: sixteen tokens' dot products with one query head are sixteen vectors of partial sums;
// one transpose-and-add tree (sum16) turns them into a vector of the sixteen scores, about three
// instructions a token where reducing each vector on its own takes ten. Sixteen keys are read from
// memory once, for the first query head of their kv head, and from the L1 cache for the others;
// bfloat16 keys are widened to float once for all of those heads, not once a head, which saves the
// more the more query heads share a kv head (docs/benchmarks.md#against-vllm-and-llamacpp).
//
// Values: a token's value is loaded once for a block of JB query heads, and every accumulator is
// a register, so that consecutive tokens' work overlaps. The sums are the same ones in another
// order.
inline __m512 pair_sum(__m512 a, __m512 b) {  // per 128-bit lane: a's two halves summed, then b's
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

// r[i] = the sum of v[i]'s sixteen lanes.
inline __m512 sum16(const __m512* v) {
  __m512 p[8], q[4], r[2];
  for (int i = 0; i < 8; ++i) p[i] = pair_sum(v[2 * i], v[2 * i + 1]);  // 2 partial sums of 2 vectors a lane
  for (int i = 0; i < 4; ++i)  // a lane: one partial sum of each of 4 vectors
    q[i] = _mm512_add_ps(_mm512_shuffle_ps(p[2 * i], p[2 * i + 1], 0x44), _mm512_shuffle_ps(p[2 * i], p[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // lanes summed in pairs
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0x88), _mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], 0x88), _mm512_shuffle_f32x4(r[0], r[1], 0xDD));
}

template <typename T, int NV>
inline void prefetch_row(const T* p) {  // head_dim = 16 * NV elements of T
  for (size_t b = 0; b < 16 * NV * sizeof(T); b += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T0);
}

template <typename T, int NV>
inline __m512 dot_partial(const __m512* qv, const T* key) {
  __m512 acc = _mm512_mul_ps(qv[0], load16(key));
  for (int i = 1; i < NV; ++i) acc = _mm512_fmadd_ps(qv[i], load16(key + 16 * i), acc);
  return acc;
}

// Sixteen tokens' scores for each of the `group` query heads: key u is `row(u)`.
template <typename K, int NV, typename Row>
inline void score_16(const float* qf, int64_t group, Row row, __m512 vscale, float* scores, int64_t n) {
  for (int64_t j = 0; j < group; ++j) {
    __m512 qv[NV], acc[16];
    for (int i = 0; i < NV; ++i) qv[i] = _mm512_loadu_ps(qf + j * 16 * NV + 16 * i);
    for (int u = 0; u < 16; ++u) acc[u] = dot_partial<K, NV>(qv, row(u));
    _mm512_storeu_ps(scores + j * n, _mm512_mul_ps(sum16(acc), vscale));
  }
}

template <typename T, int NV>
void scores_simd(const float* qf, int64_t group, const T* const* keys, int64_t n, float scale, float* scores) {
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    // the next sixteen keys start coming from memory while these are used
    for (int64_t u = t + 16; u < std::min(t + 32, n); ++u) prefetch_row<T, NV>(keys[u]);
    if (std::is_same_v<T, float> || group == 1) {
      score_16<T, NV>(qf, group, [&](int u) { return keys[t + u]; }, vscale, scores + t, n);
    } else {  // bfloat16 keys shared by several query heads: widened (exactly) once, not once a head
      alignas(64) float kf[16 * 16 * NV];
      for (int u = 0; u < 16; ++u)
        for (int i = 0; i < NV; ++i) _mm512_store_ps(kf + (u * NV + i) * 16, load16(keys[t + u] + 16 * i));
      score_16<float, NV>(qf, group, [&](int u) { return kf + u * NV * 16; }, vscale, scores + t, n);
    }
  }
  for (; t < n; ++t) {
    for (int64_t j = 0; j < group; ++j) {
      __m512 qv[NV];
      for (int i = 0; i < NV; ++i) qv[i] = _mm512_loadu_ps(qf + j * 16 * NV + 16 * i);
      scores[j * n + t] = _mm512_reduce_add_ps(dot_partial<T, NV>(qv, keys[t])) * scale;
    }
  }
}

template <typename T, int NV>
void values_simd(const float* probs, int64_t group, const T* const* values, int64_t n, float* acc_out) {
  constexpr int JB = 16 / NV;  // JB * NV accumulator registers
  for (int64_t j0 = 0; j0 < group; j0 += JB) {
    const int64_t jn = std::min<int64_t>(JB, group - j0);
    __m512 acc[JB][NV];
    for (int j = 0; j < JB; ++j)
      for (int i = 0; i < NV; ++i) acc[j][i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      // a value is asked for 32 tokens ahead rather than 8, so that its lines have come from memory
      // by the time the loop reaches it (docs/benchmarks.md#against-vllm-and-llamacpp)
      if (j0 == 0 && t + 32 < n) prefetch_row<T, NV>(values[t + 32]);
      __m512 vv[NV];
      for (int i = 0; i < NV; ++i) vv[i] = load16(values[t] + 16 * i);
      for (int j = 0; j < JB; ++j) {
        const __m512 p = _mm512_set1_ps(j < jn ? probs[(j0 + j) * n + t] : 0.0f);
        for (int i = 0; i < NV; ++i) acc[j][i] = _mm512_fmadd_ps(p, vv[i], acc[j][i]);
      }
    }
    for (int j = 0; j < jn; ++j)
      for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc_out + (j0 + j) * 16 * NV + 16 * i, acc[j][i]);
  }
}

#if defined(__AVX512BF16__)
// The same two loops for bfloat16 with the CPU's bfloat16 dot products (vdpbf16ps: two products a
// float lane), which take pairs of elements as they lie in memory: no widening to float, half the
// multiply instructions. What is left of the time is mostly waiting on the keys and values from
// memory (docs/benchmarks.md#against-vllm-and-llamacpp).
//
// Scores: a query head's dot product with a key is NV / 2 of them over the raw rows.
template <int NV>
void scores_bf16(const uint16_t* qb, int64_t group, const uint16_t* const* keys, int64_t n, float scale,
                 float* scores) {
  constexpr int NP = NV / 2;  // 512-bit registers a row: 32 elements each
  const __m512 vscale = _mm512_set1_ps(scale);
  auto dot = [](const __m512i* qv, const uint16_t* key) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < NP; ++i)
      acc = _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(qv[i]), reinterpret_cast<__m512bh>(_mm512_loadu_si512(key + 32 * i)));
    return acc;
  };
  for (int64_t t = 0; t < n; t += 16) {
    const int64_t m = std::min<int64_t>(16, n - t);
    for (int64_t u = t + 16; u < std::min(t + 32, n); ++u) prefetch_row<uint16_t, NV>(keys[u]);
    for (int64_t j = 0; j < group; ++j) {
      __m512i qv[NP];
      for (int i = 0; i < NP; ++i) qv[i] = _mm512_loadu_si512(qb + j * 16 * NV + 32 * i);
      if (m == 16) {
        __m512 acc[16];
        for (int u = 0; u < 16; ++u) acc[u] = dot(qv, keys[t + u]);
        _mm512_storeu_ps(scores + j * n + t, _mm512_mul_ps(sum16(acc), vscale));
      } else {
        for (int64_t u = 0; u < m; ++u) scores[j * n + t + u] = _mm512_reduce_add_ps(dot(qv, keys[t + u])) * scale;
      }
    }
  }
}

// Values: two tokens' rows interleaved element by element (vpunpck{l,h}wd, within 128-bit lanes)
// are what a pair of probabilities multiplies; the accumulators hold the columns in that order,
// put back in place at the end.
template <int NV>
void values_bf16(const float* probs, int64_t group, const uint16_t* const* values, int64_t n, float* acc_out) {
  constexpr int JB = 16 / NV;
  constexpr int64_t D = 16 * NV;
  static const uint16_t zeros[16 * 8] = {};  // the row after an odd token count
  const int64_t pairs = (n + 1) / 2;
  thread_local std::vector<uint32_t> pw;  // [group][pairs]: probabilities as bfloat16 pairs
  pw.resize(group * pairs);
  for (int64_t j = 0; j < group; ++j)
    for (int64_t t = 0; t < pairs; ++t) {
      uint32_t lo, hi = 0;  // the probabilities are bfloat16 values already: their high halves
      std::memcpy(&lo, probs + j * n + 2 * t, 4);
      if (2 * t + 1 < n) std::memcpy(&hi, probs + j * n + 2 * t + 1, 4);
      pw[j * pairs + t] = (lo >> 16) | (hi & 0xffff0000u);
    }
  for (int64_t j0 = 0; j0 < group; j0 += JB) {
    const int64_t jn = std::min<int64_t>(JB, group - j0);
    __m512 acc[JB][NV];
    for (int j = 0; j < JB; ++j)
      for (int i = 0; i < NV; ++i) acc[j][i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < pairs; ++t) {
      if (j0 == 0 && 2 * t + 32 < n) {
        prefetch_row<uint16_t, NV>(values[2 * t + 32]);
        if (2 * t + 32 + 1 < n) prefetch_row<uint16_t, NV>(values[2 * t + 32 + 1]);
      }
      const uint16_t* a = values[2 * t];
      const uint16_t* b = 2 * t + 1 < n ? values[2 * t + 1] : zeros;
      __m512i vv[NV];
      for (int i = 0; i < NV / 2; ++i) {
        const __m512i ra = _mm512_loadu_si512(a + 32 * i), rb = _mm512_loadu_si512(b + 32 * i);
        vv[2 * i] = _mm512_unpacklo_epi16(ra, rb);
        vv[2 * i + 1] = _mm512_unpackhi_epi16(ra, rb);
      }
      for (int j = 0; j < JB; ++j) {
        const __m512i p = _mm512_set1_epi32(j < jn ? static_cast<int>(pw[(j0 + j) * pairs + t]) : 0);
        for (int i = 0; i < NV; ++i)
          acc[j][i] = _mm512_dpbf16_ps(acc[j][i], reinterpret_cast<__m512bh>(p), reinterpret_cast<__m512bh>(vv[i]));
      }
    }
    for (int j = 0; j < jn; ++j) {
      float* o = acc_out + (j0 + j) * D;
      for (int i = 0; i < NV; ++i) {
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, acc[j][i]);
        // lane k of register i: 128-bit lane k / 4 of the 32 columns from 32 * (i / 2), the low
        // (even i) or high (odd i) four of that lane's eight
        for (int k = 0; k < 16; ++k) o[32 * (i / 2) + 8 * (k / 4) + 4 * (i % 2) + k % 4] = lanes[k];
      }
    }
  }
}
#endif
#elif defined(PPSERVE_AVX2)
// The two loops over keys on 256-bit vectors (head_dim = 8 * NV), for CPUs without AVX-512, written
// out because the compiler, left to vectorize the plain loops below, made decode attention several
// times slower (docs/benchmarks.md#k-quant-gguf-files-against-llamacpp).
//
// Scores: eight tokens' dot products with one query head are eight vectors of partial sums, summed
// into one vector of the eight scores by one transpose-and-add tree (sum8). bfloat16 keys are
// widened once for all the query heads of their kv head.
inline __m256 sum8(const __m256* v) {  // r[i] = the sum of v[i]'s eight lanes
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit lane: 4 vectors' half sums
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <typename T, int NV>
inline void prefetch_row(const T* p) {  // head_dim = 8 * NV elements of T
  for (size_t b = 0; b < 8 * NV * sizeof(T); b += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T0);
}

template <typename T, int NV>
inline __m256 dot_partial(const float* q, const T* key) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), load8(key));
  for (int i = 1; i < NV; ++i) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * i), load8(key + 8 * i), acc);
  return acc;
}

template <typename T, int NV>
void scores_simd(const float* qf, int64_t group, const T* const* keys, int64_t n, float scale, float* scores) {
  const __m256 vscale = _mm256_set1_ps(scale);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    for (int64_t u = t + 8; u < std::min(t + 16, n); ++u) prefetch_row<T, NV>(keys[u]);
    alignas(32) float kf[std::is_same_v<T, float> ? 1 : 8 * 8 * NV];
    const float* rows[8];
    for (int u = 0; u < 8; ++u) {
      if constexpr (std::is_same_v<T, float>) {
        rows[u] = keys[t + u];
      } else {
        for (int i = 0; i < NV; ++i) _mm256_store_ps(kf + (u * NV + i) * 8, load8(keys[t + u] + 8 * i));
        rows[u] = kf + u * NV * 8;
      }
    }
    for (int64_t j = 0; j < group; ++j) {
      __m256 acc[8];
      for (int u = 0; u < 8; ++u) acc[u] = dot_partial<float, NV>(qf + j * 8 * NV, rows[u]);
      _mm256_storeu_ps(scores + j * n + t, _mm256_mul_ps(sum8(acc), vscale));
    }
  }
  for (; t < n; ++t)
    for (int64_t j = 0; j < group; ++j) scores[j * n + t] = reduce_add8(dot_partial<T, NV>(qf + j * 8 * NV, keys[t])) * scale;
}

// Values: per query head and 64 columns at a time, eight accumulator registers; a token's value
// row is read from memory for the first head and from the cache for the others.
template <typename T, int NV>
void values_simd(const float* probs, int64_t group, const T* const* values, int64_t n, float* acc_out) {
  constexpr int C = NV < 8 ? NV : 8;  // registers a pass
  for (int64_t j = 0; j < group; ++j) {
    for (int c = 0; c < NV; c += C) {
      __m256 acc[C];
      for (int i = 0; i < C; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t t = 0; t < n; ++t) {
        if (j == 0 && c == 0 && t + 32 < n) prefetch_row<T, NV>(values[t + 32]);
        const __m256 p = _mm256_set1_ps(probs[j * n + t]);
        for (int i = 0; i < C; ++i) acc[i] = _mm256_fmadd_ps(p, load8(values[t] + 8 * (c + i)), acc[i]);
      }
      for (int i = 0; i < C; ++i) _mm256_storeu_ps(acc_out + j * 8 * NV + 8 * (c + i), acc[i]);
    }
  }
}
#endif

// s[0, n) -> exp(s - max s), each rounded to T (see round_as); returns the sum of the unrounded
// values. Vectorized: in bfloat16 the scalar loops (the maximum, each probability's rounding)
// were a large share of decode attention (docs/benchmarks.md#against-vllm-and-llamacpp).
template <typename T>
float softmax(float* s, int64_t n) {
  float m = s[0];
  float sum = 0.0f;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(m);
  for (; t + 16 <= n; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + t));
  m = _mm512_reduce_max_ps(vm);
  for (; t < n; ++t) m = s[t] > m ? s[t] : m;
  const __m512 vmax = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (t = 0; t + 16 <= n; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), vmax));
    vsum = _mm512_add_ps(vsum, e);
    _mm512_storeu_ps(s + t, round16<T>(e));
  }
  sum = _mm512_reduce_add_ps(vsum);
#elif defined(PPSERVE_AVX2)
  __m256 vm = _mm256_set1_ps(m);
  for (; t + 8 <= n; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + t));
  m = reduce_max8(vm);
  for (; t < n; ++t) m = s[t] > m ? s[t] : m;
  const __m256 vmax = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  for (t = 0; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmax));
    vsum = _mm256_add_ps(vsum, e);
    _mm256_storeu_ps(s + t, round8<T>(e));
  }
  sum = reduce_add8(vsum);
#else
  for (t = 1; t < n; ++t) m = s[t] > m ? s[t] : m;
  t = 0;
#endif
  for (; t < n; ++t) {
    const float e = expf(s[t] - m);
    sum += e;
    s[t] = round_as<T>(e);
  }
  return sum;
}

template <typename T>
void decode_attention(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lens, T* out,
                      int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                      int64_t max_blocks, float scale, int64_t window) {
  const int64_t group = heads / kv_heads;  // query heads per kv head
  const int64_t token_stride = kv_heads * head_dim;
  // A task per request, or per request and kv head when there are too few requests to keep every
  // thread busy. A request's kv heads lie side by side in each token's slot, so one task reading
  // them all, head after head, finds the later heads' lines in its cache; split over tasks, each
  // head's reads drag its neighbours' lines in from memory again (slower at 32 requests).
  const int64_t split = batch < 4 * omp_get_max_threads() ? kv_heads : 1;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t task = 0; task < batch * split; ++task) {
    const int64_t b = task / split;
    const int64_t len = lens[b];
    const int64_t lo = window > 0 && len > window ? len - window : 0;
    const int64_t n = len - lo;
    const int64_t* table = tables + b * max_blocks;
    for (int64_t g = task % split * (kv_heads / split); g < (task % split + 1) * (kv_heads / split); ++g) {
      // qf: [group, head_dim] queries in float; scores: [group, n]; acc: [group, head_dim];
      // keys, values: where each token's are
      thread_local std::vector<float> qf, scores, acc;
      thread_local std::vector<const T*> keys, values;
      qf.resize(group * head_dim);
      scores.resize(group * n);
      acc.assign(group * head_dim, 0.0f);
      keys.resize(n);
      values.resize(n);
      const T* qb = q + (b * heads + g * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = to_float(qb[i]);
      // Block by block: one division a block rather than one a token (a division costs as much
      // as a token's dot product).
      for (int64_t t = 0; t < n;) {
        const int64_t pos = lo + t, blk = pos / block_size, within = pos - blk * block_size;
        const int64_t count = std::min(block_size - within, n - t);
        const int64_t offset = (table[blk] * block_size + within) * token_stride + g * head_dim;
        for (int64_t c = 0; c < count; ++c, ++t) {
          keys[t] = k + offset + c * token_stride;
          values[t] = v + offset + c * token_stride;
        }
      }
      bool done = false;
  #if defined(__AVX512F__)
      if (head_dim == 64 || head_dim == 128) {
  #if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, uint16_t>) {
          (head_dim == 64 ? scores_bf16<4> : scores_bf16<8>)(qb, group, keys.data(), n, scale, scores.data());
        } else
  #endif
          (head_dim == 64 ? scores_simd<T, 4> : scores_simd<T, 8>)(qf.data(), group, keys.data(), n, scale, scores.data());
        done = true;
      }
  #elif defined(PPSERVE_AVX2)
      if (head_dim == 64 || head_dim == 128 || head_dim == 256) {
        (head_dim == 64 ? scores_simd<T, 8> : head_dim == 128 ? scores_simd<T, 16> : scores_simd<T, 32>)(
            qf.data(), group, keys.data(), n, scale, scores.data());
        done = true;
      }
  #endif
      if (!done) {
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t j = 0; j < group; ++j) {
            const float* qh = qf.data() + j * head_dim;
            float s = 0.0f;
  #pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * to_float(keys[t][d]);
            scores[j * n + t] = s * scale;
          }
        }
      }
      float denom[64];  // heads per kv head: at most 64 (checked by the caller)
      for (int64_t j = 0; j < group; ++j) denom[j] = softmax<T>(scores.data() + j * n, n);
      done = false;
  #if defined(__AVX512F__)
      if (head_dim == 64 || head_dim == 128) {
  #if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, uint16_t>) {
          (head_dim == 64 ? values_bf16<4> : values_bf16<8>)(scores.data(), group, values.data(), n, acc.data());
        } else
  #endif
          (head_dim == 64 ? values_simd<T, 4> : values_simd<T, 8>)(scores.data(), group, values.data(), n, acc.data());
        done = true;
      }
  #elif defined(PPSERVE_AVX2)
      if (head_dim == 64 || head_dim == 128 || head_dim == 256) {
        (head_dim == 64 ? values_simd<T, 8> : head_dim == 128 ? values_simd<T, 16> : values_simd<T, 32>)(
            scores.data(), group, values.data(), n, acc.data());
        done = true;
      }
  #endif
      if (!done) {
        for (int64_t t = 0; t < n; ++t) {  // acc[j] = sum_t p[j, t] * v_t
          for (int64_t j = 0; j < group; ++j) {
            const float p = scores[j * n + t];
            float* a = acc.data() + j * head_dim;
  #pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * to_float(values[t][d]);
          }
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        const float inv = 1.0f / denom[j];
        T* o = out + (b * heads + g * group + j) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) store(o + d, acc[j * head_dim + d] * inv);
      }
    }
  }
}

#if (defined(__AVX512F__) && defined(__AVX512BF16__)) || defined(PPSERVE_AVX2)
#define PPSERVE_PREFILL_KERNEL 1
// Prefill attention: the queries of prompt chunks, causal over their prompts' keys, by tiles of
// sixteen keys in registers (torch's flash SDPA runs far below the CPU's arithmetic peak on prompts
// of a few hundred tokens, and was a sizeable share of a prefill step:
// docs/benchmarks.md#against-vllm-and-llamacpp).
//
// Shapes (rows of tokens, each with its own row stride in elements, so that q, k and v can be
// the views of one fused projection):
//   q, out: [batch * nq rows][heads, head_dim]   k, v: [batch * nk rows][kv_heads, head_dim]
// Prompt b's query i (row b * nq + i) is at position nk - nq + i and sees its keys [lo, position]
// (lo from the window, as in decode_attention). A task is a prompt, a kv head and kPrefillQueries
// queries: its rows are those queries times the heads of the kv head, which share every key tile.
//
// Within a task: scores in float for the keys its rows can see (tiles past a block of rows' last
// position are skipped), the softmax of decode_attention (the same rounding of the probabilities),
// then P @ V. With AVX-512 BF16, bfloat16's products are vdpbf16ps over pairs of elements: keys
// packed so that a register holds one pair of sixteen keys, values so that it holds sixteen columns
// of a pair of keys. Otherwise (float32, and bfloat16 on AVX2, widened to float as it is packed or
// loaded) they are FMAs over keys transposed into tiles, and values read where they are.
// A row's sums run over its keys in order whatever the rows next to it, so its result does not
// depend on the chunk's other prompts or on how they are split into tasks.
constexpr int64_t kPrefillQueries = 16;
#if defined(__AVX512F__)
constexpr int kScoreRows = 8;  // rows a key tile is loaded for: a register each
template <typename T>
constexpr bool kPairs = std::is_same_v<T, uint16_t>;  // bfloat16 as vdpbf16ps's pairs
#else
constexpr int kScoreRows = 6;  // two registers a row for a tile's sixteen keys: 12 accumulators
template <typename T>
constexpr bool kPairs = false;
#endif
template <typename T>
constexpr int64_t key_words(int64_t head_dim) {  // 32-bit words a key (or query, or value) row
  return kPairs<T> ? head_dim / 2 : head_dim;
}

// Element pairs of bfloat16 rows as 32-bit words (pairs are what vdpbf16ps multiplies).
inline uint32_t pair_at(const uint16_t* row, int64_t j) {
  uint32_t w;
  std::memcpy(&w, row + 2 * j, sizeof w);
  return w;
}

// Row `row` of D elements as `key_words` words: pairs, or floats.
template <typename T, int64_t D>
inline void row_words(const T* row, uint32_t* out, int64_t stride) {
  for (int64_t j = 0; j < key_words<T>(D); ++j) {
    if constexpr (kPairs<T>) {
      out[j * stride] = pair_at(reinterpret_cast<const uint16_t*>(row), j);
    } else {
      const float f = to_float(row[j]);
      std::memcpy(out + j * stride, &f, 4);
    }
  }
}

// kt: keys [0, n) of rows `k` (stride ks), at most sixteen, as a tile [words][16], zero past n.
template <typename T, int64_t D>
void pack_key_tile(const T* k, int64_t ks, int64_t n, uint32_t* kt) {
  constexpr int64_t W = key_words<T>(D);
  std::fill(kt, kt + W * 16, 0u);
  for (int64_t t = 0; t < n; ++t) row_words<T, D>(k + t * ks, kt + t, 16);
}

#if defined(__AVX512F__)
// scores[r][16 * tile + u] = scale * q_r . key u of the tile, for kScoreRows rows of qw (their
// words, W a row) and tiles [0, tiles).
template <typename T, int64_t D>
void score_rows(const uint32_t* qw, const uint32_t* kt, int64_t tiles, float scale, float* scores, int64_t width) {
  constexpr int64_t W = key_words<T>(D);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const uint32_t* kw = kt + tile * W * 16;
    __m512 acc[kScoreRows];
    for (int r = 0; r < kScoreRows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < W; ++j) {
      const __m512i kv = _mm512_loadu_si512(kw + j * 16);
      for (int r = 0; r < kScoreRows; ++r) {
        const __m512i qv = _mm512_set1_epi32(static_cast<int>(qw[r * W + j]));
        if constexpr (std::is_same_v<T, float>) {
          acc[r] = _mm512_fmadd_ps(_mm512_castsi512_ps(qv), _mm512_castsi512_ps(kv), acc[r]);
        } else {
          acc[r] = _mm512_dpbf16_ps(acc[r], reinterpret_cast<__m512bh>(qv), reinterpret_cast<__m512bh>(kv));
        }
      }
    }
    for (int r = 0; r < kScoreRows; ++r) _mm512_storeu_ps(scores + r * width + tile * 16, _mm512_mul_ps(acc[r], vscale));
  }
}

// Rows a P @ V block: as many as keep every column of a row in registers (16 accumulators).
template <int64_t D>
constexpr int kValueRows = static_cast<int>(256 / D);

// acc_out[r] = sum over keys t < n of p[r][t] * value t, for kValueRows rows. p: per row `pw`
// words (float probabilities, or bfloat16 pairs); vw: the values (float: rows of stride vs;
// bfloat16: pairs packed as [n / 2][D] words).
template <typename T, int64_t D>
void value_rows(const uint32_t* p, int64_t pw, const T* v, int64_t vs, const uint32_t* vw, int64_t n, float* acc_out) {
  constexpr int NV = D / 16, RB = kValueRows<D>;
  __m512 acc[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_setzero_ps();
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t t = 0; t < n; ++t) {
      __m512 vv[NV];
      for (int i = 0; i < NV; ++i) vv[i] = _mm512_loadu_ps(v + t * vs + 16 * i);
      for (int r = 0; r < RB; ++r) {
        const __m512 pr = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(p[r * pw + t])));
        for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_fmadd_ps(pr, vv[i], acc[r][i]);
      }
    }
  } else {
    for (int64_t t = 0; t < (n + 1) / 2; ++t) {
      __m512i vv[NV];
      for (int i = 0; i < NV; ++i) vv[i] = _mm512_loadu_si512(vw + t * D + 16 * i);
      for (int r = 0; r < RB; ++r) {
        const __m512i pr = _mm512_set1_epi32(static_cast<int>(p[r * pw + t]));
        for (int i = 0; i < NV; ++i)
          acc[r][i] = _mm512_dpbf16_ps(acc[r][i], reinterpret_cast<__m512bh>(pr), reinterpret_cast<__m512bh>(vv[i]));
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc_out + r * D + 16 * i, acc[r][i]);
}
#else
// The same on 256-bit vectors: a tile's sixteen keys are two registers, so six rows at a time.
template <typename T, int64_t D>
void score_rows(const uint32_t* qw, const uint32_t* kt, int64_t tiles, float scale, float* scores, int64_t width) {
  const __m256 vscale = _mm256_set1_ps(scale);
  const float* qf = reinterpret_cast<const float*>(qw);
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const float* kw = reinterpret_cast<const float*>(kt + tile * D * 16);
    __m256 acc[kScoreRows][2];
    for (int r = 0; r < kScoreRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < D; ++j) {
      const __m256 k0 = _mm256_loadu_ps(kw + j * 16), k1 = _mm256_loadu_ps(kw + j * 16 + 8);
      for (int r = 0; r < kScoreRows; ++r) {
        const __m256 qv = _mm256_broadcast_ss(qf + r * D + j);
        acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < kScoreRows; ++r) {
      _mm256_storeu_ps(scores + r * width + tile * 16, _mm256_mul_ps(acc[r][0], vscale));
      _mm256_storeu_ps(scores + r * width + tile * 16 + 8, _mm256_mul_ps(acc[r][1], vscale));
    }
  }
}

template <int64_t D>
constexpr int kValueRows = 3;  // times four registers of columns: 12 accumulators

// acc_out[r] = sum over keys t < n of p[r][t] * value t (rows of stride vs, widened as loaded), for
// three rows of float probabilities (`pw` a row), 32 columns at a time.
template <typename T, int64_t D>
void value_rows(const uint32_t* p, int64_t pw, const T* v, int64_t vs, const uint32_t*, int64_t n, float* acc_out) {
  constexpr int RB = kValueRows<D>;
  const float* pf = reinterpret_cast<const float*>(p);
  for (int64_t c = 0; c < D; c += 32) {
    __m256 acc[RB][4];
    for (int r = 0; r < RB; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      __m256 vv[4];
      for (int i = 0; i < 4; ++i) vv[i] = load8(v + t * vs + c + 8 * i);
      for (int r = 0; r < RB; ++r) {
        const __m256 pr = _mm256_broadcast_ss(pf + r * pw + t);
        for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_fmadd_ps(pr, vv[i], acc[r][i]);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(acc_out + r * D + c + 8 * i, acc[r][i]);
  }
}
#endif

template <typename T, int64_t D>
void prefill_attention(const T* q, int64_t qs, const T* k, int64_t ks, const T* v, int64_t vs, T* out, int64_t os,
                       int64_t batch, int64_t nq, int64_t nk, int64_t heads, int64_t kv_heads, float scale,
                       int64_t window) {
  constexpr int64_t W = key_words<T>(D);
  constexpr int RB = kValueRows<D>;
  const int64_t group = heads / kv_heads;
  const int64_t blocks = (nq + kPrefillQueries - 1) / kPrefillQueries;
  const int64_t tasks = batch * kv_heads * blocks;
  auto lo_of = [&](int64_t pos) { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : int64_t{0}; };
  // The keys any query sees, per prompt and kv head, as tiles [batch][kv_heads][key_tiles] from the
  // tile of the first query's lowest key, packed once: packed by each task, they cost a third of
  // the time of a prompt of a few hundred tokens.
  const int64_t first_tile = lo_of(nk - nq) / 16, key_tiles = (nk + 15) / 16 - first_tile, tile_words = W * 16;
  thread_local std::vector<uint32_t> packed;  // the calling thread's (the team's threads have their own)
  packed.resize(batch * kv_heads * key_tiles * tile_words);
  uint32_t* const tiles_at = packed.data();
#pragma omp parallel for
  for (int64_t i = 0; i < batch * kv_heads * key_tiles; ++i) {
    const int64_t b = i / (kv_heads * key_tiles), g = i / key_tiles % kv_heads;
    const int64_t t0 = (first_tile + i % key_tiles) * 16;
    pack_key_tile<T, D>(k + (b * nk + t0) * ks + g * D, ks, std::min<int64_t>(16, nk - t0), tiles_at + i * tile_words);
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t task = 0; task < tasks; ++task) {
    // The last queries (the most keys) first, so that the short tasks fill in at the end.
    const int64_t qb = blocks - 1 - task / (batch * kv_heads);
    const int64_t b = task % (batch * kv_heads) / kv_heads, g = task % kv_heads;
    const int64_t i0 = qb * kPrefillQueries, i1 = std::min(nq, i0 + kPrefillQueries);
    // Keys [base, base + n): from the tile of the first query's lowest key to the last query's own
    // position (keys before a row's lowest get probability zero).
    const int64_t base = lo_of(nk - nq + i0) / 16 * 16, n = nk - nq + i1 - base;
    const int64_t tiles = (n + 15) / 16, width = tiles * 16;
    const int64_t rows = (i1 - i0) * group;  // row r: query i0 + r / group, head g * group + r % group
    const int64_t padded = (rows + kScoreRows - 1) / kScoreRows * kScoreRows;
    const uint32_t* kt = tiles_at + ((b * kv_heads + g) * key_tiles + base / 16 - first_tile) * tile_words;
    const T* vb = v + (b * nk + base) * vs + g * D;
    thread_local std::vector<uint32_t> qw, pw, vw;
    thread_local std::vector<float> scores, acc;
    thread_local std::vector<float> denom;
    qw.assign(padded * W, 0u);
    for (int64_t r = 0; r < rows; ++r)
      row_words<T, D>(q + (b * nq + i0 + r / group) * qs + (g * group + r % group) * D, qw.data() + r * W, 1);
    scores.resize(padded * width);
    denom.resize(rows);
    for (int64_t r0 = 0; r0 < padded; r0 += kScoreRows) {
      const int64_t r_last = std::min<int64_t>(r0 + kScoreRows, rows) - 1;
      const int64_t hi = nk - nq + i0 + r_last / group + 1 - base;
      score_rows<T, D>(qw.data() + r0 * W, kt, (hi + 15) / 16, scale, scores.data() + r0 * width, width);
    }
    // Probabilities: zero outside a row's keys, so that a block of rows shares one loop over keys.
    const int64_t pwidth = kPairs<T> ? width / 2 : width;
    pw.assign((rows + RB - 1) / RB * RB * pwidth, 0u);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = nk - nq + i0 + r / group, lo = lo_of(pos) - base, hi = pos + 1 - base;
      float* s = scores.data() + r * width;
      denom[r] = softmax<T>(s + lo, hi - lo);
      for (int64_t t = lo; t < hi; ++t) {
        uint32_t bits;
        std::memcpy(&bits, s + t, 4);
        if constexpr (kPairs<T>) {  // already a bfloat16 value: its high half
          reinterpret_cast<uint16_t*>(pw.data() + r * pwidth)[t] = static_cast<uint16_t>(bits >> 16);
        } else {
          pw[r * pwidth + t] = bits;
        }
      }
    }
    if constexpr (kPairs<T>) {  // values as [pair of keys][D] words
      vw.assign((n + 1) / 2 * D, 0u);
      auto* vh = reinterpret_cast<uint16_t*>(vw.data());
      for (int64_t t = 0; t < n; ++t)
        for (int64_t d = 0; d < D; ++d) vh[(t / 2 * D + d) * 2 + t % 2] = vb[t * vs + d];
    }
    acc.resize(RB * D);
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
      const int64_t rn = std::min<int64_t>(RB, rows - r0);
      const int64_t hi = nk - nq + i0 + (r0 + rn - 1) / group + 1 - base;
      value_rows<T, D>(pw.data() + r0 * pwidth, pwidth, vb, vs, vw.data(), hi, acc.data());
      for (int64_t r = r0; r < r0 + rn; ++r) {
        const float inv = 1.0f / denom[r];
        T* o = out + (b * nq + i0 + r / group) * os + (g * group + r % group) * D;
        for (int64_t d = 0; d < D; ++d) store(o + d, acc[(r - r0) * D + d] * inv);
      }
    }
  }
}
#endif

// h += add (when given, rounded to T as torch's h + a), then out = weight * rmsnorm(h): the norm
// in float, rounded to T before the weight multiplies it (as transformers' LlamaRMSNorm).
template <typename T>
void rms_norm(T* h, const T* add, const T* weight, T* out, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows * dim >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    T* x = h + r * dim;
    const T* a = add == nullptr ? nullptr : add + r * dim;
    T* o = out + r * dim;
    float sum = 0.0f;
    int64_t i = 0;
#if defined(__AVX512F__)
    // The add and the sum of squares in one pass, on 512-bit vectors, written out because
    // bfloat16's scalar rounding kept GCC from vectorizing the add
    __m512 squares = _mm512_setzero_ps();
    for (; i + 16 <= dim; i += 16) {
      __m512 v = load16(x + i);
      if (a != nullptr) {
        v = round16<T>(_mm512_add_ps(v, load16(a + i)));
        store16(x + i, v);
      }
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    sum = _mm512_reduce_add_ps(squares);
#elif defined(PPSERVE_AVX2)
    __m256 squares = _mm256_setzero_ps();
    for (; i + 8 <= dim; i += 8) {
      __m256 v = load8(x + i);
      if (a != nullptr) {
        v = round8<T>(_mm256_add_ps(v, load8(a + i)));
        store8(x + i, v);
      }
      squares = _mm256_fmadd_ps(v, v, squares);
    }
    sum = reduce_add8(squares);
#endif
    for (; i < dim; ++i) {
      if (a != nullptr) store(x + i, to_float(x[i]) + to_float(a[i]));
      sum += to_float(x[i]) * to_float(x[i]);
    }
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
    i = 0;
#if defined(__AVX512F__)
    const __m512 vinv = _mm512_set1_ps(inv);
    for (; i + 16 <= dim; i += 16)
      store16(o + i, round16<T>(_mm512_mul_ps(load16(weight + i), round16<T>(_mm512_mul_ps(load16(x + i), vinv)))));
#elif defined(PPSERVE_AVX2)
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; i + 8 <= dim; i += 8)
      store8(o + i, round8<T>(_mm256_mul_ps(load8(weight + i), round8<T>(_mm256_mul_ps(load8(x + i), vinv)))));
#endif
    for (; i < dim; ++i) store(o + i, to_float(weight[i]) * round_as<T>(to_float(x[i]) * inv));
  }
}

// GELU's tanh approximation, 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3), is
// x * sigmoid(2u) = x / (1 + e^(-2u)): SiLU's expression with another exponent, and no 1 - 2 / (...)
// to cancel (transformers' Gemma: F.gelu(approximate="tanh")).
constexpr float kGelu1 = -1.5957691216057308f, kGelu3 = kGelu1 * 0.044715f;  // -2u = x (kGelu1 + kGelu3 x^2)
#if defined(__AVX512F__)
inline __m512 gelu16(__m512 x) {
  const __m512 e = _mm512_mul_ps(x, _mm512_fmadd_ps(_mm512_mul_ps(x, x), _mm512_set1_ps(kGelu3), _mm512_set1_ps(kGelu1)));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(e)));
}
#elif defined(PPSERVE_AVX2)
inline __m256 gelu8(__m256 x) {
  const __m256 e = _mm256_mul_ps(x, _mm256_fmadd_ps(_mm256_mul_ps(x, x), _mm256_set1_ps(kGelu3), _mm256_set1_ps(kGelu1)));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(e)));
}
#endif

// out[r] = act(gate_up[r, :dim]) * gate_up[r, dim:], act SiLU (or GELU's tanh approximation)
// rounded to T first (as F.silu(g) * u).
template <typename T, bool Gelu>
void gated_mul(const T* gate_up, T* out, int64_t rows, int64_t dim) {
#pragma omp parallel for if (rows * dim >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * dim;
    const T* u = g + dim;
    T* o = out + r * dim;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= dim; i += 16) {
      const __m512 x = load16(g + i);
      const __m512 s = round16<T>(Gelu ? gelu16(x) : silu16(x));
      store16(o + i, round16<T>(_mm512_mul_ps(s, load16(u + i))));
    }
#elif defined(PPSERVE_AVX2)
    for (; i + 8 <= dim; i += 8) {
      const __m256 x = load8(g + i);
      const __m256 s = round8<T>(Gelu ? gelu8(x) : silu8(x));
      store8(o + i, round8<T>(_mm256_mul_ps(s, load8(u + i))));
    }
#endif
    for (; i < dim; ++i) {
      const float x = to_float(g[i]);
      const float e = Gelu ? x * std::fma(x * x, kGelu3, kGelu1) : -x;
      store(o + i, round_as<T>(x / (1.0f + expf(e))) * to_float(u[i]));
    }
  }
}

// x * cos + swap(x) * sin with swap(x) = (x2, x1) and sin's first half negated (see
// engine/model/model.py's apply_rope), each product and the sum rounded to T; no fused
// multiply-add, so that float32 results are exactly the torch ops'.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate(T* x, const T* cos, const T* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    const float a = round_as<T>(x1 * to_float(cos[i])), b = round_as<T>(x2 * to_float(sin[i]));
    const float c = round_as<T>(x2 * to_float(cos[i + half])), d = round_as<T>(x1 * to_float(sin[i + half]));
    store(x + i, a + b);
    store(x + i + half, c + d);
  }
}

// RoPE on q ([n, heads, head_dim] rows `q_stride` apart) in place, and on k likewise; then k and v
// stored at their cache slots (caches: [slots, kv_heads, head_dim]). cos, sin: [n, head_dim].
template <typename T>
void rope_write_kv(T* q, int64_t q_stride, T* k, int64_t k_stride, const T* v, int64_t v_stride, const T* cos,
                   const T* sin, const int64_t* slots, T* k_cache, T* v_cache, int64_t n, int64_t heads,
                   int64_t kv_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for if (n * (heads + kv_heads) * head_dim >= kParallelElements)
  for (int64_t t = 0; t < n; ++t) {
    const T* c = cos + t * head_dim;
    const T* s = sin + t * head_dim;
    for (int64_t h = 0; h < heads; ++h) rotate(q + t * q_stride + h * head_dim, c, s, half);
    T* kc = k_cache + slots[t] * kv_heads * head_dim;
    T* vc = v_cache + slots[t] * kv_heads * head_dim;
    for (int64_t h = 0; h < kv_heads; ++h) rotate(k + t * k_stride + h * head_dim, c, s, half);
    std::memcpy(kc, k + t * k_stride, kv_heads * head_dim * sizeof(T));
    std::memcpy(vc, v + t * v_stride, kv_heads * head_dim * sizeof(T));
  }
}

}  // namespace

// Constrained decoding (engine/model/sampler.py): row rows[i] of logits [*, stride] float32 gets -inf
// wherever bit t % 32 of word t / 32 of masks[i] (llguidance's token bitmask, [n, words] int32) is
// clear. Mostly whole words are allowed or forbidden: a word of ones costs one compare, and a mixed
// word is a branch-free select that the compiler vectorises (a branch per bit mispredicts).
void apply_token_bitmask(float* logits, int64_t stride, const int32_t* masks, int64_t words, const int64_t* rows,
                         int64_t n, int64_t vocab) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; i++) {
    float* row = logits + rows[i] * stride;
    const uint32_t* mask = reinterpret_cast<const uint32_t*>(masks + i * words);
    for (int64_t w = 0; w < words; w++) {
      const uint32_t allowed = mask[w];
      if (allowed == 0xFFFFFFFFu) continue;
      float* out = row + w * 32;
      if (vocab - w * 32 < 32) {  // the last word, partly past the vocabulary
        for (int64_t b = 0; b < vocab - w * 32; b++)
          if (!((allowed >> b) & 1u)) out[b] = ninf;
        continue;
      }
      for (int b = 0; b < 32; b++) out[b] = (allowed >> b) & 1u ? out[b] : ninf;
    }
  }
}

// Greedy sampling (engine/model/sampler.py): out[r] = the index of the largest logit of row r
// (rows `stride` apart), the first one where several are equal, and the first NaN's where there is
// one, as torch.argmax. torch's reduction tracks an index with every compare; here one vectorized
// pass finds the largest value and a second the first place it is, which stops early and reads the
// row from the cache.
void argmax_rows(const float* logits, int64_t stride, int64_t rows, int64_t vocab, int64_t* out) {
#pragma omp parallel for if (rows * vocab >= 4 * kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * stride;
    float m = -std::numeric_limits<float>::infinity();
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = 0; i < vocab; ++i) {
      m = x[i] > m ? x[i] : m;
      nan |= x[i] != x[i];
    }
    int64_t i = 0;
  #if defined(__AVX512F__)
    const __m512 target = _mm512_set1_ps(m);
    for (; i + 16 <= vocab; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      // NaN != NaN: where there is one, the first NaN is what is looked for, else the first max
      const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
      if (hit != 0) break;
    }
  #elif defined(PPSERVE_AVX2)
    const __m256 target = _mm256_set1_ps(m);
    for (; i + 8 <= vocab; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 hit = nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ);
      if (_mm256_movemask_ps(hit) != 0) break;
    }
  #endif
    while (i < vocab && !(nan ? x[i] != x[i] : x[i] == m)) ++i;
    out[r] = i < vocab ? i : 0;
  }
}

extern "C" {

#define PPSERVE_KERNELS(SUFFIX, T)                                                                                    \
  void decode_attention_##SUFFIX(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lens,      \
                                 T* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,           \
                                 int64_t block_size, int64_t max_blocks, float scale, int64_t window) {              \
    decode_attention(q, k, v, tables, lens, out, batch, heads, kv_heads, head_dim, block_size, max_blocks, scale,   \
                     window);                                                                                         \
  }                                                                                                                   \
  void rms_norm_##SUFFIX(T* h, const T* add, const T* weight, T* out, int64_t rows, int64_t dim, float eps) {         \
    rms_norm(h, add, weight, out, rows, dim, eps);                                                                    \
  }                                                                                                                   \
  void silu_mul_##SUFFIX(const T* gate_up, T* out, int64_t rows, int64_t dim) {                                     \
    gated_mul<T, false>(gate_up, out, rows, dim);                                                                     \
  }                                                                                                                   \
  void gelu_mul_##SUFFIX(const T* gate_up, T* out, int64_t rows, int64_t dim) {                                     \
    gated_mul<T, true>(gate_up, out, rows, dim);                                                                      \
  }                                                                                                                   \
  void rope_write_kv_##SUFFIX(T* q, int64_t q_stride, T* k, int64_t k_stride, const T* v, int64_t v_stride,           \
                              const T* cos, const T* sin, const int64_t* slots, T* k_cache, T* v_cache, int64_t n,  \
                              int64_t heads, int64_t kv_heads, int64_t head_dim) {                                   \
    rope_write_kv(q, q_stride, k, k_stride, v, v_stride, cos, sin, slots, k_cache, v_cache, n, heads, kv_heads,      \
                  head_dim);                                                                                          \
  }

PPSERVE_KERNELS(f32, float)
PPSERVE_KERNELS(bf16, uint16_t)

#if defined(PPSERVE_PREFILL_KERNEL)
// Returns nonzero for a head_dim it has no version for (the caller runs SDPA).
#define PPSERVE_PREFILL(SUFFIX, T)                                                                                    \
  int prefill_attention_##SUFFIX(const T* q, int64_t qs, const T* k, int64_t ks, const T* v, int64_t vs, T* out,      \
                                 int64_t os, int64_t batch, int64_t nq, int64_t nk, int64_t heads, int64_t kv_heads,  \
                                 int64_t head_dim, float scale, int64_t window) {                                     \
    if (head_dim != 64 && head_dim != 128) return 1;                                                                  \
    (head_dim == 64 ? prefill_attention<T, 64> : prefill_attention<T, 128>)(q, qs, k, ks, v, vs, out, os, batch, nq,  \
                                                                            nk, heads, kv_heads, scale, window);      \
    return 0;                                                                                                         \
  }
PPSERVE_PREFILL(f32, float)
PPSERVE_PREFILL(bf16, uint16_t)
#endif

void apply_token_bitmask_f32(float* logits, int64_t stride, const int32_t* masks, int64_t words, const int64_t* rows,
                             int64_t n, int64_t vocab) {
  apply_token_bitmask(logits, stride, masks, words, rows, n, vocab);
}

void argmax_rows_f32(const float* logits, int64_t stride, int64_t rows, int64_t vocab, int64_t* out) {
  argmax_rows(logits, stride, rows, vocab, out);
}


}  // extern "C"
