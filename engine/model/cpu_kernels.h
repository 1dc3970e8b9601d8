// What the kernel sources share (cpu_kernels.cpp, cpu_gemm.cpp): the headers they use, and a
// bfloat16 stored as the high half of a float32, converted as torch converts it.
#pragma once

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

}  // namespace ppserve

// The GEMMs each CPU gets (cpu_gemm.cpp): float32 with AVX-512, the quantized ones with VNNI too.
#if defined(__AVX512F__)
#define PPSERVE_FLOAT_GEMM 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PPSERVE_QUANT_GEMM 1
#endif

// The float32 kernels that decode_step.cpp strings together (their comments are where they are
// defined: cpu_kernels.cpp and cpu_gemm.cpp).
extern "C" {
void decode_attention_f32(const float* q, const float* k, const float* v, const int64_t* tables, const int64_t* lens,
                          float* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                          int64_t block_size, int64_t max_blocks, float scale, int64_t window);
void rms_norm_f32(float* h, const float* add, const float* weight, float* out, int64_t rows, int64_t dim, float eps);
void silu_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t dim);
void rope_write_kv_f32(float* q, int64_t q_stride, float* k, int64_t k_stride, const float* v, int64_t v_stride,
                       const float* cos, const float* sin, const int64_t* slots, float* k_cache, float* v_cache,
                       int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim);
void float_gemm_f32(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K);
void quant_gemm_q4_f32(const float* x, const uint8_t* w, const uint16_t* scales, const uint16_t* mins,
                       const float* bias, float* y, int64_t M, int64_t N, int64_t K);
void quant_gemm_q8_f32(const float* x, const uint8_t* w, const uint16_t* scales, const uint16_t* mins,
                       const float* bias, float* y, int64_t M, int64_t N, int64_t K);
}
