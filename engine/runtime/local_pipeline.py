"""Every stage in one process, run one after another.

The single-process reference that the multi-process pipeline must agree with (tests and
benchmarks use it). Batching is simple continuous batching: every unfinished request is in
every step, prefilling in chunks of at most `chunk_size` tokens and then decoding one token per
step; there is no preemption (running out of KV blocks raises OutOfBlocks).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ppserve.engine.config import EngineConfig
from ppserve.engine.model.sampler import Sample, Sampler
from ppserve.engine.runtime.prompt_logprobs import last_stage_outputs, prompt_rows
from ppserve.engine.runtime.stage_runner import StageRunner
from ppserve.scheduler.block_allocator import BlockAllocator
from ppserve.scheduler.request import FinishReason, Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.transport.messages import SeqChunk, StepPlan, StepResult


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
        self._ids = itertools.count()

    def forward(
        self, chunks: Sequence[SeqChunk], all_logits: bool = False, prompt_rows: Sequence[int] = ()
    ) -> torch.Tensor:
        """One micro-batch through every stage in turn; returns the last stage's logits."""
        out: torch.Tensor | None = None
        for runner in self.runners:
            out = runner.execute(chunks, out, all_logits=all_logits, prompt_rows=prompt_rows)
        assert out is not None
        return out

    def run(self, plan: StepPlan) -> StepResult:
        """A scheduler's plan, run as the stage processes run it (without timings): for tests
        that drive the real scheduler in one process."""
        logits = self.forward(plan.chunks, prompt_rows=prompt_rows(plan))
        samples, prompt_logprobs = last_stage_outputs(self.sampler, plan, logits)
        return StepResult(plan.mb_id, samples, [], prompt_logprobs)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        chunk_size: int = 512,
    ) -> list[Generation]:
        requests = self.add_requests(prompts, params)
        samples: dict[str, list[Sample]] = {r.request_id: [] for r in requests}
        try:
            while any(not r.finished for r in requests):
                for r, s in self.step(requests, chunk_size):
                    samples[r.request_id].append(s)
        finally:
            for r in requests:
                self.release(r)
        return [
            Generation(r.output_token_ids, r.finish_reason or FinishReason.ABORT, samples[r.request_id])
            for r in requests
        ]

    def add_requests(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Request]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        eos, max_len = self.config.model_config.eos_token_ids, self.config.max_model_len
        requests = [
            Request(str(next(self._ids)), list(p), sp, eos, max_len) for p, sp in zip(prompts, params, strict=True)
        ]
        for r in requests:
            self.sampler.add_request(r.request_id, r.params, prompt_token_ids=r.prompt_token_ids)
        return requests

    def step(self, requests: Sequence[Request], chunk_size: int) -> list[tuple[Request, Sample]]:
        """One micro-batch with every unfinished request: a prefill chunk of at most `chunk_size`
        tokens, or one decode token. Returns what was sampled; finished requests are released."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        running = [r for r in requests if not r.finished]
        chunks = [self._next_chunk(r, chunk_size) for r in running]
        logits = self.forward(chunks)
        for r, c in zip(running, chunks, strict=True):
            r.num_computed_tokens += c.num_new
        sampled = [r for r, c in zip(running, chunks, strict=True) if c.sample]
        out = list(zip(sampled, self.sampler.sample([r.request_id for r in sampled], logits), strict=True))
        for r, s in out:
            if r.append_token(s.token_id):
                self.release(r)
        return out

    def _next_chunk(self, r: Request, chunk_size: int) -> SeqChunk:
        """The tokens `r` has not computed yet, at most chunk_size; sample once the prompt is done."""
        tokens = r.token_slice(r.num_computed_tokens, r.num_computed_tokens + chunk_size)
        end = r.num_computed_tokens + len(tokens)
        self.allocator.grow(r.block_table, end)
        return SeqChunk(r.request_id, tokens, r.num_computed_tokens, list(r.block_table), end == r.num_tokens)

    def release(self, r: Request) -> None:
        """Give back the request's KV blocks and sampler state (idempotent)."""
        self.allocator.free(r.block_table)
        r.block_table.clear()
        self.sampler.remove_request(r.request_id)
