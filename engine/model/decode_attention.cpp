// Decode attention straight from the paged KV cache: one query token per request, keys and values
// read where they lie in their blocks, never gathered into a new tensor.
//
// Built at first use by engine/decode_attention.py (g++ -O3 -march=native -fopenmp, with float
// reassociation allowed but NaN and infinity kept) and called through ctypes. OpenMP here is torch's own runtime (the same libgomp.so.1, already loaded), so
// the work is split over the calling thread's torch.set_num_threads team.
//
// Shapes (row-major, contiguous):
//   q, out:   [batch, heads, head_dim]
//   k, v:     [num_blocks, block_size, kv_heads, head_dim]   (one layer's cache)
//   tables:   [batch, max_blocks] int64     lens: [batch] int64 (keys per request, >= 1)
// A query at position lens[b] - 1 sees keys [lo, lens[b]) with lo = max(0, lens[b] - window)
// (window 0: no window), as transformers' causal and sliding-window masks do.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

template <typename T>
void decode_attention(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lens, T* out,
                      int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                      int64_t max_blocks, float scale, int64_t window) {
  const int64_t group = heads / kv_heads;  // query heads per kv head
  const int64_t token_stride = kv_heads * head_dim;
  // One request per task: a token's keys for all kv heads lie side by side, and a block's tokens
  // too, so the cache is read in contiguous runs of block_size * kv_heads * head_dim.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[b];
    const int64_t lo = window > 0 && len > window ? len - window : 0;
    const int64_t n = len - lo;
    const int64_t* table = tables + b * max_blocks;
    // qf: [heads, head_dim] queries in float; scores: [heads, n]; acc: [heads, head_dim]
    std::vector<float> qf(heads * head_dim), scores(heads * n), acc(heads * head_dim, 0.0f);
    for (int64_t i = 0; i < heads * head_dim; ++i) qf[i] = to_float(q[b * heads * head_dim + i]);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = lo + t;
      const T* kt = k + (table[pos / block_size] * block_size + pos % block_size) * token_stride;
      for (int64_t hq = 0; hq < heads; ++hq) {
        const T* kp = kt + (hq / group) * head_dim;
        const float* qh = qf.data() + hq * head_dim;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * to_float(kp[d]);
        scores[hq * n + t] = s * scale;
      }
    }
    std::vector<float> denom(heads);
    for (int64_t hq = 0; hq < heads; ++hq) {  // softmax over t
      float* s = scores.data() + hq * n;
      float m = s[0];
      for (int64_t t = 1; t < n; ++t) m = s[t] > m ? s[t] : m;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        s[t] = expf(s[t] - m);
        sum += s[t];
      }
      denom[hq] = sum;
    }
    for (int64_t t = 0; t < n; ++t) {  // acc[hq] = sum_t p[hq, t] * v_t
      const int64_t pos = lo + t;
      const T* vt = v + (table[pos / block_size] * block_size + pos % block_size) * token_stride;
      for (int64_t hq = 0; hq < heads; ++hq) {
        const T* vp = vt + (hq / group) * head_dim;
        const float p = round_as<T>(scores[hq * n + t]);
        float* a = acc.data() + hq * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += p * to_float(vp[d]);
      }
    }
    for (int64_t hq = 0; hq < heads; ++hq) {
      const float inv = 1.0f / denom[hq];
      T* o = out + (b * heads + hq) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) store(o + d, acc[hq * head_dim + d] * inv);
    }
  }
}

}  // namespace

extern "C" {

void decode_attention_f32(const float* q, const float* k, const float* v, const int64_t* tables, const int64_t* lens,
                          float* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                          int64_t block_size, int64_t max_blocks, float scale, int64_t window) {
  decode_attention(q, k, v, tables, lens, out, batch, heads, kv_heads, head_dim, block_size, max_blocks, scale, window);
}

void decode_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* tables,
                           const int64_t* lens, uint16_t* out, int64_t batch, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window) {
  decode_attention(q, k, v, tables, lens, out, batch, heads, kv_heads, head_dim, block_size, max_blocks, scale, window);
}

}  // extern "C"
