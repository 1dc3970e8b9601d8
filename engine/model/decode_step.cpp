// A decode step's decoder layers in one call (engine/model/decode_step.py builds its arguments).
//
// On a thin, deep model at small batches the layers' own kernels are quick, and what is left is the
// Python around them: per layer some ten module calls, views, allocations and ctypes calls, about
// 0.1 ms a layer, a third of SmolLM2's step at batch 1. Here the same kernels run in the same
// order on the same values, from C++: the result is bitwise the one of the layer-by-layer forward
// (engine/model/model.py), which a mixed micro-batch still takes.
//
// For a float32 model whose linears all run ppserve's own GEMMs (cpu_gemm.cpp), and a micro-batch
// of decode tokens only (one per request, in the batch's row order).

#include "cpu_kernels.h"

// One linear: y = x @ W.T + b by the GEMM `kind` names, with its packed weight's tensors.
struct Gemm {
  int64_t kind;  // 0: float_gemm; 4, 8: quant_gemm_q4, quant_gemm_q8
  const void* weight;
  const void* scales;  // quantized only
  const void* mins;    // 4 bits only
  const float* bias;   // or null
  int64_t out_features;
  int64_t in_features;
};

// One decoder layer's weights.
struct Layer {
  const float* input_norm;
  const float* post_norm;
  const float* q_norm;  // per head, before RoPE (Qwen3), or null
  const float* k_norm;  // null when q_norm is
  Gemm qkv, out, gate_up, down;
  int64_t window;  // 0: none
};

// What every layer of the model shares.
struct Dims {
  int64_t hidden, heads, kv_heads, head_dim;
  float eps, scale;
};

namespace {

void gemm(const Gemm& g, const float* x, float* y, int64_t rows) {
  const int64_t n = g.out_features, k = g.in_features;
  switch (g.kind) {
#if defined(PPSERVE_FLOAT_GEMM)
    case 0: float_gemm_f32(x, static_cast<const float*>(g.weight), g.bias, y, rows, n, k); return;
#endif
#if defined(PPSERVE_QUANT_GEMM)
    case 4:
    case 8: {
      const auto w = static_cast<const uint8_t*>(g.weight);
      const auto s = static_cast<const uint16_t*>(g.scales), m = static_cast<const uint16_t*>(g.mins);
      (g.kind == 4 ? quant_gemm_q4_f32 : quant_gemm_q8_f32)(x, w, s, m, g.bias, y, rows, n, k);
      return;
    }
#endif
    default: std::abort();  // decode_step.py passes only the kinds this library has
  }
}

// Row r of `src` (rows `stride` apart) to row r of `dst` (packed), `width` values each.
void rows(const float* src, int64_t stride, float* dst, int64_t width, int64_t n) {
  for (int64_t r = 0; r < n; ++r) std::memcpy(dst + r * width, src + r * stride, width * sizeof(float));
}

// Scratch of the calling thread (a stage's compute thread), grown on demand and kept.
float* scratch(std::vector<float>& v, int64_t size) {
  if (static_cast<int64_t>(v.size()) < size) v.resize(size);
  return v.data();
}

}  // namespace

extern "C" {

// h: [n, hidden], the residual stream, updated in place to the stage's output (its last layer's
// MLP output added). kv: [layers, 2, slots, kv_heads, head_dim] (`slots` = blocks * block_size).
// cos, sin: [n, head_dim] (sin signed, see model.py); slots: [n]; tables: [n, max_blocks]; lens: [n].
void decode_layers_f32(const Layer* layers, int64_t num_layers, const Dims* dims, float* h, float* kv,
                       int64_t cache_slots, const float* cos, const float* sin, const int64_t* slots,
                       const int64_t* tables, const int64_t* lens, int64_t n, int64_t max_blocks,
                       int64_t block_size) {
  const Dims& d = *dims;
  const int64_t q_out = d.heads * d.head_dim, kv_out = d.kv_heads * d.head_dim;
  const int64_t cache_elems = cache_slots * kv_out;  // one layer's keys (or values)
  thread_local std::vector<float> normed_v, qkv_v, q_v, attn_v, proj_v, gate_up_v, act_v, pending_v;
  thread_local std::vector<float> raw_q_v, raw_k_v, k_normed_v;  // with q/k norms only
  float* normed = scratch(normed_v, n * d.hidden);
  float* pending = scratch(pending_v, n * d.hidden);  // the previous layer's MLP output
  float* proj = scratch(proj_v, n * d.hidden);        // the attention's output projection
  for (int64_t i = 0; i < num_layers; ++i) {
    const Layer& l = layers[i];
    float* k_cache = kv + 2 * i * cache_elems;
    float* v_cache = k_cache + cache_elems;
    rms_norm_f32(h, i == 0 ? nullptr : pending, l.input_norm, normed, n, d.hidden, d.eps);
    const int64_t width = l.qkv.out_features;
    float* qkv = scratch(qkv_v, n * width);
    gemm(l.qkv, normed, qkv, n);
    float* q = scratch(q_v, n * q_out);  // the queries' rows, contiguous, as the attention takes them
    float *q_rope = qkv, *k_rope = qkv + q_out;
    int64_t q_stride = width, k_stride = width;
    if (l.q_norm != nullptr) {  // as Attention.forward: each head's norm, from contiguous copies
      float* raw_q = scratch(raw_q_v, n * q_out);
      float* raw_k = scratch(raw_k_v, n * kv_out);
      rows(qkv, width, raw_q, q_out, n);
      rows(qkv + q_out, width, raw_k, kv_out, n);
      k_rope = scratch(k_normed_v, n * kv_out);
      rms_norm_f32(raw_q, nullptr, l.q_norm, q, n * d.heads, d.head_dim, d.eps);
      rms_norm_f32(raw_k, nullptr, l.k_norm, k_rope, n * d.kv_heads, d.head_dim, d.eps);
      q_rope = q, q_stride = q_out, k_stride = kv_out;
    }
    rope_write_kv_f32(q_rope, q_stride, k_rope, k_stride, qkv + q_out + kv_out, width, cos, sin, slots, k_cache,
                      v_cache, n, d.heads, d.kv_heads, d.head_dim);
    if (l.q_norm == nullptr) rows(qkv, width, q, q_out, n);  // the rotated queries
    float* attn = scratch(attn_v, n * q_out);
    decode_attention_f32(q, k_cache, v_cache, tables, lens, attn, n, d.heads, d.kv_heads, d.head_dim, block_size,
                         max_blocks, d.scale, l.window);
    gemm(l.out, attn, proj, n);
    rms_norm_f32(h, proj, l.post_norm, normed, n, d.hidden, d.eps);
    const int64_t inter = l.gate_up.out_features / 2;
    float* gate_up = scratch(gate_up_v, n * 2 * inter);
    gemm(l.gate_up, normed, gate_up, n);
    float* act = scratch(act_v, n * inter);
    silu_mul_f32(gate_up, act, n, inter);
    gemm(l.down, act, pending, n);
  }
  if (num_layers > 0)
    for (int64_t j = 0; j < n * d.hidden; ++j) h[j] += pending[j];
}

}  // extern "C"
