// The CPU kernels of a stage's forward pass, built at first use by engine/model/cpu_kernels.py
// (g++ -O3 -march=native -fopenmp, with float reassociation allowed but NaN and infinity kept) and
// called through ctypes. OpenMP here is torch's own runtime (the same libgomp.so.1, already
// loaded), so the work is split over the calling thread's torch.set_num_threads team.
//
// - decode_attention: one query token per request, straight from the paged KV cache; keys and
//   values are read where they lie in their blocks, never gathered into a new tensor.
// - rms_norm: the residual add and RMSNorm of a decoder layer in one pass.
// - silu_mul: the MLP's SiLU(gate) * up.
// - rope_write_kv: RoPE on q and k in place of the copy, k and v stored into the cache.
// - quant_gemm_q4 / quant_gemm_q8: y = x @ W.T + b with W kept as 4- or 8-bit integers (see below;
//   built only where the CPU has AVX-512 VNNI).
// Each replaces several torch ops (and as many dispatches and passes over memory) per layer, and
// rounds where those ops round, so results stay those of the torch code they replace up to the
// order of a sum (tests/test_fast_paths.py).
//
// Decode attention's shapes (row-major, contiguous):
//   q, out:   [batch, heads, head_dim]
//   k, v:     [num_blocks, block_size, kv_heads, head_dim]   (one layer's cache)
//   tables:   [batch, max_blocks] int64     lens: [batch] int64 (keys per request, >= 1)
// A query at position lens[b] - 1 sees keys [lo, lens[b]) with lo = max(0, lens[b] - window)
// (window 0: no window), as transformers' causal and sliding-window masks do.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// glibc's vector math library has SIMD versions of expf; declaring them lets `omp simd` loops
// call them (GCC declares them itself only under -ffast-math, which would also drop NaN/Inf).
extern "C" float expf(float) __attribute__((__simd__("notinbranch")));

namespace {

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

// The two loops over keys of a task with head_dim = 16 * NV, in registers: a token's key or value
// is loaded once for a block of JB query heads, and every dot product and accumulator is a
// register, so that consecutive tokens' work overlaps (the generic loops below wait on each dot
// product's sum). The sums are the same ones in another order.
template <typename T, int NV>
void scores_simd(const float* qf, int64_t group, const T* const* keys, int64_t n, float scale, float* scores) {
  constexpr int JB = 16 / NV;  // JB * NV query registers
  for (int64_t j0 = 0; j0 < group; j0 += JB) {
    const int64_t jn = std::min<int64_t>(JB, group - j0);
    __m512 qv[JB][NV];
    for (int j = 0; j < JB; ++j)
      for (int i = 0; i < NV; ++i) qv[j][i] = j < jn ? _mm512_loadu_ps(qf + (j0 + j) * 16 * NV + 16 * i) : _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      __m512 kv[NV];
      for (int i = 0; i < NV; ++i) kv[i] = load16(keys[t] + 16 * i);
      for (int j = 0; j < JB; ++j) {
        __m512 acc = _mm512_mul_ps(qv[j][0], kv[0]);
        for (int i = 1; i < NV; ++i) acc = _mm512_fmadd_ps(qv[j][i], kv[i], acc);
        if (j < jn) scores[(j0 + j) * n + t] = _mm512_reduce_add_ps(acc) * scale;
      }
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
#endif

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
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = lo + t;
        const int64_t offset = (table[pos / block_size] * block_size + pos % block_size) * token_stride + g * head_dim;
        keys[t] = k + offset;
        values[t] = v + offset;
      }
      bool done = false;
  #if defined(__AVX512F__)
      if (head_dim == 64 || head_dim == 128) {
        (head_dim == 64 ? scores_simd<T, 4> : scores_simd<T, 8>)(qf.data(), group, keys.data(), n, scale, scores.data());
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
      for (int64_t j = 0; j < group; ++j) {  // softmax over t
        float* s = scores.data() + j * n;
        float m = s[0];
        for (int64_t t = 1; t < n; ++t) m = s[t] > m ? s[t] : m;
        float sum = 0.0f;
  #pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; ++t) {
          s[t] = expf(s[t] - m);
          sum += s[t];
        }
        denom[j] = sum;
        for (int64_t t = 0; t < n; ++t) s[t] = round_as<T>(s[t]);
      }
      done = false;
  #if defined(__AVX512F__)
      if (head_dim == 64 || head_dim == 128) {
        (head_dim == 64 ? values_simd<T, 4> : values_simd<T, 8>)(scores.data(), group, values.data(), n, acc.data());
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

// Elementwise work is split over threads only when there is enough of it to pay for waking them.
constexpr int64_t kParallelElements = 1 << 15;

// h += add (when given, rounded to T as torch's h + a), then out = weight * rmsnorm(h): the norm
// in float, rounded to T before the weight multiplies it (as transformers' LlamaRMSNorm).
template <typename T>
void rms_norm(T* h, const T* add, const T* weight, T* out, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows * dim >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    T* x = h + r * dim;
    if (add != nullptr) {
      const T* a = add + r * dim;
      for (int64_t i = 0; i < dim; ++i) store(x + i, to_float(x[i]) + to_float(a[i]));
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < dim; ++i) sum += to_float(x[i]) * to_float(x[i]);
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
    T* o = out + r * dim;
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) store(o + i, to_float(weight[i]) * round_as<T>(to_float(x[i]) * inv));
  }
}

// out[r] = silu(gate_up[r, :dim]) * gate_up[r, dim:], silu rounded to T first (as F.silu(g) * u).
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t dim) {
#pragma omp parallel for if (rows * dim >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * dim;
    const T* u = g + dim;
    T* o = out + r * dim;
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) {
      const float x = to_float(g[i]);
      store(o + i, round_as<T>(x / (1.0f + expf(-x))) * to_float(u[i]));
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PPSERVE_QUANT_GEMM 1

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
// At batch 1 this reads the weights at about memory speed; at 32 and 256 rows it takes 0.7-0.9x
// the time of oneDNN's bfloat16 GEMM and 0.35-0.4x that of torch's int4 kernel (scripts/bench_quant.py).
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
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t p = 0; p < passes; ++p) {
    for (int64_t g = 0; g < groups; ++g) {
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
    }
  }
}
#endif  // AVX-512 VNNI

}  // namespace

// Constrained decoding (engine/model/sampler.py): row rows[i] of logits [*, stride] float32 gets -inf
// wherever bit t % 32 of word t / 32 of masks[i] (llguidance's token bitmask, [n, words] int32) is
// clear. Mostly whole words are allowed or forbidden, so a word of ones costs one compare.
void apply_token_bitmask(float* logits, int64_t stride, const int32_t* masks, int64_t words, const int64_t* rows,
                         int64_t n, int64_t vocab) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; i++) {
    float* row = logits + rows[i] * stride;
    const uint32_t* mask = reinterpret_cast<const uint32_t*>(masks + i * words);
    for (int64_t w = 0; w < words; w++) {
      const uint32_t allowed = mask[w];
      if (allowed == 0xFFFFFFFFu) continue;
      const int64_t base = w * 32, end = std::min<int64_t>(32, vocab - base);
      for (int64_t b = 0; b < end; b++)
        if (!((allowed >> b) & 1u)) row[base + b] = ninf;
    }
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
  void silu_mul_##SUFFIX(const T* gate_up, T* out, int64_t rows, int64_t dim) { silu_mul(gate_up, out, rows, dim); }  \
  void rope_write_kv_##SUFFIX(T* q, int64_t q_stride, T* k, int64_t k_stride, const T* v, int64_t v_stride,           \
                              const T* cos, const T* sin, const int64_t* slots, T* k_cache, T* v_cache, int64_t n,  \
                              int64_t heads, int64_t kv_heads, int64_t head_dim) {                                   \
    rope_write_kv(q, q_stride, k, k_stride, v, v_stride, cos, sin, slots, k_cache, v_cache, n, heads, kv_heads,      \
                  head_dim);                                                                                          \
  }

PPSERVE_KERNELS(f32, float)
PPSERVE_KERNELS(bf16, uint16_t)

void apply_token_bitmask_f32(float* logits, int64_t stride, const int32_t* masks, int64_t words, const int64_t* rows,
                             int64_t n, int64_t vocab) {
  apply_token_bitmask(logits, stride, masks, words, rows, n, vocab);
}

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
