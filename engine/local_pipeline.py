"""Every stage in one process, run one after another.

The single-process reference that the multi-process pipeline must agree with, and the engine
behind `ppserve generate` until stages run as processes. Batching is simple continuous batching:
every unfinished request is in every step, prefilling in chunks of at most `chunk_size` tokens
and then decoding one token per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.sampler import Sample, Sampler
from engine.stage_runner import StageRunner
from scheduler.block_allocator import BlockAllocator
from scheduler.request import FinishReason, Request
from scheduler.sampling_params import SamplingParams
from transport.messages import SeqChunk


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    finish_reason: FinishReason
    samples: list[Sample]  # per generated token, with logprobs when asked for


class LocalPipeline:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runners = [StageRunner(config, i) for i in range(config.pp_size)]
        self.sampler = Sampler(config.model_config.vocab_size, torch.device(config.device))
        self.allocator = BlockAllocator(config.num_kv_blocks, config.block_size)

    def forward(self, chunks: Sequence[SeqChunk], all_logits: bool = False) -> torch.Tensor:
        """One micro-batch through every stage in turn; returns the last stage's logits."""
        out: torch.Tensor | None = None
        for runner in self.runners:
            out = runner.execute(chunks, out, all_logits=all_logits)
        assert out is not None
        return out

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        chunk_size: int = 512,
    ) -> list[Generation]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        mc = self.config.model_config
        requests = [
            Request(str(i), list(p), sp, mc.eos_token_ids, self.config.max_model_len)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        samples: dict[str, list[Sample]] = {r.request_id: [] for r in requests}
        for r in requests:
            self.sampler.add_request(r.request_id, r.params)
        try:
            running = list(requests)
            while running:
                chunks = [self._next_chunk(r, chunk_size) for r in running]
                logits = self.forward(chunks)
                sampled = [r for r, c in zip(running, chunks, strict=True) if c.sample]
                for r, c in zip(running, chunks, strict=True):
                    r.num_computed_tokens += c.num_new
                for r, s in zip(sampled, self.sampler.sample([r.request_id for r in sampled], logits), strict=True):
                    samples[r.request_id].append(s)
                    r.append_token(s.token_id)
                for r in [r for r in running if r.finished]:
                    self._release(r)
                running = [r for r in running if not r.finished]
        finally:
            for r in requests:
                self._release(r)
        return [
            Generation(r.output_token_ids, r.finish_reason or FinishReason.ABORT, samples[r.request_id])
            for r in requests
        ]

    def _next_chunk(self, r: Request, chunk_size: int) -> SeqChunk:
        """The tokens `r` has not computed yet, at most chunk_size; sample once the prompt is done."""
        tokens = r.all_token_ids[r.num_computed_tokens : r.num_computed_tokens + chunk_size]
        end = r.num_computed_tokens + len(tokens)
        self.allocator.grow(r.block_table, end)
        return SeqChunk(r.request_id, tokens, r.num_computed_tokens, list(r.block_table), end == r.num_tokens)

    def _release(self, r: Request) -> None:
        self.allocator.free(r.block_table)
        r.block_table.clear()
        self.sampler.remove_request(r.request_id)
