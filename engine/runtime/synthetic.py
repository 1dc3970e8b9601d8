"""Synthetic stages: the real processes, control plane, tensor channels and scheduler, but each
stage waits the time a latency model gives instead of doing tensor math.

This lets a two-core machine study pipelines of 4 or 8 stages honestly: the stages sleep, so
they do not compete for the cores, and everything around the compute is the real thing. Results
from synthetic stages are labelled synthetic wherever they are shown.

Latency of one micro-batch on one stage, for the whole model's (a, b, c):

    share * sum over chunks (a * ((L + x)^2 - L^2) + b * x)  +  c

where a chunk has x new tokens after a prefix of L, `share` is the stage's fraction of the
model's layers (attention and MLP work split with the layers), and c is a per-forward overhead
that every stage pays in full.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ppserve.engine.config import EngineConfig
from ppserve.transport.messages import SeqChunk, StageKernels, StepPlan


def synthetic_seconds(latency: tuple[float, float, float], chunks: Sequence[SeqChunk], share: float) -> float:
    a, b, c = latency
    work = sum(a * ((ch.start + ch.num_new) ** 2 - ch.start**2) + b * ch.num_new for ch in chunks)
    return share * work + c


class SyntheticRunner:
    """Drop-in for StageRunner: no weights and no KV cache; `execute` sleeps the modelled time.
    The last stage's logits always favour one token (the vocabulary's last), so greedy output is
    that token repeated."""

    def __init__(self, config: EngineConfig, stage: int) -> None:
        assert config.synthetic_latency is not None
        self.latency = config.synthetic_latency
        self.config = config
        self.stage = stage
        self.share = len(config.layer_ranges[stage]) / config.model_config.num_layers
        self.last = stage == config.pp_size - 1
        self.token = config.model_config.vocab_size - 1
        self.kernels = StageKernels()  # it runs none
        self.tokens_computed = 0
        self.pooled = torch.empty(0)

    def expert_tokens(self) -> dict[int, list[int]]:
        return {}  # no experts

    def execute_plan(
        self, plan: StepPlan, hidden: torch.Tensor | None = None, prompt_rows: Sequence[int] = ()
    ) -> torch.Tensor:
        out = self.execute(plan.chunks, hidden, prompt_rows=prompt_rows)  # no KV: no tables to keep
        if self.last:  # embeddings: a constant unit vector
            self.pooled = torch.zeros((len(plan.pooled), self.config.model_config.hidden_size))
            self.pooled[:, 0] = 1.0
        return out

    def clear_tables(self) -> None:
        pass

    def execute(
        self,
        chunks: Sequence[SeqChunk],
        hidden: torch.Tensor | None = None,
        all_logits: bool = False,
        prompt_rows: Sequence[int] = (),
    ) -> torch.Tensor:
        time.sleep(synthetic_seconds(self.latency, chunks, self.share))
        rows = sum(c.num_new for c in chunks)
        self.tokens_computed += rows
        if not self.last:
            # hidden: [num_tokens, hidden_size], contents irrelevant; it still crosses the channel.
            return torch.zeros((rows, self.config.model_config.hidden_size), dtype=self.config.torch_dtype)
        n = rows if all_logits else sum(1 + c.drafts for c in chunks if c.sample) + len(prompt_rows)
        logits = torch.zeros((n, self.config.model_config.vocab_size), dtype=torch.float32)
        logits[:, self.token] = 10.0
        return logits
