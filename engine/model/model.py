"""The Llama family (Llama, Mistral, Qwen2, Qwen3) and Gemma 3 as one pipeline stage: a contiguous slice of layers.

Module names mirror the Hugging Face checkpoint names (`model.layers.7.self_attn.q_proj.weight`),
with layers keyed by their global index, so a stage's `state_dict()` keys are exactly the tensors
it must load. The math follows transformers' modeling files op for op (norms in float32, RoPE
tables in float32), which is what makes logits match them closely.

Once loaded, `StageModel.fuse()` replaces the checkpoint-named projections with fused, packed
`Linear`s (engine/model/linear.py): q/k/v as one GEMM, gate/up as one, and every weight packed for
oneDNN on the CPU. The forward pass runs on those.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ppserve.engine.model import cpu_kernels
from ppserve.engine.model.attention import AttentionMetadata
from ppserve.engine.model.attention_backend import AttentionBackend
from ppserve.engine.model.attention_choice import choose_attention
from ppserve.engine.model.attention_sdpa import SdpaAttention
from ppserve.engine.model.decode_step import DecodeStep
from ppserve.engine.model.gguf_quant import GGUFEmbedding, GGUFWeight
from ppserve.engine.model.kernel_choice import KernelChooser
from ppserve.engine.model.kv_cache import StageKvCache
from ppserve.engine.model.linear import AnyLinear, Linear, fuse_linears
from ppserve.engine.model.model_config import ModelConfig
from ppserve.engine.model.moe import MoE
from ppserve.engine.model.rope import rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fast = False  # the CPU kernel (engine/model/cpu_kernels.py); set by StageModel.fuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the model dtype (as transformers does).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_and_norm(self, h: torch.Tensor, add: torch.Tensor | None) -> torch.Tensor:
        """`h += add` in place (a residual connection), then the norm of h."""
        if self.fast:
            return cpu_kernels.rms_norm(h, add, self.weight, self.eps)
        if add is not None:
            h += add
        return self(h)

    def use_kernel(self, fast: bool) -> None:
        """After loading: whether the CPU kernel runs this norm (StageModel.fuse)."""
        self.fast = fast

    def kernel_weight(self) -> torch.Tensor:
        """The weight the CPU kernel's rms_norm multiplies by (engine/model/decode_step.py)."""
        return self.weight.detach().contiguous()


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the normalised value times (1 + weight), both in float32, then cast to the
    model dtype (transformers' Gemma3RMSNorm; Llama's casts first, then scales in the model dtype).
    `weight` is the checkpoint's w; the float32 scale 1 + w is made once, after loading."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.scale: torch.Tensor | None = None  # [dim] float32, 1 + weight; set by use_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        scale = self.scale if self.scale is not None else 1.0 + self.weight.float()
        return (xf * scale).to(x.dtype)

    def add_and_norm(self, h: torch.Tensor, add: torch.Tensor | None) -> torch.Tensor:
        if self.fast and self.scale is not None:
            return cpu_kernels.rms_norm(h, add, self.scale, self.eps)
        if add is not None:
            h += add
        return self(h)

    def use_kernel(self, fast: bool) -> None:
        self.scale = 1.0 + self.weight.detach().float()
        # The kernel rounds the normalised value to the model dtype before it scales (Llama's
        # order): the same as Gemma's only where that rounding is none, in float32.
        self.fast = fast and self.weight.dtype == torch.float32

    def kernel_weight(self) -> torch.Tensor:
        assert self.scale is not None, "made by use_kernel"
        return self.scale


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = window
        # Gemma 3 scales by query_pre_attn_scalar ** -0.5, which need not be head_dim's.
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        # Which RoPE table this layer takes: Gemma 3's sliding layers have their own base.
        self.rope = "local" if window is not None and cfg.rope_local is not None else "global"
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=cfg.o_proj_bias)
        norm = GemmaRMSNorm if cfg.gemma_norms else RMSNorm
        self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.qkv_sizes = [q_out, kv_out, kv_out]
        self.qkv: AnyLinear  # set by fuse()
        self.out: AnyLinear
        # How it attends (engine/model/attention_backend.py): chosen once, by StageModel.fuse.
        self.backend: AttentionBackend = SdpaAttention()

    def fuse(self, dtype: torch.dtype, device: torch.device, int8: bool, chooser: KernelChooser | None) -> None:
        self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj], dtype, device, int8, chooser=chooser)
        self.out = fuse_linears([self.o_proj], dtype, device, int8, chooser=chooser)
        del self.q_proj, self.k_proj, self.v_proj, self.o_proj

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        # x: [num_tokens, hidden]; kv: [2, num_blocks, block_size, kv_heads, head_dim]
        n = x.shape[0]
        q, k, v = self.qkv(x).split(self.qkv_sizes, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # per head, by the CPU kernel where fast
            # One head's rows of the fused qkv output are a strided view, which the kernel cannot take.
            q = self.q_norm.add_and_norm(q.reshape(-1, self.head_dim).contiguous(), None)
            k = self.k_norm.add_and_norm(k.reshape(-1, self.head_dim).contiguous(), None)
            q, k = q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim)
        q, k = self.backend.rope_and_write(q, k, v, cos, sin, kv, md)
        out = self.backend.forward(q, kv[0], kv[1], md, self.scale, self.window, k, v)
        return self.out(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        """`intermediate_size`: where it is not the config's (a mixture's experts)."""
        super().__init__()
        inner = intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, inner, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, inner, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(inner, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up: AnyLinear  # set by fuse()
        self.down: AnyLinear
        self.fast = False  # SiLU(gate) * up by the CPU kernel; set by StageModel.fuse
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # Gemma's GELU (tanh approximation), else SiLU

    def fuse(self, dtype: torch.dtype, device: torch.device, int8: bool, chooser: KernelChooser | None) -> None:
        # `gated` lets the GEMM apply SiLU on its output: never for GELU.
        self.gate_up = fuse_linears([self.gate_proj, self.up_proj], dtype, device, int8, not self.gelu, chooser)
        self.down = fuse_linears([self.down_proj], dtype, device, int8, chooser=chooser)
        del self.gate_proj, self.up_proj, self.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.gate_up, Linear) and self.gate_up.silu:  # its GEMM applied the SiLU
            return self.down(self.gate_up(x))
        gate_up = self.gate_up(x)
        if self.fast:
            return self.down(cpu_kernels.silu_mul(gate_up, gelu=self.gelu))
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down(F.gelu(gate, approximate="tanh") * up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, cfg.sliding_windows[layer_idx])
        moe = cfg.moe
        if moe is not None and moe.sparse_layers[layer_idx]:  # experts (engine/model/moe.py)
            self.mlp: MLP | MoE = MoE(cfg.hidden_size, moe, lambda: MLP(cfg, moe.intermediate_size))
        else:
            self.mlp = MLP(cfg)
        norm = GemmaRMSNorm if cfg.gemma_norms else RMSNorm
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        pending: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """h: the residual stream, updated in place: `pending` (the previous layer's MLP output,
        None for the stage's first layer) and this layer's attention output are added to it, each
        in one pass with the norm that follows. Returns this layer's MLP output, which the next
        layer adds (or the stage, after its last layer)."""
        attn = self.self_attn(self.input_layernorm.add_and_norm(h, pending), cos, sin, kv, md)
        return self.mlp(self.post_attention_layernorm.add_and_norm(h, attn))

    def norms(self) -> list[RMSNorm | None]:
        """The layer's norms in decode_step.cpp's order: input, post-attention, q, k, and Gemma's
        pre- and post-MLP ones (None where the layer has none)."""
        attn = self.self_attn
        return [self.input_layernorm, self.post_attention_layernorm, attn.q_norm, attn.k_norm, None, None]


class GemmaDecoderLayer(DecoderLayer):
    """Gemma 3's layer: attention's and the MLP's outputs are normed too, before their residual add
    (post_attention_layernorm here is after attention; pre_feedforward_layernorm is before the MLP)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        pending: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """As DecoderLayer.forward: returns the normed MLP output, which the next layer adds."""
        attn = self.self_attn(self.input_layernorm.add_and_norm(h, pending), cos, sin, kv, md)
        attn = self.post_attention_layernorm.add_and_norm(attn, None)
        mlp = self.mlp(self.pre_feedforward_layernorm.add_and_norm(h, attn))
        return self.post_feedforward_layernorm.add_and_norm(mlp, None)

    def norms(self) -> list[RMSNorm | None]:
        return [*super().norms()[:4], self.pre_feedforward_layernorm, self.post_feedforward_layernorm]


class Backbone(nn.Module):
    """`model.*` in the checkpoint: the embedding (first stage), this stage's layers, the final norm (last)."""

    def __init__(self, cfg: ModelConfig, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        # nn.Embedding, or a GGUFEmbedding once fused where the checkpoint's table stays quantized
        self.embed_tokens: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if first else None
        layer = GemmaDecoderLayer if cfg.gemma_norms else DecoderLayer
        self.layers = nn.ModuleDict({str(i): layer(cfg, i) for i in layers})
        norm = GemmaRMSNorm if cfg.gemma_norms else RMSNorm
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps) if last else None


class StageModel(nn.Module):
    """Layers `layers` of the model; the first stage embeds, the last computes logits."""

    def __init__(self, cfg: ModelConfig, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_range = layers
        self.first, self.last = first, last
        self.model = Backbone(cfg, layers, first, last)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if last else None
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)
        self.inv_freq_local: torch.Tensor | None = None  # Gemma 3's sliding layers' RoPE; set by fuse()
        # Per layer in order: the RoPE table it takes ("global" or "local", see Attention).
        self.layer_ropes = [m.rope for m in self.model.layers.modules() if isinstance(m, Attention)]
        self.windows = {cfg.sliding_windows[i] for i in layers}
        self.head: AnyLinear | None = None  # lm_head, set by fuse()
        self.decode_step: DecodeStep | None = None  # the layers in one call, for decode steps; set by fuse()

    def fuse(
        self, dtype: torch.dtype, device: torch.device, int8: bool = False, chooser: KernelChooser | None = None
    ) -> None:
        """After loading: fused, packed projections for the forward pass (see engine/model/linear.py);
        quantized ones where the checkpoint's weights are, or everywhere with `int8`
        (engine/model/quantized.py); float ones with the kernels `chooser` times, if given
        (engine/model/kernel_choice.py)."""
        fast = cpu_kernels.available(device, dtype)
        attention = choose_attention(device, dtype, self.cfg.head_dim)  # one for every layer
        embed = self.model.embed_tokens
        if embed is not None and isinstance(table := getattr(embed, "quant", None), GGUFWeight):
            self.model.embed_tokens = GGUFEmbedding(table, dtype)  # loaded as its GGUF blocks
        layers: list[DecoderLayer] = []
        for layer in self.model.layers.values():
            assert isinstance(layer, DecoderLayer)
            layers.append(layer)
            layer.self_attn.fuse(dtype, device, int8, chooser)
            layer.mlp.fuse(dtype, device, int8, chooser)
            # One answer for every module that has a CPU kernel (engine/model/cpu_kernels.py).
            for module in layer.modules():
                if isinstance(module, (MLP, MoE)):
                    module.fast = fast
                if isinstance(module, Attention):
                    module.backend = attention
            for norm in layer.modules():
                if isinstance(norm, RMSNorm):
                    norm.use_kernel(fast)
        if self.lm_head is not None:
            self.head = fuse_linears([self.lm_head], dtype, device, int8, chooser=chooser)
            self.lm_head = None
        if self.model.norm is not None:
            self.model.norm.use_kernel(fast)
        if self.cfg.rope_local is not None:  # the stage runner sets the global table, built on the meta device
            self.inv_freq_local = rope_inv_freq(self.cfg.rope_local, self.cfg.head_dim).to(device)
        self.decode_step = DecodeStep.build(layers)

    def forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: StageKvCache,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """inputs: token ids [num_tokens] on the first stage, else hidden [num_tokens, hidden].
        kv_cache: the stage's, by group; each layer reads its group's tensor and metadata (md.window
        for sliding-window layers: engine/model/kv_cache.py).
        Returns hidden [num_tokens, hidden] (before the final norm on the last stage)."""
        # The residual stream, which the layers update in place: never the caller's tensor.
        h = self.model.embed_tokens(inputs) if self.model.embed_tokens is not None else inputs.clone()
        if self.model.embed_tokens is not None and self.cfg.gemma_norms:
            # Gemma scales the embedding by sqrt(hidden), rounded to the dtype first (as transformers does).
            h = h * torch.tensor(self.cfg.hidden_size**0.5).to(h.dtype)
        # One RoPE table per kind this stage's layers use (Gemma 3's sliding layers: their own base).
        rope = {kind: self._rope_table(kind, positions, h.dtype) for kind in set(self.layer_ropes)}
        if self.decode_step is not None and self.decode_step.applies(md, h.shape[0]):
            self.decode_step(h, rope, kv_cache, md)  # the same kernels as the loop below, from C++
            return h
        pending = None
        for local, layer in enumerate(self.model.layers.values()):
            cos, sin = rope[self.layer_ropes[local]]
            pending = layer(h, pending, cos, sin, *kv_cache.layer(local, md))
        if pending is not None:
            h += pending
        return h

    def _rope_table(self, kind: str, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ([num_tokens, 1, head_dim]) of the `kind` ("global" or "local") RoPE,
        in float32, then cast (as transformers does)."""
        inv_freq = self.inv_freq_local if kind == "local" else self.inv_freq
        assert inv_freq is not None, "the local RoPE table is made by fuse()"
        freqs = positions[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        sin[..., : sin.shape[-1] // 2].neg_()  # signed for apply_rope
        return cos, sin

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] rows to sample from -> float32 logits [n, vocab]."""
        assert self.head is not None and self.model.norm is not None, "logits only on the last stage"
        return self.head(self.model.norm.add_and_norm(hidden.contiguous(), None)).float()

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] last rows of embedding prompts -> float32 [n, hidden]: after the
        final norm (transformers' last_hidden_state), L2-normalized."""
        assert self.model.norm is not None, "pooling only on the last stage"
        normed = self.model.norm.add_and_norm(hidden.contiguous(), None).float()
        return torch.nn.functional.normalize(normed, dim=-1)
