// GGUF's quantized block formats run as they lie in the file (engine/model/gguf_quant.py): a linear
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
// linear's weight rows go kLanes at a time into the lanes layout (to_lanes, below) and meet the
// activations there in integer multiply-adds; each row's result is the same whatever else is in the
// batch (lanes_dot's formula), so a request's tokens do not depend on how the pipeline batched it.

#include "cpu_kernels.h"

#include <cstdlib>
#include <new>

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

// A block's scales and offsets per group of 16 values: s, o [values of the block / 16].
template <int64_t t>
void unpack_scales(const uint8_t* b, float* s, float* o) {
  if constexpr (t < Q4_K) {
    s[0] = s[1] = half(b);
    o[0] = o[1] = (t == Q4_1 || t == Q5_1) ? half(b + 2) : 0.0f;
  } else if constexpr (t == Q4_K || t == Q5_K) {
    const float d = half(b), dmin = half(b + 2);
    for (int j = 0; j < 8; ++j) {  // sub-block j of 32: groups 2j and 2j + 1
      int sc, m;
      scale_min_k4(j, b + 4, &sc, &m);
      s[2 * j] = s[2 * j + 1] = d * static_cast<float>(sc);
      o[2 * j] = o[2 * j + 1] = -(dmin * static_cast<float>(m));
    }
  } else {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half(b + 208);
    for (int g = 0; g < 16; ++g) {
      s[g] = d * static_cast<float>(sc[g]);
      o[g] = 0.0f;
    }
  }
}

// One row of K values of type t: q [K], scale and offset [K / 16].
template <int64_t t>
void unpack_row_of(const uint8_t* b, int64_t K, int8_t* q, float* s, float* o) {
  const int64_t v = block_values(t), n = K / v;
  for (int64_t i = 0; i < n; ++i, b += block_bytes(t)) {
    unpack_values<t>(b, q + i * v);
    unpack_scales<t>(b, s + i * v / 16, o + i * v / 16);
  }
}

using UnpackRow = void (*)(const uint8_t*, int64_t, int8_t*, float*, float*);
// By type, so that the per-block code has no branch on it.
const UnpackRow kUnpackRow[] = {unpack_row_of<Q4_0>, unpack_row_of<Q4_1>, unpack_row_of<Q5_0>, unpack_row_of<Q5_1>,
                                unpack_row_of<Q8_0>, unpack_row_of<Q4_K>, unpack_row_of<Q5_K>, unpack_row_of<Q6_K>};

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

template <typename T>
struct AlignedAlloc {  // 32-byte aligned storage, for the lanes' aligned loads
  using value_type = T;
  AlignedAlloc() = default;
  template <typename U>
  AlignedAlloc(const AlignedAlloc<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(32))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(32)); }
  bool operator==(const AlignedAlloc&) const { return true; }
};

struct QuantRows {  // the activations as quantize_row leaves them, row-major
  std::vector<int8_t> q;
  std::vector<float> d, sums;
  std::vector<int32_t> isums;
};

// Every product runs on kLanes weight rows side by side ("lanes"), as llama.cpp's repacked x86
// kernels do: value k of row c lies at byte 32 * (k / 4) + 4 * c + k % 4, so one 32-byte load
// holds 4 values of each row, and one broadcast of 4 activation bytes meets all 8 rows in one
// u8 x s8 multiply-add, with no sign to move and each row's sum in its own lane. The values lie
// there as u = q + bias(t) >= 0 (Q8_0's may be negative: its kernel moves their sign onto the
// activations instead), and bias * (the activations' sum) comes off the integer sum.
// Per group of values with one scale (32; Q6_K's 16) a row's integer dot product is exact, then
//   acc = fma(float(that), s * dx, acc)   (group by group, in order)
//   off = fma(o, dx * sum(qx), off)       (per block of 32, the types with offsets)
//   y = acc + off
// whatever else is in the batch: a request's tokens do not depend on how the pipeline batched it.
constexpr int kLanes = 8;
constexpr int64_t group_values(int64_t t) { return t == Q6_K ? 16 : 32; }
constexpr int bias_of(int64_t t) { return t == Q4_0 ? 8 : t == Q5_0 ? 16 : t == Q6_K ? 32 : 0; }
// Steps of 4 values whose u8 x s8 pair sums add up in int16 before they widen: the most that stay
// below 2^15 (each pair at most 2 * max u * 127; Q8_0's at most 2 * 128 * 127).
constexpr int64_t int16_steps(int64_t t) {
  return t == Q8_0 ? 1 : t == Q6_K ? 2 : (t == Q5_0 || t == Q5_1 || t == Q5_K) ? 4 : 8;
}

// kLanes weight rows of K values as lanes: u [K / 4][32 bytes], s [K / group][kLanes], and o
// [K / 32][kLanes] for the types with offsets.
struct Lanes {
  std::vector<uint8_t, AlignedAlloc<uint8_t>> u;
  std::vector<float> s, o;
};

#if defined(__AVX2__)
// v[c]'s 32-bit element k moved to v[k]'s element c.
inline void transpose8x32(__m256i* v) {
  __m256i t[8], h[8];
  for (int i = 0; i < 8; i += 2)
    t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]), t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
  for (int i = 0; i < 8; i += 4)
    for (int j = 0; j < 2; ++j) {
      h[i + 2 * j] = _mm256_unpacklo_epi64(t[i + j], t[i + j + 2]);
      h[i + 2 * j + 1] = _mm256_unpackhi_epi64(t[i + j], t[i + j + 2]);
    }
  // h[0..3]: elements 0, 1, 2, 3 (and 4..7 in the high halves) of rows 0-3; h[4..7] of rows 4-7.
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_permute2x128_si256(h[k], h[k + 4], 0x20);
    v[k + 4] = _mm256_permute2x128_si256(h[k], h[k + 4], 0x31);
  }
}
#endif

// Rows rows[0 .. kLanes) of K values of type t, as lanes.
template <int64_t t>
void to_lanes(const uint8_t* const* rows, int64_t K, Lanes& lanes) {
  constexpr int64_t V = block_values(t), G = group_values(t);
  lanes.u.resize(kLanes * K), lanes.s.resize(kLanes * K / G);
  if constexpr (has_offsets(t)) lanes.o.resize(kLanes * K / 32);
  float s[V / 16], o[V / 16];
  for (int64_t i = 0; i < K / V; ++i) {
    const int64_t at = i * block_bytes(t);
    for (int c = 0; c < kLanes; ++c) {
      unpack_scales<t>(rows[c] + at, s, o);
      for (int64_t g = 0; g < V / G; ++g) lanes.s[(i * V / G + g) * kLanes + c] = s[g * G / 16];
      if constexpr (has_offsets(t))
        for (int64_t g = 0; g < V / 32; ++g) lanes.o[(i * V / 32 + g) * kLanes + c] = o[2 * g];
    }
#if defined(__AVX2__)
    for (int64_t j = 0; j < V / 32; ++j) {
      __m256i v[kLanes];
      for (int c = 0; c < kLanes; ++c)
        v[c] = _mm256_add_epi8(values32<t>(rows[c] + at, j), _mm256_set1_epi8(static_cast<char>(bias_of(t))));
      transpose8x32(v);
      uint8_t* u = lanes.u.data() + (i * V + 32 * j) * kLanes;
      for (int k = 0; k < kLanes; ++k) _mm256_store_si256(reinterpret_cast<__m256i*>(u + 32 * k), v[k]);
    }
#else
    int8_t q[V];
    for (int c = 0; c < kLanes; ++c) {
      unpack_values<t>(rows[c] + at, q);
      for (int64_t k = 0; k < V; ++k)
        lanes.u[(i * V + k) / 4 * 32 + 4 * c + k % 4] = static_cast<uint8_t>(q[k] + bias_of(t));
    }
#endif
  }
}

// The lanes' rows against activation rows r0 .. r0 + R: out [R][kLanes] (without bias).
#if defined(__AVX2__)
#define PPSERVE_IN_ORDER
#else
// Without AVX2 the sums are plain C++: the compiler must not reorder them (it would, differently for
// each R), or a row's result would depend on how many rows it was computed with.
#define PPSERVE_IN_ORDER __attribute__((optimize("no-associative-math", "fp-contract=off")))
#endif
template <int64_t t, int R>
PPSERVE_IN_ORDER void lanes_dot(const Lanes& lanes, int64_t K, const QuantRows& x, int64_t r0, float* out) {
  constexpr int64_t G = group_values(t);
  const int64_t blocks = K / 32;
  const int8_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = x.q.data() + (r0 + r) * K;
  // A group's bias * sum(qx): the sum of its one or two 16s.
  auto bias_sum = [&](int r, int64_t g) {
    const int32_t* is = x.isums.data() + (r0 + r) * (K / 16) + g * (G / 16);
    return bias_of(t) * (G == 16 ? is[0] : is[0] + is[1]);
  };
#if defined(__AVX2__)
  __m256 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* u = lanes.u.data();
  for (int64_t g = 0; g < K / G; ++g) {
    __m256i dot[R], pairs[R];
    for (int r = 0; r < R; ++r) dot[r] = pairs[r] = _mm256_setzero_si256();
    for (int64_t k = 0; k < G / 4; ++k, u += 32) {
      const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(u));
      [[maybe_unused]] const __m256i w_abs = _mm256_abs_epi8(w);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq[r] + g * G + 4 * k, 4);
        const __m256i a = _mm256_set1_epi32(four);
        const __m256i p = t == Q8_0 ? _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(a, w)) : _mm256_maddubs_epi16(w, a);
        pairs[r] = _mm256_add_epi16(pairs[r], p);
        if ((k + 1) % int16_steps(t) == 0)
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(pairs[r], ones)), pairs[r] = _mm256_setzero_si256();
      }
    }
    const __m256 s = _mm256_loadu_ps(lanes.s.data() + g * kLanes);
    const int64_t b = g * G / 32;
    for (int r = 0; r < R; ++r) {
      if constexpr (bias_of(t) != 0) dot[r] = _mm256_sub_epi32(dot[r], _mm256_set1_epi32(bias_sum(r, g)));
      const __m256 scale = _mm256_mul_ps(s, _mm256_set1_ps(x.d[(r0 + r) * blocks + b]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), scale, acc[r]);
      if constexpr (has_offsets(t))  // (groups of 32)
        off[r] = _mm256_fmadd_ps(_mm256_loadu_ps(lanes.o.data() + b * kLanes),
                                 _mm256_set1_ps(x.sums[(r0 + r) * blocks + b]), off[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * kLanes, _mm256_add_ps(acc[r], off[r]));
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kLanes; ++c) {
      float acc = 0.0f, off = 0.0f;
      for (int64_t g = 0; g < K / G; ++g) {
        int dot = 0;
        for (int64_t k = g * G; k < (g + 1) * G; ++k) {
          const uint8_t v = lanes.u[k / 4 * 32 + 4 * c + k % 4];
          dot += (t == Q8_0 ? static_cast<int8_t>(v) : v) * xq[r][k];
        }
        if constexpr (bias_of(t) != 0) dot -= bias_sum(r, g);
        const int64_t b = g * G / 32;
        acc += static_cast<float>(dot) * (lanes.s[g * kLanes + c] * x.d[(r0 + r) * blocks + b]);
        if constexpr (has_offsets(t)) off += lanes.o[b * kLanes + c] * x.sums[(r0 + r) * blocks + b];
      }
      out[r * kLanes + c] = acc + off;
    }
#endif
}

using ToLanes = void (*)(const uint8_t* const*, int64_t, Lanes&);
const ToLanes kToLanes[] = {to_lanes<Q4_0>, to_lanes<Q4_1>, to_lanes<Q5_0>, to_lanes<Q5_1>,
                            to_lanes<Q8_0>, to_lanes<Q4_K>, to_lanes<Q5_K>, to_lanes<Q6_K>};
using LanesDot = void (*)(const Lanes&, int64_t, const QuantRows&, int64_t, float*);
template <int R>
constexpr LanesDot kLanesDot[] = {lanes_dot<Q4_0, R>, lanes_dot<Q4_1, R>, lanes_dot<Q5_0, R>, lanes_dot<Q5_1, R>,
                                  lanes_dot<Q8_0, R>, lanes_dot<Q4_K, R>, lanes_dot<Q5_K, R>, lanes_dot<Q6_K, R>};
// Activation rows a lanes_dot call takes at once (each lane's sums the same whatever R is).
constexpr int kRows = 4;
constexpr int64_t kMaxParts = 8;  // weights a linear concatenates (a fused q/k/v has three)

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

// Weight rows n0 .. n0 + kLanes (at most) of part p of call c, against all its rows: the rows put
// in lanes once, then every kRows activation rows in turn.
template <typename T>
void linear_item(const LinearCall<T>& c, int64_t p, int64_t n0) {
  const int64_t type = c.types[p], K = c.K, M = c.M, N = c.N;
  const int64_t row_bytes = K / block_values(type) * block_bytes(type);
  const int rw = static_cast<int>(std::min<int64_t>(kLanes, c.rows[p] - n0));
  const uint8_t* rows[kLanes];  // past the part's end, its last row again: computed and dropped
  for (int j = 0; j < kLanes; ++j) rows[j] = c.weights[p] + (n0 + std::min(j, rw - 1)) * row_bytes;
  thread_local Lanes lanes;
  kToLanes[type](rows, K, lanes);
  const QuantRows& xq = *c.x;
  T* out = c.y + c.firsts[p] + n0;
  float b[kLanes], o[kRows * kLanes];
  for (int j = 0; j < rw; ++j) b[j] = c.bias ? to_float(c.bias[c.firsts[p] + n0 + j]) : 0.0f;
  for (int64_t m = 0; m < M;) {
    const int R = M - m >= kRows ? kRows : 1;
    (R == kRows ? kLanesDot<kRows> : kLanesDot<1>)[type](lanes, K, xq, m, o);
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

// out [n, K] = rows ids of W [*, K] dequantized (an embedding lookup).
template <typename T>
void gguf_rows(int64_t type, const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, T* out) {
  const int64_t row_bytes = K / block_values(type) * block_bytes(type);
#pragma omp parallel if (n * K >= kParallelElements)
  {
    std::vector<int8_t> q(K);
    std::vector<float> s(K / 16), o(K / 16);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      kUnpackRow[type](w + ids[i] * row_bytes, K, q.data(), s.data(), o.data());
      for (int64_t k = 0; k < K; ++k) store(out + i * K + k, s[k / 16] * static_cast<float>(q[k]) + o[k / 16]);
    }
  }
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
