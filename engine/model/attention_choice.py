"""Which attention backend a stage runs (engine/model/attention_backend.py), chosen once, when
its model is fused: the CPU kernels where the library is built for the device and dtype (and, for
prefill, the head_dim), else torch's SDPA."""

from __future__ import annotations

import logging

import torch

from ppserve.engine.model import cpu_kernels
from ppserve.engine.model.attention_backend import AttentionBackend
from ppserve.engine.model.attention_cpu import CpuAttention, CpuDecodeAttention
from ppserve.engine.model.attention_sdpa import SdpaAttention

log = logging.getLogger("ppserve.engine")


def choose_attention(device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionBackend:
    backend: AttentionBackend
    if cpu_kernels.prefill_available(device, dtype, head_dim):
        backend = CpuAttention()
    elif cpu_kernels.available(device, dtype):
        backend = CpuDecodeAttention()
    else:
        backend = SdpaAttention()
    log.info("attention backend: %s (%s, %s, head_dim %d)", backend.name, device.type, dtype, head_dim)
    return backend
