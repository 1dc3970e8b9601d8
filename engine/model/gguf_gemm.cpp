// GGUF's quantized block formats, kept quantized (engine/model/gguf_quant.py): a linear
// y = x @ W.T + b and an embedding lookup, for W: [N, K] rows of blocks of one GGML type.
//
// Every type unpacks into what they all share: int8 values q in groups of 16 with a float scale s
// and offset o each, w = s * q + o:
//   Q8_0  q          s = d          o = 0          (blocks of 32)
//   Q4_0  nibble - 8 s = d          o = 0
//   Q4_1  nibble     s = d          o = m
//   Q5_0  5 bits - 16, Q5_1 5 bits (as Q4_0 / Q4_1)
//   Q4_K  nibble     s = d * sc_j   o = -dmin * m_j (super-blocks of 256: 8 sub-blocks of 32,
//   Q5_K  5 bits     (as Q4_K)                      6-bit sc_j and m_j)
//   Q6_K  6 bits - 32  s = d * sc_j  o = 0         (16 sub-blocks of 16, int8 sc_j)
// The activations are rounded to int8 in blocks of 32 with a float scale dx, as llama.cpp rounds
// them for its quantized dot products, and kept with their sums per 32 (for the offsets). Each
// weight is repacked once, at load, kLanes rows side by side (gguf_pack), where the activations meet
// them in integer multiply-adds; each row's result is the same whatever else is in the batch
// (packed_dot's formula), so a request's tokens do not depend on how the pipeline batched it.

// A row's result must not depend on which instantiation of packed_dot computed it, so nothing here
// may be regrouped or fused differently in each: the library's -fassociative-math is off for this
// file (GCC treats the intrinsics' products as plain vector arithmetic: it had regrouped a K-quant's
// (d * sc) * dx one way in the 1-row kernel and another in the expanded one), and so is contraction
// of a product and a sum into one FMA (the kernels write their FMAs out).
#pragma GCC optimize("no-associative-math", "fp-contract=off")

#include "cpu_kernels.h"

#include <cstdlib>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

using namespace ppserve;

enum Type : int64_t { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K };

float half(const uint8_t* p) {  // IEEE float16, little-endian
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#endif
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {  // zero or subnormal: exact in float32
    float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Bytes per block and values per block of each type (ggml's block_* structs).
constexpr int64_t block_bytes(int64_t t) {
  constexpr int64_t bytes[] = {18, 20, 22, 24, 34, 144, 176, 210};
  return bytes[t];
}
constexpr int64_t block_values(int64_t t) { return t >= Q4_K ? 256 : 32; }
// Whether w = s * q + o has offsets o at all (the others' are zero, and skipped); theirs q are >= 0.
constexpr bool has_offsets(int64_t t) { return t == Q4_1 || t == Q5_1 || t == Q4_K || t == Q5_K; }

// A K-quant's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4).
void scale_min_k4(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

#if defined(__AVX2__)
// 16 bytes of nibbles as 32 values: the low nibbles (values 0-15), then the high ones (16-31).
inline __m256i nibbles(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), m = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}
// Byte j is 0xff where bit j of x is set (the fifth bit of Q5_0 / Q5_1 value j), else 0.
inline __m256i fifth_bits(uint32_t x) {
  const __m256i byte_of = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), byte_of);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}
// Bits [shift, shift + width) of each byte, moved to bit 4 (a K-quant's high bits).
inline __m256i high_bits(__m256i v, int shift, int width) {
  const __m256i m = _mm256_set1_epi8(static_cast<char>((1 << width) - 1));
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(v, shift), m), 4);
}
inline void store32(int8_t* q, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), v); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
#endif

#if defined(__AVX2__)
// Values 32j .. 32j + 31 of a block of type t as int8 q (see the top of the file), in a register.
template <int64_t t>
inline __m256i values32(const uint8_t* b, int64_t j) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  if constexpr (t == Q8_0) {
    return load32(b + 2);
  } else if constexpr (t == Q4_0 || t == Q4_1) {
    const __m256i v = nibbles(b + (t == Q4_1 ? 4 : 2));
    return t == Q4_0 ? _mm256_sub_epi8(v, _mm256_set1_epi8(8)) : v;
  } else if constexpr (t == Q5_0 || t == Q5_1) {
    constexpr int at = t == Q5_1 ? 4 : 2;
    uint32_t qh;
    std::memcpy(&qh, b + at, 4);
    // Q5_0's value - 16 is the nibble with 0xf0 set where the fifth bit is clear (in two's complement)
    const __m256i high = t == Q5_0 ? _mm256_andnot_si256(fifth_bits(qh), _mm256_set1_epi8(static_cast<char>(0xf0)))
                                   : _mm256_and_si256(fifth_bits(qh), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(nibbles(b + at + 4), high);
  } else if constexpr (t == Q4_K || t == Q5_K) {  // sub-block j: the low (j even) or high nibbles of 32 bytes
    const __m256i v = load32(b + 16 + (t == Q5_K ? 32 : 0) + 32 * (j / 2));
    __m256i q = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, low4);
    if constexpr (t == Q5_K) q = _mm256_or_si256(q, high_bits(load32(b + 16), static_cast<int>(j), 1));
    return q;
  } else {  // Q6_K: per 128 values, ql [64] (low 4 bits) and qh [32] (2 high bits each)
    const int64_t h = j / 4, k = j % 4;  // values 128h + 32k ..
    const __m256i l = load32(b + 64 * h + 32 * (k % 2)), hb = load32(b + 128 + 32 * h);
    const __m256i lo = _mm256_and_si256(k < 2 ? l : _mm256_srli_epi16(l, 4), low4);
    return _mm256_sub_epi8(_mm256_or_si256(lo, high_bits(hb, 2 * static_cast<int>(k), 2)), _mm256_set1_epi8(32));
  }
}
#endif

// A block's values as int8 q (see the top of the file): q [values of the block].
template <int64_t t>
void unpack_values(const uint8_t* b, int8_t* q) {
#if defined(__AVX2__)
  for (int64_t j = 0; j < block_values(t) / 32; ++j) store32(q + 32 * j, values32<t>(b, j));
#else
  if constexpr (t == Q8_0) {
    std::memcpy(q, b + 2, 32);
  } else if constexpr (t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1) {
    const bool has_min = t == Q4_1 || t == Q5_1, five = t == Q5_0 || t == Q5_1;
    const uint8_t* qs = b + 2 + (has_min ? 2 : 0) + (five ? 4 : 0);
    uint32_t qh = 0;
    if (five) std::memcpy(&qh, b + 2 + (has_min ? 2 : 0), 4);
    const int bias = has_min ? 0 : (five ? 16 : 8);
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<int8_t>(((qs[j] & 0xf) | (((qh >> j) & 1) << 4)) - bias);
      q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias);
    }
  } else if constexpr (t == Q4_K || t == Q5_K) {
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 16 + (t == Q5_K ? 32 : 0);
    for (int j = 0; j < 4; ++j) {
      for (int l = 0; l < 32; ++l) {
        int lo = qs[32 * j + l] & 0xf, hi = qs[32 * j + l] >> 4;
        if (t == Q5_K) {
          lo |= ((qh[l] >> (2 * j)) & 1) << 4;
          hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
        }
        q[64 * j + l] = static_cast<int8_t>(lo);
        q[64 * j + 32 + l] = static_cast<int8_t>(hi);
      }
    }
  } else {
    for (int h = 0; h < 2; ++h) {
      const uint8_t* l8 = b + 64 * h;
      const uint8_t* h8 = b + 128 + 32 * h;
      int8_t* y = q + 128 * h;
      for (int l = 0; l < 32; ++l) {
        y[l] = static_cast<int8_t>(((l8[l] & 0xf) | (((h8[l] >> 0) & 3) << 4)) - 32);
        y[l + 32] = static_cast<int8_t>(((l8[l + 32] & 0xf) | (((h8[l] >> 2) & 3) << 4)) - 32);
        y[l + 64] = static_cast<int8_t>(((l8[l] >> 4) | (((h8[l] >> 4) & 3) << 4)) - 32);
        y[l + 96] = static_cast<int8_t>(((l8[l + 32] >> 4) | (((h8[l] >> 6) & 3) << 4)) - 32);
      }
    }
  }
#endif
}

// x rounded to int8 per block of 32 (scale amax / 127), with each block's sum times the scale and
// the integer sum of each 16 values: q [K], d [K / 32], sums [K / 32], isums [K / 16].
template <typename T>
void quantize_row(const T* x, int64_t K, int8_t* q, float* d, float* sums, int32_t* isums) {
  for (int64_t b = 0; b < K / 32; ++b) {
    float v[32], amax = 0.0f;
    for (int j = 0; j < 32; ++j) {
      v[j] = to_float(x[32 * b + j]);
      amax = std::max(amax, std::fabs(v[j]));
    }
    const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    int half_sums[2] = {0, 0};
    for (int j = 0; j < 32; ++j) {
      const int r = static_cast<int>(std::nearbyint(v[j] * inv));
      q[32 * b + j] = static_cast<int8_t>(r);
      half_sums[j / 16] += r;
    }
    d[b] = scale;
    sums[b] = scale * static_cast<float>(half_sums[0] + half_sums[1]);
    isums[2 * b] = half_sums[0], isums[2 * b + 1] = half_sums[1];
  }
}

struct QuantRows {  // the activations as quantize_row leaves them, row-major
  std::vector<int8_t> q;
  std::vector<float> d, sums;
  std::vector<int32_t> isums;
};

// Every product runs on kLanes weight rows side by side, as llama.cpp's repacked x86 kernels lay
// them out: the weights are repacked once, at load (gguf_pack), into groups of kLanes rows, where
// value k of row c is byte 4 * c + k % 4 of "step" k / 4, a 32-byte vector holding 4 values of each
// row. One broadcast of 4 activation bytes then meets all 8 rows in one u8 x s8 multiply-add, with
// no sign to move and each row's sum in its own lane. The values lie there as u = q + bias(t) >= 0
// (Q8_0's may be negative: its kernel moves their sign onto the activations instead), and
// bias * (the activations' sum) comes off the integer sum.
// Per group of values with one scale (32; Q6_K's 16) a row's integer dot product is exact, then
//   acc = fma(float(that), s * dx, acc)   (group by group, in order)
//   off = fma(o, dx * sum(qx), off)       (per block of 32, the types with offsets)
//   y = acc + off
// whatever else is in the batch: a request's tokens do not depend on how the pipeline batched it.
//
// A packed group holds, per block of the type (32 or 256 values), its kLanes rows' scales, then per
// 32 values ("chunk", 8 steps) their u: 4-bit types as 4 vectors of two steps' nibbles each (step
// 2m low, 2m + 1 high); 5-bit ones, and a vector whose byte bit k is step k's fifth bit; Q6_K, and
// two vectors whose byte bits 2k, 2k + 1 are step 4h + k's top two bits (h = 0, 1); Q8_0 the 8 steps.
// Scales, per block, as float16 or bytes by row: Q4_0, Q5_0, Q8_0 d [8]; Q4_1, Q5_1 d [8], m [8];
// Q4_K, Q5_K d [8], dmin [8], sc [8 sub-blocks][8], m [8][8]; Q6_K d [8], sc [16][8] (int8). Each
// row's bytes are its file's size, but for K-quants' 6-bit scales taken apart (Q4_K: 148 for 144).
constexpr int kLanes = 8;
constexpr int64_t group_values(int64_t t) { return t == Q6_K ? 16 : 32; }
constexpr int bias_of(int64_t t) { return t == Q4_0 ? 8 : t == Q5_0 ? 16 : t == Q6_K ? 32 : 0; }
constexpr int value_bits(int64_t t) {
  return t == Q8_0 ? 8 : t == Q6_K ? 6 : (t == Q5_0 || t == Q5_1 || t == Q5_K) ? 5 : 4;
}
// Steps whose u8 x s8 pair sums add up in int16 before they widen: the most that stay below 2^15
// (each pair at most 2 * max u * 127; Q8_0's at most 2 * 128 * 127).
constexpr int64_t int16_steps(int64_t t) { return t == Q8_0 ? 1 : t == Q6_K ? 2 : value_bits(t) == 5 ? 4 : 8; }
constexpr int64_t scale_bytes(int64_t t) {
  return t == Q4_K || t == Q5_K ? 160 : t == Q6_K ? 144 : (t == Q4_1 || t == Q5_1) ? 32 : 16;
}
constexpr int64_t chunk_bytes(int64_t t) { return 32 * value_bits(t); }
constexpr int64_t packed_block(int64_t t) { return scale_bytes(t) + block_values(t) / 32 * chunk_bytes(t); }
// A packed group's bytes: kLanes rows of K values.
int64_t packed_group(int64_t t, int64_t K) { return K / block_values(t) * packed_block(t); }

// The scales of row c's block b (file layout) into a packed block's scales p.
template <int64_t t>
void pack_scales(const uint8_t* b, int c, uint8_t* p) {
  if constexpr (t == Q6_K) {
    std::memcpy(p + 2 * c, b + 208, 2);
    for (int g = 0; g < 16; ++g) p[16 + 8 * g + c] = b[192 + g];
  } else if constexpr (t == Q4_K || t == Q5_K) {
    std::memcpy(p + 2 * c, b, 2), std::memcpy(p + 16 + 2 * c, b + 2, 2);
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min_k4(j, b + 4, &sc, &m);
      p[32 + 8 * j + c] = static_cast<uint8_t>(sc), p[96 + 8 * j + c] = static_cast<uint8_t>(m);
    }
  } else {
    std::memcpy(p + 2 * c, b, 2);
    if constexpr (t == Q4_1 || t == Q5_1) std::memcpy(p + 16 + 2 * c, b + 2, 2);
  }
}

// Row c's scale of group g and offset of chunk j in a packed block p (w = s * q + o, as at the top).
template <int64_t t>
float scale_of(const uint8_t* p, int64_t g, int c) {
  if constexpr (t == Q6_K) return half(p + 2 * c) * static_cast<float>(static_cast<int8_t>(p[16 + 8 * g + c]));
  if constexpr (t == Q4_K || t == Q5_K) return half(p + 2 * c) * static_cast<float>(p[32 + 8 * g + c]);
  return half(p + 2 * c);
}
template <int64_t t>
float offset_of(const uint8_t* p, int64_t j, int c) {
  if constexpr (t == Q4_K || t == Q5_K) return -(half(p + 16 + 2 * c) * static_cast<float>(p[96 + 8 * j + c]));
  return half(p + 16 + 2 * c);
}

// u of step k of a packed chunk, row c, byte e (0-3) of its 4.
template <int64_t t>
uint8_t chunk_u(const uint8_t* chunk, int k, int c, int e) {
  const int at = 4 * c + e;
  if constexpr (t == Q8_0) return chunk[32 * k + at];
  const uint8_t low = (chunk[32 * (k / 2) + at] >> (4 * (k % 2))) & 0xf;
  if constexpr (value_bits(t) == 5) return static_cast<uint8_t>(low | (((chunk[128 + at] >> k) & 1) << 4));
  if constexpr (value_bits(t) == 6)
    return static_cast<uint8_t>(low | (((chunk[128 + 32 * (k / 4) + at] >> (2 * (k % 4))) & 3) << 4));
  return low;
}

// Rows rows[0 .. kLanes) of W [*, K] (file layout) packed into one group, out [packed_group].
template <int64_t t>
void pack_group(const uint8_t* const* rows, int64_t K, uint8_t* out) {
  constexpr int64_t V = block_values(t);
  for (int64_t i = 0; i < K / V; ++i, out += packed_block(t)) {
    const int64_t at = i * block_bytes(t);
    for (int c = 0; c < kLanes; ++c) pack_scales<t>(rows[c] + at, c, out);
    int8_t q[kLanes][V];
    for (int c = 0; c < kLanes; ++c) unpack_values<t>(rows[c] + at, q[c]);
    for (int64_t j = 0; j < V / 32; ++j) {
      uint8_t u[8][32];  // step k: 4 values of each row
      for (int k = 0; k < 8; ++k)
        for (int c = 0; c < kLanes; ++c)
          for (int e = 0; e < 4; ++e) u[k][4 * c + e] = static_cast<uint8_t>(q[c][32 * j + 4 * k + e] + bias_of(t));
      uint8_t* chunk = out + scale_bytes(t) + j * chunk_bytes(t);
      std::memset(chunk, 0, chunk_bytes(t));
      for (int k = 0; k < 8; ++k)
        for (int b = 0; b < 32; ++b) {
          if constexpr (t == Q8_0) {
            chunk[32 * k + b] = u[k][b];
            continue;
          }
          chunk[32 * (k / 2) + b] |= static_cast<uint8_t>((u[k][b] & 0xf) << (4 * (k % 2)));
          if constexpr (value_bits(t) == 5) chunk[128 + b] |= static_cast<uint8_t>(((u[k][b] >> 4) & 1) << k);
          if constexpr (value_bits(t) == 6)
            chunk[128 + 32 * (k / 4) + b] |= static_cast<uint8_t>(((u[k][b] >> 4) & 3) << (2 * (k % 4)));
        }
    }
  }
}

#if defined(__AVX2__)
// u of step k of a packed chunk, all 8 rows (as chunk_u).
template <int64_t t, int k>
inline __m256i step_u(const uint8_t* chunk) {
  if constexpr (t == Q8_0) return load32(chunk + 32 * k);
  const __m256i nib = load32(chunk + 32 * (k / 2)), low4 = _mm256_set1_epi8(0x0f);
  const __m256i low = _mm256_and_si256(k % 2 ? _mm256_srli_epi16(nib, 4) : nib, low4);
  if constexpr (value_bits(t) == 4) return low;
  // the high bits' plane, its bits for this step moved to bit 4 (within each byte: masked after)
  constexpr int from = value_bits(t) == 5 ? k : 2 * (k % 4);
  const __m256i plane = load32(chunk + 128 + (value_bits(t) == 6 ? 32 * (k / 4) : 0));
  const __m256i moved = from <= 4 ? _mm256_slli_epi16(plane, 4 - from) : _mm256_srli_epi16(plane, from - 4);
  const char mask = value_bits(t) == 5 ? 0x10 : 0x30;
  return _mm256_or_si256(low, _mm256_and_si256(moved, _mm256_set1_epi8(mask)));
}

inline __m256 halves8(const uint8_t* p) {  // 8 float16 as float32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 bytes8(const uint8_t* p, bool is_signed) {  // 8 bytes as float32
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}
template <int64_t t>
inline __m256 scale_vec(const uint8_t* p, int64_t g) {  // the 8 rows' scale_of
  if constexpr (t == Q6_K) return _mm256_mul_ps(halves8(p), bytes8(p + 16 + 8 * g, true));
  if constexpr (t == Q4_K || t == Q5_K) return _mm256_mul_ps(halves8(p), bytes8(p + 32 + 8 * g, false));
  return halves8(p);
}
template <int64_t t>
inline __m256 offset_vec(const uint8_t* p, int64_t j) {  // the 8 rows' offset_of
  if constexpr (t == Q4_K || t == Q5_K) {
    const __m256 product = _mm256_mul_ps(halves8(p + 16), bytes8(p + 96 + 8 * j, false));
    return _mm256_xor_ps(product, _mm256_set1_ps(-0.0f));
  }
  return halves8(p + 16);
}

// Steps k .. end of a chunk against rows r0 .. r0 + R: dot[r] += their integer sums (u . qx). The
// chunk packed, or (E) its steps expanded to bytes, 32 each.
template <int64_t t, int R, bool E, int k, int end>
inline void chunk_steps(const uint8_t* chunk, const int8_t* const* xq, __m256i* dot, __m256i* pairs) {
  if constexpr (k < end) {
    const __m256i w = E ? load32(chunk + 32 * k) : step_u<t, k>(chunk), ones = _mm256_set1_epi16(1);
    [[maybe_unused]] const __m256i w_abs = _mm256_abs_epi8(w);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, xq[r] + 4 * k, 4);
      const __m256i a = _mm256_set1_epi32(four);
      const __m256i p = t == Q8_0 ? _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(a, w)) : _mm256_maddubs_epi16(w, a);
      pairs[r] = _mm256_add_epi16(pairs[r], p);
      if constexpr ((k + 1) % int16_steps(t) == 0) {
        dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(pairs[r], ones));
        pairs[r] = _mm256_setzero_si256();
      }
    }
    chunk_steps<t, R, E, k + 1, end>(chunk, xq, dot, pairs);
  }
}
#endif

// How far ahead of the block it reads packed_dot asks for the weights' lines: the hardware's
// prefetcher stops at 4 KB pages, and at one or a few rows the loads' misses are most of the time
// (Gemma 3's LM head, 1 and 4 rows: 5% and 15% quicker at 1 to 2 KB ahead than without).
constexpr int64_t kPrefetchAhead = 2048;

// The packed group's rows against activation rows r0 .. r0 + R: out [R][kLanes] (without bias).
// With E, the chunks' steps are read from `bytes` (expand_steps's), not decoded from the group.
template <int64_t t, int R, bool E>
void packed_dot(const uint8_t* group, [[maybe_unused]] const uint8_t* bytes, int64_t K, const QuantRows& x, int64_t r0,
                float* out) {
  constexpr int64_t V = block_values(t), G = group_values(t);
  const int64_t blocks = K / 32;
  // A group's bias * sum(qx): the sum of its one or two 16s (b: its block of 32 along the row).
  auto bias_sum = [&](int r, int64_t b, int64_t half) {
    const int32_t* is = x.isums.data() + (r0 + r) * (K / 16) + 2 * b + half;
    return bias_of(t) * (G == 16 ? is[0] : is[0] + is[1]);
  };
#if defined(__AVX2__)
  __m256 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < K / V; ++i, group += packed_block(t)) {
    if constexpr (!E) {
      const char* ahead = reinterpret_cast<const char*>(group) + kPrefetchAhead;
      for (int64_t at = 0; at < packed_block(t); at += 64) _mm_prefetch(ahead + at, _MM_HINT_T0);
    }
    for (int64_t j = 0; j < V / 32; ++j) {
      const int64_t b = i * V / 32 + j;
      const uint8_t* chunk = E ? bytes + 256 * b : group + scale_bytes(t) + j * chunk_bytes(t);
      const int8_t* xq[R];
      for (int r = 0; r < R; ++r) xq[r] = x.q.data() + (r0 + r) * K + 32 * b;
      __m256i dot[2][R], pairs[R];
      for (int r = 0; r < R; ++r) dot[0][r] = dot[1][r] = pairs[r] = _mm256_setzero_si256();
      if constexpr (G == 32) {
        chunk_steps<t, R, E, 0, 8>(chunk, xq, dot[0], pairs);
      } else {
        chunk_steps<t, R, E, 0, 4>(chunk, xq, dot[0], pairs);
        chunk_steps<t, R, E, 4, 8>(chunk, xq, dot[1], pairs);
      }
      for (int64_t h = 0; h < 32 / G; ++h) {
        const __m256 s = scale_vec<t>(group, j * (32 / G) + h);
        for (int r = 0; r < R; ++r) {
          if constexpr (bias_of(t) != 0) dot[h][r] = _mm256_sub_epi32(dot[h][r], _mm256_set1_epi32(bias_sum(r, b, h)));
          const __m256 scale = _mm256_mul_ps(s, _mm256_set1_ps(x.d[(r0 + r) * blocks + b]));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][r]), scale, acc[r]);
        }
      }
      if constexpr (has_offsets(t)) {
        const __m256 o = offset_vec<t>(group, j);
        for (int r = 0; r < R; ++r) off[r] = _mm256_fmadd_ps(o, _mm256_set1_ps(x.sums[(r0 + r) * blocks + b]), off[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * kLanes, _mm256_add_ps(acc[r], off[r]));
#else
  float acc[R][kLanes] = {}, off[R][kLanes] = {};
  for (int64_t i = 0; i < K / V; ++i, group += packed_block(t))
    for (int64_t j = 0; j < V / 32; ++j) {
      const int64_t b = i * V / 32 + j;
      const uint8_t* chunk = group + scale_bytes(t) + j * chunk_bytes(t);
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q.data() + (r0 + r) * K + 32 * b;
        const float dx = x.d[(r0 + r) * blocks + b];
        for (int c = 0; c < kLanes; ++c) {
          for (int64_t h = 0; h < 32 / G; ++h) {
            int dot = 0;
            for (int k = static_cast<int>(h * G / 4); k < (h + 1) * G / 4; ++k)
              for (int e = 0; e < 4; ++e) {
                const uint8_t v = chunk_u<t>(chunk, k, c, e);
                dot += (t == Q8_0 ? static_cast<int8_t>(v) : v) * xq[4 * k + e];
              }
            if constexpr (bias_of(t) != 0) dot -= bias_sum(r, b, h);
            acc[r][c] += static_cast<float>(dot) * (scale_of<t>(group, j * (32 / G) + h, c) * dx);
          }
          if constexpr (has_offsets(t)) off[r][c] += offset_of<t>(group, j, c) * x.sums[(r0 + r) * blocks + b];
        }
      }
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kLanes; ++c) out[r * kLanes + c] = acc[r][c] + off[r][c];
#endif
}

// Row c of a packed group of W [*, K] dequantized: out [K].
template <int64_t t, typename T>
void packed_row(const uint8_t* group, int c, int64_t K, T* out) {
  constexpr int64_t V = block_values(t), G = group_values(t);
  for (int64_t i = 0; i < K / V; ++i, group += packed_block(t))
    for (int64_t j = 0; j < V / 32; ++j) {
      const uint8_t* chunk = group + scale_bytes(t) + j * chunk_bytes(t);
      const float o = has_offsets(t) ? offset_of<t>(group, j, c) : 0.0f;
      for (int k = 0; k < 8; ++k) {
        const float s = scale_of<t>(group, j * (32 / G) + 4 * k / G, c);
        for (int e = 0; e < 4; ++e) {
          const uint8_t v = chunk_u<t>(chunk, k, c, e);
          const int q = t == Q8_0 ? static_cast<int8_t>(v) : v - bias_of(t);
          store(out + i * V + 32 * j + 4 * k + e, s * static_cast<float>(q) + o);
        }
      }
    }
}

using PackGroup = void (*)(const uint8_t* const*, int64_t, uint8_t*);
const PackGroup kPackGroup[] = {pack_group<Q4_0>, pack_group<Q4_1>, pack_group<Q5_0>, pack_group<Q5_1>,
                                pack_group<Q8_0>, pack_group<Q4_K>, pack_group<Q5_K>, pack_group<Q6_K>};
using PackedDot = void (*)(const uint8_t*, const uint8_t*, int64_t, const QuantRows&, int64_t, float*);
template <int R, bool E>
constexpr PackedDot kPackedDot[] = {packed_dot<Q4_0, R, E>, packed_dot<Q4_1, R, E>, packed_dot<Q5_0, R, E>,
                                    packed_dot<Q5_1, R, E>, packed_dot<Q8_0, R, E>, packed_dot<Q4_K, R, E>,
                                    packed_dot<Q5_K, R, E>, packed_dot<Q6_K, R, E>};
// Past this many activation rows, a group's steps are decoded once, to bytes, for all of them.
constexpr int64_t kExpandRows = 8;
using ExpandSteps = void (*)(const uint8_t*, int64_t, uint8_t*);
#if defined(__AVX2__)
template <int64_t t, int k = 0>
inline void expand_chunk(const uint8_t* chunk, uint8_t* out) {
  if constexpr (k < 8) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * k), step_u<t, k>(chunk));
    expand_chunk<t, k + 1>(chunk, out);
  }
}
// A packed group's steps as bytes: out [K / 32 chunks][8 steps][32].
template <int64_t t>
void expand_steps(const uint8_t* group, int64_t K, uint8_t* out) {
  for (int64_t i = 0; i < K / block_values(t); ++i, group += packed_block(t))
    for (int64_t j = 0; j < block_values(t) / 32; ++j, out += 256)
      expand_chunk<t>(group + scale_bytes(t) + j * chunk_bytes(t), out);
}
const ExpandSteps kExpandSteps[] = {expand_steps<Q4_0>, expand_steps<Q4_1>, expand_steps<Q5_0>, expand_steps<Q5_1>,
                                    expand_steps<Q8_0>, expand_steps<Q4_K>, expand_steps<Q5_K>, expand_steps<Q6_K>};
#endif
template <typename T>
using PackedRow = void (*)(const uint8_t*, int, int64_t, T*);
template <typename T>
constexpr PackedRow<T> kPackedRow[] = {packed_row<Q4_0, T>, packed_row<Q4_1, T>, packed_row<Q5_0, T>,
                                       packed_row<Q5_1, T>, packed_row<Q8_0, T>, packed_row<Q4_K, T>,
                                       packed_row<Q5_K, T>, packed_row<Q6_K, T>};
// Activation rows a packed_dot call takes at once (each lane's sums the same whatever R is).
constexpr int kRows = 4;
constexpr int64_t kMaxParts = 8;  // weights a linear concatenates (a fused q/k/v has three)

// W [N, K] of type t (file layout) packed: out [ceil(N / kLanes) groups]; the last group's rows past
// N repeat row N - 1.
void pack(int64_t type, const uint8_t* w, int64_t N, int64_t K, uint8_t* out) {
  const int64_t row_bytes = K / block_values(type) * block_bytes(type), groups = (N + kLanes - 1) / kLanes;
#pragma omp parallel for schedule(static) if (N * K >= kParallelElements)
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* rows[kLanes];
    for (int c = 0; c < kLanes; ++c) rows[c] = w + std::min(g * kLanes + c, N - 1) * row_bytes;
    kPackGroup[type](rows, K, out + g * packed_group(type, K));
  }
}

// x [M, K] rounded to int8 per block of 32 (quantize_row) into xq, whose size follows the largest
// batch it has held.
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, QuantRows& xq) {
  xq.q.resize(M * K);
  xq.d.resize(M * K / 32);
  xq.sums.resize(M * K / 32);
  xq.isums.resize(M * K / 16);
#pragma omp parallel for schedule(static) if (M * K >= kParallelElements)
  for (int64_t m = 0; m < M; ++m) {
    quantize_row(x + m * K, K, xq.q.data() + m * K, xq.d.data() + m * K / 32, xq.sums.data() + m * K / 32,
                 xq.isums.data() + m * K / 16);
  }
}

// One linear, its activations quantized: y [M, N] = x @ W.T (+ bias), W the concatenation of
// `parts` weights of rows[p] rows each. Its items of work are kLanes weight rows each, against all
// M rows: few enough that the team's threads finish together, enough that taking one costs little.
template <typename T>
struct LinearCall {
  const QuantRows* x;
  int64_t M, K, parts;
  const int64_t* types;
  const uint8_t* const* weights;
  const int64_t* rows;
  const T* bias;
  T* y;
  int64_t N;
  int64_t firsts[kMaxParts];  // each part's first output column
};

template <typename T>
LinearCall<T> linear_call(const QuantRows& x, int64_t M, int64_t K, int64_t parts, const int64_t* types,
                          const uint8_t* const* weights, const int64_t* rows, const T* bias, T* y) {
  if (parts > kMaxParts) std::abort();  // gguf_quant.py's GGUFLinear takes no more
  LinearCall<T> c{&x, M, K, parts, types, weights, rows, bias, y, 0, {0}};
  for (int64_t p = 0; p < parts; ++p) c.N += rows[p];
  for (int64_t p = 1; p < parts; ++p) c.firsts[p] = c.firsts[p - 1] + rows[p - 1];
  return c;
}

// Weight rows n0 .. n0 + kLanes (at most; n0 a multiple of kLanes) of part p of call c, against all
// its rows, kRows at a time.
template <typename T>
void linear_item(const LinearCall<T>& c, int64_t p, int64_t n0) {
  const int64_t type = c.types[p], K = c.K, M = c.M, N = c.N;
  const int rw = static_cast<int>(std::min<int64_t>(kLanes, c.rows[p] - n0));
  const uint8_t* group = c.weights[p] + n0 / kLanes * packed_group(type, K);
  const QuantRows& xq = *c.x;
  T* out = c.y + c.firsts[p] + n0;
  float b[kLanes], o[kRows * kLanes];
  for (int j = 0; j < rw; ++j) b[j] = c.bias ? to_float(c.bias[c.firsts[p] + n0 + j]) : 0.0f;
  bool expanded = false;
  thread_local std::vector<uint8_t> bytes;
#if defined(__AVX2__)
  if (M > kExpandRows) {
    bytes.resize(8 * K);
    kExpandSteps[type](group, K, bytes.data());
    expanded = true;
  }
#endif
  for (int64_t m = 0; m < M;) {
    const int R = M - m >= kRows ? kRows : 1;
    const PackedDot* dots = expanded ? (R == kRows ? kPackedDot<kRows, true> : kPackedDot<1, true>)
                                     : (R == kRows ? kPackedDot<kRows, false> : kPackedDot<1, false>);
    dots[type](group, bytes.data(), K, xq, m, o);
    for (int r = 0; r < R; ++r, ++m)
      for (int j = 0; j < rw; ++j) store(out + m * N + j, o[r * kLanes + j] + b[j]);
  }
}

// The calls' items of work (never across a part's end) over the team in one parallel region
// (shared_for): a thread that the server's other threads keep off its core leaves its rows to the
// other one rather than holding up the whole step, and the small GEMMs of a MoE layer's experts
// start the team once, not once each.
template <typename T>
void run_linears(const LinearCall<T>* calls, int64_t count) {
  struct Item {
    int64_t call, part, row;
  };
  thread_local std::vector<Item> items;
  items.clear();
  for (int64_t i = 0; i < count; ++i)
    for (int64_t p = 0; p < calls[i].parts; ++p)
      for (int64_t n = 0; n < calls[i].rows[p]; n += kLanes) items.push_back({i, p, n});
  const Item* todo = items.data();
  shared_for(static_cast<int64_t>(items.size()), [&](int64_t item, int64_t) {
    const Item& it = todo[item];
    linear_item(calls[it.call], it.part, it.row);
  });
}

thread_local QuantRows t_rows;

// y [M, N] = x [M, K] @ W.T (+ bias), W the concatenation of `parts` weights of rows[p] rows each.
template <typename T>
void gguf_linear(const T* x, int64_t M, int64_t K, int64_t parts, const int64_t* types, const uint8_t* const* weights,
                 const int64_t* rows, const T* bias, T* y) {
  quantize_rows(x, M, K, t_rows);  // the calling thread's
  const LinearCall<T> call = linear_call(t_rows, M, K, parts, types, weights, rows, bias, y);
  run_linears(&call, 1);
}

// out [n, K] = rows ids of W [*, K] (packed) dequantized (an embedding lookup).
template <typename T>
void gguf_rows(int64_t type, const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, T* out) {
#pragma omp parallel for schedule(static) if (n * K >= kParallelElements)
  for (int64_t i = 0; i < n; ++i)
    kPackedRow<T>[type](w + ids[i] / kLanes * packed_group(type, K), static_cast<int>(ids[i] % kLanes), K, out + i * K);
}

// The MLP's SiLU(gate) * up kernel (cpu_kernels.cpp), by the dtype.
inline void silu_mul(const float* gate_up, float* out, int64_t rows, int64_t dim) {
  silu_mul_f32(gate_up, out, rows, dim);
}
inline void silu_mul(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t dim) {
  silu_mul_bf16(gate_up, out, rows, dim);
}

// o += round(y * weight), each product rounded to T before the sum (as torch's `y * w` then
// `index_add_`): the products go through memory, so that no multiply-add fuses them into the sum.
template <typename T>
void add_weighted(const T* y, float weight, int64_t H, T* o) {
  thread_local std::vector<T> products;
  products.resize(H);
  T* volatile p = products.data();  // read back as stored, not kept in registers
  for (int64_t h = 0; h < H; ++h) store(p + h, to_float(y[h]) * weight);
  for (int64_t h = 0; h < H; ++h) store(o + h, to_float(o[h]) + to_float(p[h]));
}

// Picks a group of experts' GEMMs holds at most (or one expert's, where it has more): a group's
// gate/up GEMMs start the team once, and its downs once; a group's buffers hold its picks only.
constexpr int64_t kGroupPicks = 256;

// A mixture of experts' layer over n tokens (engine/model/moe.py, whose loop over the experts is
// the reference): each token's k choices (choices [n, k], experts in [0, E); weights [n, k]) sorted
// by expert, token order kept within one; then for each expert that got tokens, in ascending order,
// their rows gathered, SiLU(gate) * up of them, down, and each result row times its weight added to
// its token's row of `out` ([n, H], holding what the sums start from), with the loop's roundings:
// the product rounded to T, then the sum. counts[e] += the tokens expert e got. Types and weights
// of expert e: [3 e .. 3 e + 2] (gate, up, down). The experts go in groups (kGroupPicks), each
// output computed as gguf_linear computes it.
template <typename T>
void gguf_moe(const T* x, int64_t n, int64_t k, const int64_t* choices, const float* weights, int64_t E, int64_t H,
              int64_t I, const int64_t* types, const uint8_t* const* w, int64_t* counts, T* out) {
  thread_local std::vector<int64_t> starts, picks;
  thread_local std::vector<T> xs, gate_up, act, y;
  thread_local std::vector<QuantRows> quantized;  // per expert of a group
  thread_local std::vector<LinearCall<T>> calls;
  starts.assign(E + 1, 0);
  picks.resize(n * k);
  for (int64_t i = 0; i < n * k; ++i) {
    if (choices[i] < 0 || choices[i] >= E) std::abort();  // the router's top k: never
    ++starts[choices[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) {
    counts[e] += starts[e + 1];
    starts[e + 1] += starts[e];
  }
  for (int64_t i = 0, *next = starts.data(); i < n * k; ++i) picks[next[choices[i]]++] = i;  // advances starts[e]
  // starts[e] now ends expert e's picks (and starts e + 1's).
  const int64_t gate_up_rows[2] = {I, I};
  for (int64_t e0 = 0; e0 < E;) {
    const int64_t first = e0 == 0 ? 0 : starts[e0 - 1];  // the group: experts e0 .. e1 - 1, picks first .. end
    int64_t e1 = e0 + 1;
    while (e1 < E && starts[e1] - first <= kGroupPicks) ++e1;
    const int64_t end = starts[e1 - 1], rows = end - first;  // pick j is row j - first of the buffers
    xs.resize(rows * H), gate_up.resize(rows * 2 * I), act.resize(rows * I), y.resize(rows * H);
    for (int64_t j = first; j < end; ++j)
      std::copy(x + picks[j] / k * H, x + (picks[j] / k + 1) * H, xs.data() + (j - first) * H);
    if (static_cast<int64_t>(quantized.size()) < e1 - e0) quantized.resize(e1 - e0);  // before calls point into it
    // f(e, its first row in the buffers, its rows) queues a linear of each of the group's experts with
    // tokens; then they run, in one parallel region.
    auto run_group = [&](auto&& f) {
      calls.clear();
      for (int64_t e = e0, at = first; e < e1; at = starts[e++])
        if (starts[e] > at) f(e, at - first, starts[e] - at);
      run_linears(calls.data(), static_cast<int64_t>(calls.size()));
    };
    run_group([&](int64_t e, int64_t r, int64_t m) {  // gate/up
      quantize_rows(xs.data() + r * H, m, H, quantized[e - e0]);
      calls.push_back(linear_call<T>(quantized[e - e0], m, H, 2, types + 3 * e, w + 3 * e, gate_up_rows, nullptr,
                                     gate_up.data() + r * 2 * I));
    });
    run_group([&](int64_t e, int64_t r, int64_t m) {  // down (H rows)
      silu_mul(gate_up.data() + r * 2 * I, act.data() + r * I, m, I);
      quantize_rows(act.data() + r * I, m, I, quantized[e - e0]);
      calls.push_back(linear_call<T>(quantized[e - e0], m, I, 1, types + 3 * e + 2, w + 3 * e + 2, &H, nullptr,
                                     y.data() + r * H));
    });
    for (int64_t j = first; j < end; ++j)
      add_weighted(y.data() + (j - first) * H, weights[picks[j]], H, out + picks[j] / k * H);
    e0 = e1;
  }
}

}  // namespace

extern "C" {

// W [N, K] of a GGML type (its file's blocks) packed for gguf_linear, gguf_moe and gguf_rows:
// out [gguf_packed_bytes].
int64_t gguf_packed_bytes(int64_t type, int64_t N, int64_t K) {
  return (N + kLanes - 1) / kLanes * packed_group(type, K);
}
void gguf_pack(int64_t type, const uint8_t* w, int64_t N, int64_t K, uint8_t* out) { pack(type, w, N, K, out); }

#define PPSERVE_GGUF_KERNELS(suffix, T)                                                                          \
  void gguf_linear_##suffix(const T* x, int64_t M, int64_t K, int64_t parts, const int64_t* types,                \
                            const uint8_t* const* weights, const int64_t* rows, const T* bias, T* y) {            \
    gguf_linear(x, M, K, parts, types, weights, rows, bias, y);                                                  \
  }                                                                                                              \
  void gguf_rows_##suffix(int64_t type, const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, T* out) {     \
    gguf_rows(type, w, K, ids, n, out);                                                                          \
  }                                                                                                              \
  void gguf_moe_##suffix(const T* x, int64_t n, int64_t k, const int64_t* choices, const float* weights, int64_t E, \
                         int64_t H, int64_t I, const int64_t* types, const uint8_t* const* w, int64_t* counts,   \
                         T* out) {                                                                                \
    gguf_moe(x, n, k, choices, weights, E, H, I, types, w, counts, out);                                         \
  }

PPSERVE_GGUF_KERNELS(f32, float)
PPSERVE_GGUF_KERNELS(bf16, uint16_t)

}  // extern "C"
