// A decode step's decoder layers in one call (engine/model/decode_step.py builds its arguments).
//
// On a thin, deep model at small batches the layers' own kernels are quick, and what is left is the
// Python around them: per layer some ten module calls, views, allocations and ctypes calls, a large
// share of the step at batch 1 (docs/benchmarks.md#where-a-decode-step-goes). Here the same kernels
// run in the same order on the same values, from C++: the result is bitwise the one of the
// layer-by-layer forward (engine/model/model.py), which a mixed micro-batch still takes.
//
// For float32 and bfloat16, and a micro-batch of decode tokens only (one per request, in the
// batch's row order). A linear runs one of this library's GEMMs (cpu_gemm.cpp) where the model's
// does; any other (oneDNN's, for bfloat16) is run by the caller through a callback, on buffers the
// caller owns, so it is the same op on the same input as in the module loop.

#include "cpu_kernels.h"

#include <cstddef>
#include <string>

// One linear: y = x @ W.T + b by the GEMM `kind` names, with its packed weight's tensors.
struct Gemm {
  // 0: float_gemm; 2: float_gemm_silu (float32 only); 4, 8: quant_gemm_q4, _q8; 1: the caller's;
  // 16 + p: gguf_linear of p parts (weight, scales, mins: its weights, types and rows arrays)
  int64_t kind;
  const void* weight;
  const void* scales;  // quantized only
  const void* mins;    // 4 bits only
  const void* bias;    // or null
  int64_t out_features;  // the weight's rows (float_gemm_silu's output is half as wide)
  int64_t in_features;
};

// One decoder layer's weights (the norms' of the model's type) and what it reads.
struct Layer {
  const void* input_norm;
  const void* post_norm;  // after the residual add, before the MLP (Gemma: on attention's output)
  const void* q_norm;     // per head, before RoPE (Qwen3, Gemma), or null
  const void* k_norm;     // null when q_norm is
  Gemm qkv, out, gate_up, down;
  int64_t window;               // 0: none
  const void* pre_ffn_norm;     // Gemma: after the residual add, before the MLP; null for the others
  const void* post_ffn_norm;    // Gemma: on the MLP's output; null when pre_ffn_norm is
  int64_t gelu;                 // the MLP's activation: GELU's tanh approximation (Gemma), else SiLU
  int64_t group, index;         // its KV cache: layer `index` of Cache `group`
  int64_t rope;                 // its RoPE table: 0 the global one, 1 the local one (Gemma's sliding layers)
  int64_t moe;                  // a mixture of experts in place of the MLP: the caller's, as `which` 2
};

// A group of layers' KV cache (engine/model/kv_cache.py: the full layers', the windowed ones') and
// the micro-batch's rows in it.
struct Cache {
  void* kv;             // [layers of the group, 2, slots, kv_heads, head_dim]
  int64_t slots;        // per layer: blocks * block_size
  const int64_t* slot;  // [n]: where each row's key and value go
  const int64_t* tables;  // [n, max_blocks]
  const int64_t* lens;    // [n]
  int64_t max_blocks;
};

// What every layer of the model shares.
struct Dims {
  int64_t hidden, heads, kv_heads, head_dim;
  float eps, scale;
};

// The buffers the linears read and write, [n, width] each, owned by the caller: normed -> qkv,
// attn -> proj, normed -> gate_up, act -> pending. A kind-1 linear reads its input there and
// answers with where its output is instead.
struct Buffers {
  void *normed, *qkv, *attn, *proj, *gate_up, *act, *pending;
};

// Runs layer `layer`'s linear `which` (0: qkv, 1: out, 2: gate_up, 3: down; a mixture of experts'
// layer: 2 is its whole MLP, normed -> its output, [rows, hidden]) on the first `rows` rows of its
// input buffer; returns the address of its output ([rows, out_features], valid until
// the next call for the same `which`), or 0 when it failed (the step then stops and says so).
using LinearFn = intptr_t (*)(int64_t layer, int64_t which, int64_t rows);

namespace {

using namespace ppserve;

// The library's kernels by element type (their extern "C" names carry it).
void norm(float* h, const float* add, const void* w, float* out, int64_t rows, int64_t dim, float eps) {
  rms_norm_f32(h, add, static_cast<const float*>(w), out, rows, dim, eps);
}
void norm(uint16_t* h, const uint16_t* add, const void* w, uint16_t* out, int64_t rows, int64_t dim, float eps) {
  rms_norm_bf16(h, add, static_cast<const uint16_t*>(w), out, rows, dim, eps);
}
void gated_mul(bool gelu, const float* gate_up, float* out, int64_t rows, int64_t dim) {
  (gelu ? gelu_mul_f32 : silu_mul_f32)(gate_up, out, rows, dim);
}
void gated_mul(bool gelu, const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t dim) {
  (gelu ? gelu_mul_bf16 : silu_mul_bf16)(gate_up, out, rows, dim);
}
template <typename T>
void rope_write_kv(T* q, int64_t q_stride, T* k, int64_t k_stride, const T* v, int64_t v_stride, const T* cos,
                   const T* sin, const int64_t* slots, T* k_cache, T* v_cache, int64_t n, int64_t heads,
                   int64_t kv_heads, int64_t head_dim) {
  if constexpr (std::is_same_v<T, float>)
    rope_write_kv_f32(q, q_stride, k, k_stride, v, v_stride, cos, sin, slots, k_cache, v_cache, n, heads, kv_heads,
                      head_dim);
  else
    rope_write_kv_bf16(q, q_stride, k, k_stride, v, v_stride, cos, sin, slots, k_cache, v_cache, n, heads, kv_heads,
                       head_dim);
}
template <typename T>
void attention(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lens, T* out, int64_t batch,
               int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
               int64_t window) {
  if constexpr (std::is_same_v<T, float>)
    decode_attention_f32(q, k, v, tables, lens, out, batch, heads, kv_heads, head_dim, block_size, max_blocks, scale,
                         window);
  else
    decode_attention_bf16(q, k, v, tables, lens, out, batch, heads, kv_heads, head_dim, block_size, max_blocks,
                          scale, window);
}

// Linear `which` of layer `layer` on x: its output, in y or where the caller's put it; null when
// the caller's failed.
template <typename T>
T* gemm(const Gemm& g, const T* x, T* y, int64_t rows, LinearFn linear, int64_t layer, int64_t which) {
  [[maybe_unused]] const int64_t n = g.out_features, k = g.in_features;
  [[maybe_unused]] const auto bias = static_cast<const T*>(g.bias);
  switch (g.kind) {
    case 1: return reinterpret_cast<T*>(linear(layer, which, rows));
#if defined(PPSERVE_FLOAT_GEMM)
    case 0:
      if constexpr (std::is_same_v<T, float>) {
        float_gemm_f32(x, static_cast<const float*>(g.weight), bias, y, rows, n, k);
        return y;
      } else {
  #if defined(PPSERVE_BF16_GEMM)
        float_gemm_bf16(x, static_cast<const uint32_t*>(g.weight), bias, y, rows, n, k);
        return y;
  #endif
      }
      break;
#endif
#if defined(PPSERVE_QUANT_GEMM)
    case 4:
    case 8: {
      const auto w = static_cast<const uint8_t*>(g.weight);
      const auto s = static_cast<const uint16_t*>(g.scales), m = static_cast<const uint16_t*>(g.mins);
      if constexpr (std::is_same_v<T, float>)
        (g.kind == 4 ? quant_gemm_q4_f32 : quant_gemm_q8_f32)(x, w, s, m, bias, y, rows, n, k);
      else
        (g.kind == 4 ? quant_gemm_q4_bf16 : quant_gemm_q8_bf16)(x, w, s, m, bias, y, rows, n, k);
      return y;
    }
#endif
    default:
      if (g.kind > 16) {
        const auto weights = static_cast<const uint8_t* const*>(g.weight);
        const auto types = static_cast<const int64_t*>(g.scales), parts = static_cast<const int64_t*>(g.mins);
        if constexpr (std::is_same_v<T, float>)
          gguf_linear_f32(x, rows, k, g.kind - 16, types, weights, parts, bias, y);
        else
          gguf_linear_bf16(x, rows, k, g.kind - 16, types, weights, parts, bias, y);
        return y;
      }
      break;
  }
  std::abort();  // decode_step.py passes only the kinds this library has
}

// SiLU(gate) * up into `act` where the gate/up linear is float_gemm_silu; false for any other.
template <typename T>
bool silu_gemm(const Gemm& g, const T* x, T* act, int64_t rows) {
#if defined(PPSERVE_FLOAT_GEMM)
  if constexpr (std::is_same_v<T, float>) {
    if (g.kind == 2) {
      float_gemm_silu_f32(x, static_cast<const float*>(g.weight), static_cast<const float*>(g.bias), act, rows,
                          g.out_features, g.in_features);
      return true;
    }
  }
#endif
  return false;
}

// Row r of `src` (rows `stride` apart) to row r of `dst` (packed), `width` values each.
template <typename T>
void rows(const T* src, int64_t stride, T* dst, int64_t width, int64_t n) {
  for (int64_t r = 0; r < n; ++r) std::memcpy(dst + r * width, src + r * stride, width * sizeof(T));
}

// Scratch of the calling thread (a stage's compute thread), grown on demand and kept.
template <typename T>
T* scratch(std::vector<T>& v, int64_t size) {
  if (static_cast<int64_t>(v.size()) < size) v.resize(size);
  return v.data();
}

// h: [n, hidden], the residual stream, updated in place to the stage's output (its last layer's
// MLP output added). caches: the groups' (Cache), ropes: cos and sin of the global table, then of
// the local one ([n, head_dim] each; sin signed, see model.py). Returns 0, or 1 when a caller's
// linear failed.
template <typename T>
int decode_layers(const Layer* layers, int64_t num_layers, const Dims& d, const Buffers& buf, LinearFn linear, T* h,
                  const Cache* caches, const T* const* ropes, int64_t n, int64_t block_size) {
  const int64_t q_out = d.heads * d.head_dim, kv_out = d.kv_heads * d.head_dim;
  thread_local std::vector<T> q_v, raw_q_v, raw_k_v, k_normed_v, normed_out_v;  // q/k norms, Gemma's norms
  T* normed = static_cast<T*>(buf.normed);
  T* attn = static_cast<T*>(buf.attn);
  T* act = static_cast<T*>(buf.act);
  T* pending = nullptr;  // the previous layer's MLP output
  for (int64_t i = 0; i < num_layers; ++i) {
    const Layer& l = layers[i];
    const Cache& c = caches[l.group];
    const int64_t cache_elems = c.slots * kv_out;  // one layer's keys (or values)
    T* k_cache = static_cast<T*>(c.kv) + 2 * l.index * cache_elems;
    T* v_cache = k_cache + cache_elems;
    const T *cos = ropes[2 * l.rope], *sin = ropes[2 * l.rope + 1];
    norm(h, i == 0 ? nullptr : pending, l.input_norm, normed, n, d.hidden, d.eps);
    T* qkv = gemm(l.qkv, normed, static_cast<T*>(buf.qkv), n, linear, i, 0);
    if (qkv == nullptr) return 1;
    const int64_t width = l.qkv.out_features;
    T* q = scratch(q_v, n * q_out);  // the queries' rows, contiguous, as the attention takes them
    T *q_rope = qkv, *k_rope = qkv + q_out;
    int64_t q_stride = width, k_stride = width;
    if (l.q_norm != nullptr) {  // as Attention.forward: each head's norm, from contiguous copies
      T* raw_q = scratch(raw_q_v, n * q_out);
      T* raw_k = scratch(raw_k_v, n * kv_out);
      rows(qkv, width, raw_q, q_out, n);
      rows(qkv + q_out, width, raw_k, kv_out, n);
      k_rope = scratch(k_normed_v, n * kv_out);
      norm(raw_q, nullptr, l.q_norm, q, n * d.heads, d.head_dim, d.eps);
      norm(raw_k, nullptr, l.k_norm, k_rope, n * d.kv_heads, d.head_dim, d.eps);
      q_rope = q, q_stride = q_out, k_stride = kv_out;
    }
    rope_write_kv(q_rope, q_stride, k_rope, k_stride, qkv + q_out + kv_out, width, cos, sin, c.slot, k_cache, v_cache,
                  n, d.heads, d.kv_heads, d.head_dim);
    if (l.q_norm == nullptr) rows(qkv, width, q, q_out, n);  // the rotated queries
    attention(q, k_cache, v_cache, c.tables, c.lens, attn, n, d.heads, d.kv_heads, d.head_dim, block_size,
              c.max_blocks, d.scale, l.window);
    T* proj = gemm(l.out, attn, static_cast<T*>(buf.proj), n, linear, i, 1);
    if (proj == nullptr) return 1;
    if (l.pre_ffn_norm != nullptr) {  // as GemmaDecoderLayer.forward: attention's output normed, then added
      T* normed_proj = scratch(normed_out_v, n * d.hidden);
      norm(proj, nullptr, l.post_norm, normed_proj, n, d.hidden, d.eps);
      norm(h, normed_proj, l.pre_ffn_norm, normed, n, d.hidden, d.eps);
    } else {
      norm(h, proj, l.post_norm, normed, n, d.hidden, d.eps);
    }
    if (l.moe) {
      // The experts (engine/model/moe.py): its router is torch's linear, as in the module loop, and
      // its grouped kernel one call; from here only the Python around attention is saved.
      pending = reinterpret_cast<T*>(linear(i, 2, n));
    } else {
      if (l.gelu || !silu_gemm(l.gate_up, normed, act, n)) {
        const T* gate_up = gemm(l.gate_up, normed, static_cast<T*>(buf.gate_up), n, linear, i, 2);
        if (gate_up == nullptr) return 1;
        gated_mul(l.gelu != 0, gate_up, act, n, l.gate_up.out_features / 2);
      }
      pending = gemm(l.down, act, static_cast<T*>(buf.pending), n, linear, i, 3);
    }
    if (pending == nullptr) return 1;
    if (l.post_ffn_norm != nullptr) {  // Gemma: the MLP's output normed before the next layer adds it
      T* normed_mlp = scratch(normed_out_v, n * d.hidden);
      norm(pending, nullptr, l.post_ffn_norm, normed_mlp, n, d.hidden, d.eps);
      pending = normed_mlp;
    }
  }
  if (num_layers > 0)
    for (int64_t j = 0; j < n * d.hidden; ++j) store(h + j, to_float(h[j]) + to_float(pending[j]));
  return 0;
}

}  // namespace

extern "C" {

#define PPSERVE_DECODE_STEP(SUFFIX, T)                                                                                \
  int decode_layers_##SUFFIX(const Layer* layers, int64_t num_layers, const Dims* dims, const Buffers* buf,          \
                             LinearFn linear, T* h, const Cache* caches, const T* const* ropes, int64_t n,           \
                             int64_t block_size) {                                                                    \
    return decode_layers(layers, num_layers, *dims, *buf, linear, h, caches, ropes, n, block_size);                  \
  }

PPSERVE_DECODE_STEP(f32, float)
PPSERVE_DECODE_STEP(bf16, uint16_t)

}  // extern "C"

namespace {

// A field's, argument's or result's type as decode_step.py spells a ctypes type: its kind (p: a
// pointer, i or u: a signed or unsigned integer, f: floating point, s: a struct, v: void) and its
// size in bytes.
template <typename T>
std::string abi_type() {
  if constexpr (std::is_void_v<T>) {
    return "v0";
  } else {
    const char kind = std::is_pointer_v<T>         ? 'p'
                      : std::is_floating_point_v<T> ? 'f'
                      : std::is_integral_v<T>       ? (std::is_signed_v<T> ? 'i' : 'u')
                      : std::is_class_v<T>          ? 's'
                                                    : '?';
    return kind + std::to_string(sizeof(T));
  }
}

// "function NAME RESULT ARGUMENT...": a function's (or function pointer type's) signature.
template <typename R, typename... A>
std::string abi_function(const char* name, R (*)(A...)) {
  std::string line = std::string("function ") + name + " " + abi_type<R>();
  ((line += " " + abi_type<A>()), ...);
  return line + "\n";
}

}  // namespace

// "struct NAME SIZE", then "field NAME FIELD OFFSET TYPE" for each of its fields, in order.
#define PPSERVE_STRUCT(S) ("struct " #S " " + std::to_string(sizeof(S)) + "\n")
#define PPSERVE_FIELD(S, F) \
  ("field " #S " " #F " " + std::to_string(offsetof(S, F)) + " " + abi_type<decltype(S::F)>() + "\n")

extern "C" {

// The structs above and the functions decode_step.py calls, as this build lays them out, one line
// each: decode_step.py compares its ctypes mirrors of them with this when it loads the library,
// since a field or argument edited on one side only would otherwise pass values to the wrong
// places without any error. Every field of every struct, in the order declared.
const char* decode_step_layout() {
  static const std::string text =
      PPSERVE_STRUCT(Gemm) + PPSERVE_FIELD(Gemm, kind) + PPSERVE_FIELD(Gemm, weight) + PPSERVE_FIELD(Gemm, scales) +
      PPSERVE_FIELD(Gemm, mins) + PPSERVE_FIELD(Gemm, bias) + PPSERVE_FIELD(Gemm, out_features) +
      PPSERVE_FIELD(Gemm, in_features) +
      PPSERVE_STRUCT(Layer) + PPSERVE_FIELD(Layer, input_norm) + PPSERVE_FIELD(Layer, post_norm) +
      PPSERVE_FIELD(Layer, q_norm) + PPSERVE_FIELD(Layer, k_norm) + PPSERVE_FIELD(Layer, qkv) +
      PPSERVE_FIELD(Layer, out) + PPSERVE_FIELD(Layer, gate_up) + PPSERVE_FIELD(Layer, down) +
      PPSERVE_FIELD(Layer, window) + PPSERVE_FIELD(Layer, pre_ffn_norm) + PPSERVE_FIELD(Layer, post_ffn_norm) +
      PPSERVE_FIELD(Layer, gelu) + PPSERVE_FIELD(Layer, group) + PPSERVE_FIELD(Layer, index) +
      PPSERVE_FIELD(Layer, rope) + PPSERVE_FIELD(Layer, moe) +
      PPSERVE_STRUCT(Cache) + PPSERVE_FIELD(Cache, kv) + PPSERVE_FIELD(Cache, slots) + PPSERVE_FIELD(Cache, slot) +
      PPSERVE_FIELD(Cache, tables) + PPSERVE_FIELD(Cache, lens) + PPSERVE_FIELD(Cache, max_blocks) +
      PPSERVE_STRUCT(Dims) + PPSERVE_FIELD(Dims, hidden) + PPSERVE_FIELD(Dims, heads) +
      PPSERVE_FIELD(Dims, kv_heads) + PPSERVE_FIELD(Dims, head_dim) + PPSERVE_FIELD(Dims, eps) +
      PPSERVE_FIELD(Dims, scale) +
      PPSERVE_STRUCT(Buffers) + PPSERVE_FIELD(Buffers, normed) + PPSERVE_FIELD(Buffers, qkv) +
      PPSERVE_FIELD(Buffers, attn) + PPSERVE_FIELD(Buffers, proj) + PPSERVE_FIELD(Buffers, gate_up) +
      PPSERVE_FIELD(Buffers, act) + PPSERVE_FIELD(Buffers, pending) +
      abi_function("decode_layers_f32", &decode_layers_f32) + abi_function("decode_layers_bf16", &decode_layers_bf16) +
      abi_function("LinearFn", LinearFn{});
  return text.c_str();
}

}  // extern "C"
