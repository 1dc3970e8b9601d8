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
