"""OfflineEngine: generate for a batch of prompts, every stage in this process.

The same `EngineCore` loop and scheduler as `AsyncEngine`, with the stages run in turn by an
`InProcessExecutor` instead of stage processes: the single-process reference that the pipeline
must agree with (tests, benchmarks, batch jobs).

    engine = OfflineEngine(EngineConfig.create(model_dir, pp_size=2))
    [g.token_ids for g in engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))]
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

from ppserve.engine.config import EngineConfig
from ppserve.engine.model.tokenizer import Tokenizer
from ppserve.engine.runtime.core import EngineCore, Outputs
from ppserve.engine.runtime.executors import InProcessExecutor
from ppserve.engine.runtime.timeline import Timeline
from ppserve.scheduler.block_allocator import BlockAllocator
from ppserve.scheduler.request import FinishReason, Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.scheduler.scheduler import Scheduler
from ppserve.transport.messages import Sampled, StepResult


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    finish_reason: FinishReason
    samples: list[Sampled]  # per generated token, with logprobs when asked for
    text: str | None = None  # the tokens' text, for a prompt given as text


Prompt = str | Sequence[int]  # text (tokenized with the model's tokenizer) or token ids


class OfflineEngine:
    def __init__(self, config: EngineConfig, executor: InProcessExecutor | None = None) -> None:
        self.config = config
        self.executor = executor or InProcessExecutor(config)
        self.scheduler = Scheduler(config.scheduler_config())
        self.core = EngineCore(self.scheduler, self.executor, self, Timeline(config.pp_size))
        self._samples: dict[str, list[Sampled]] = {}  # per request being served
        self._serving: list[Request] = []
        self._done: asyncio.Event | None = None  # set once every request being served has finished
        self._ids = itertools.count()

    @property
    def allocator(self) -> BlockAllocator:
        return self.scheduler.allocator

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, loaded when a prompt first comes as text."""
        return Tokenizer(self.config.model)

    def request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Request:
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt)
        elif any(not isinstance(t, int) or isinstance(t, bool) for t in prompt):
            raise TypeError(f"a prompt is text or a list of token ids, not {type(prompt).__name__} of {prompt[:3]!r}")
        mc = self.config.model_config
        if params.grammar:
            self.executor.sampler.grammars.check(params.grammar)  # ValueError: llguidance's reason
        return Request(
            request_id or str(next(self._ids)), list(prompt), params, mc.eos_token_ids, self.config.max_model_len
        )

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Generation]:
        """Every prompt to the end (synchronous). `prompts`: one prompt (text, or a list of token
        ids), or a list of them; a generation per prompt, in order."""
        one = isinstance(prompts, str) or (bool(prompts) and all(isinstance(t, int) for t in prompts))
        prompts = [cast(Prompt, prompts)] if one else cast(Sequence[Prompt], prompts)
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        requests = [self.request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        samples = self.run(requests)
        return [
            Generation(
                r.output_token_ids,
                r.finish_reason or FinishReason.ABORT,
                samples[r.request_id],
                self.tokenizer.decode(r.output_token_ids) if isinstance(p, str) else None,
            )
            for p, r in zip(prompts, requests, strict=True)
        ]

    def run(self, requests: Sequence[Request]) -> dict[str, list[Sampled]]:
        """`serve`, from synchronous code. Called where an event loop runs (a test, a notebook),
        it runs on a loop of its own in another thread, and blocks the caller's until done."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.serve(requests))
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="offline") as thread:
            return thread.submit(asyncio.run, self.serve(requests)).result()

    async def serve(self, requests: Sequence[Request]) -> dict[str, list[Sampled]]:
        """Run the core until every request has finished; an error in the loop is raised here.
        Requests the scheduler does not know yet are added (a decode side's reserved ones are
        known already). Returns what each request sampled, by request id."""
        for r in requests:
            self._samples[r.request_id] = []
            if r.request_id not in self.scheduler.requests:
                self.scheduler.add(r)
        self._done, self._serving = asyncio.Event(), list(requests)
        loop = asyncio.create_task(self.core.run())
        done = asyncio.create_task(self._done.wait())
        try:
            self._check_done()
            await asyncio.wait({loop, done}, return_when=asyncio.FIRST_COMPLETED)
            if loop.done():
                loop.result()  # the loop's error
        finally:
            for task in (loop, done):
                task.cancel()
            await asyncio.gather(loop, done, return_exceptions=True)
            # The loop failed or was cancelled: void what is in flight (perhaps only a step
            # planned ahead of a request that has ended), or the next batch would wait for it.
            if self.scheduler.inflight or not all(r.finished for r in requests):
                self.core.reset_pipeline()
                self.executor.reset()
                for r in requests:
                    self.scheduler.abort(r.request_id)
            samples = {r.request_id: self._samples.pop(r.request_id, []) for r in requests}
        return samples

    def emit(self, outputs: Outputs, result: StepResult) -> None:
        for request, sample in outputs:
            if sample is not None and (samples := self._samples.get(request.request_id)) is not None:
                samples.append(sample)
        self._check_done()

    def _check_done(self) -> None:
        # Done once the pipeline is idle too: a step planned ahead may still be in flight for a
        # request that has ended, and its result must not be lost with this loop.
        if self._done is not None and not self.scheduler.inflight and all(r.finished for r in self._serving):
            self._done.set()

    def close(self) -> None:
        self.executor.close()
