"""Rotary position embeddings: the inverse frequencies of a model's RoPE (with its scaling) and
their application to queries and keys."""

from __future__ import annotations

import math

import torch

from ppserve.engine.model.model_config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with linear or llama3 scaling applied."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos, signed_sin: [num_tokens, 1, head_dim].

    transformers' x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1): the sign is
    folded into `signed_sin` (first half negated) once per step, so per layer the rotation is one
    flip of the two halves. Negation is exact, so the result is bit-identical.
    """
    n, heads, dim = x.shape
    swapped = x.view(n, heads, 2, dim // 2).flip(2).view(n, heads, dim)
    return x * cos + swapped * signed_sin
