"""Prompt logprobs (SamplingParams.prompt_logprobs) equal transformers' log-softmax: computed on
the last stage chunk by chunk, never from a cached prefix, once per token across preemptions and
pipeline resets; through the scheduler and stages in one process, and through AsyncEngine."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from helpers import hf_log_softmax, pipeline, random_prompt
from stepper import Stepper

from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.config import EngineConfig
from ppserve.engine.offline import OfflineEngine
from ppserve.engine.outputs import TokenLogprob
from ppserve.scheduler.request import Request, TokenScore
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.scheduler.scheduler import PROMPT_SCORE_CHUNK, Scheduler, SchedulerConfig
from ppserve.transport.messages import PromptLogprobs, Sampled, StepResult

BLOCK = 8
CHUNK = 16  # prompts of 40+ tokens span several chunks
TOL = 1e-4
TOP = 3
SCORED = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
PLAIN = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def check(scores: Sequence[TokenScore], prompt: Sequence[int], ref: torch.Tensor, top_n: int = TOP) -> None:
    """scores[i] is prompt token i + 1's (logprob, top N); both within TOL of the reference."""
    assert len(scores) == len(prompt) - 1
    for i, (logprob, top) in enumerate(scores):
        row = ref[i]  # the logits at position i predict token i + 1
        assert abs(logprob - row[prompt[i + 1]].item()) <= TOL, i
        assert len(top) == top_n
        assert [v for _, v in top] == pytest.approx(row.topk(top_n).values.tolist(), abs=TOL)
        assert all(abs(row[t].item() - v) <= TOL for t, v in top)


def as_scores(logprobs: list[TokenLogprob | None]) -> list[TokenScore]:
    assert logprobs[0] is None and all(lp is not None for lp in logprobs[1:])
    return [(lp.logprob, list(lp.top_logprobs)) for lp in logprobs[1:] if lp is not None]


def scheduler(pipe: OfflineEngine, num_blocks: int, caching: bool = True) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=BLOCK,
            pp_size=pipe.config.pp_size,
            async_depth=0,
            max_batched_tokens=64,
            chunked_prefill_size=CHUNK,
            enable_prefix_caching=caching,
        )
    )


def serve(pipe: OfflineEngine, s: Scheduler, requests: Sequence[Request], reset_at: int | None = None) -> int:
    """Run requests to the end as the pipeline does: up to pp_size plans in flight, each run by
    every stage in order. At step `reset_at` the pipeline loses its state, as when a stage is
    replaced (the plans in flight are void, the last stage forgets its requests). Returns how
    many requests the reset preempted."""
    for r in requests:
        s.add(r)
    reset = 0

    def script(steps: Stepper) -> bool:
        nonlocal reset
        if steps.step == reset_at:
            reset = steps.reset()
        return reset_at is not None and steps.step < reset_at

    Stepper(pipe, s).run(script)
    assert all(r.finished for r in requests)
    return reset


def request(name: str, prompt: list[int], params: SamplingParams, pipe: OfflineEngine) -> Request:
    return Request(name, prompt, params, pipe.config.model_config.eos_token_ids, pipe.config.max_model_len)


@pytest.mark.parametrize("pp", [1, 3])
def test_prompt_logprobs_match_transformers_with_a_cached_prefix(llama_dir: Path, pp: int) -> None:
    pipe = pipeline(llama_dir, pp_size=pp, block_size=BLOCK, num_kv_blocks=64)
    vocab = pipe.config.model_config.vocab_size
    rng = random.Random(3)
    system = random_prompt(rng, 45, vocab)
    first, second = system + random_prompt(rng, 7, vocab), system + random_prompt(rng, 12, vocab)
    s = scheduler(pipe, 64)
    serve(pipe, s, [request("plain", first, PLAIN, pipe)])  # fills the cache with the shared prefix
    scored = request("scored", second, SCORED, pipe)
    again = request("again", second, PLAIN, pipe)
    serve(pipe, s, [scored, again])
    assert scored.num_cached_tokens == 0  # 5 blocks of the prefix were there: not taken
    assert again.num_cached_tokens and again.num_cached_tokens >= 40  # blocks stay shared for others
    check(scored.prompt_scores, second, hf_log_softmax(llama_dir, second))
    assert scored.output_token_ids == again.output_token_ids  # generation is unchanged
    assert s.allocator.num_free == 64


@pytest.mark.parametrize("pp", [1, 3])
def test_each_prompt_token_is_scored_once_across_preemptions_and_resets(llama_dir: Path, pp: int) -> None:
    """Too few KV blocks for three long prompts at once, so requests are preempted and computed
    again, and once the whole pipeline is reset mid-prompt: every prompt is scored exactly once
    per token, as alone."""
    pipe = pipeline(llama_dir, pp_size=pp, block_size=BLOCK, num_kv_blocks=64)
    vocab = pipe.config.model_config.vocab_size
    rng = random.Random(9)
    prompts = [random_prompt(rng, n, vocab) for n in (50, 61, 44)]
    params = [SCORED, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=0), SCORED]
    s = scheduler(pipe, 12)
    reqs = [request(f"r{i}", p, sp, pipe) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    reset = serve(pipe, s, reqs, reset_at=5)
    assert reset > 0 and s.num_preemptions > reset, "no preemption besides the reset"
    for r, sp in zip(reqs, params, strict=True):
        check(
            r.prompt_scores, r.prompt_token_ids, hf_log_softmax(llama_dir, r.prompt_token_ids), sp.prompt_logprobs or 0
        )


def test_a_one_token_prompt_has_nothing_to_score(llama_dir: Path) -> None:
    pipe = pipeline(llama_dir, block_size=BLOCK, num_kv_blocks=16)
    r = request("one", [42], SCORED, pipe)
    serve(pipe, scheduler(pipe, 16), [r])
    assert r.prompt_scores == [] and len(r.output_token_ids) == SCORED.max_tokens


def test_the_scheduler_gives_a_scored_request_no_cached_blocks() -> None:
    """Pure scheduling, with made-up results: a prompt wholly in the cache is computed again,
    from position 0, when its request asks for prompt logprobs; each of its tokens but the first
    is a target exactly once; the blocks it fills are found by later requests."""
    s = Scheduler(
        SchedulerConfig(
            num_blocks=32, block_size=4, pp_size=2, async_depth=0, chunked_prefill_size=8, enable_prefix_caching=True
        )
    )
    prompt = list(range(10, 40))
    targets: dict[str, list[int]] = {}
    starts: dict[str, list[int]] = {}

    def run(*reqs: Request) -> None:
        for r in reqs:
            s.add(r)
        while s.has_work:
            plan = s.schedule()
            assert plan is not None
            for c in plan.chunks:
                starts.setdefault(c.request_id, []).append(c.start)
            scores = []
            for t in plan.prompt_targets:
                c = plan.chunks[t.chunk]
                targets.setdefault(c.request_id, []).extend(t.token_ids)
                n = len(t.token_ids)
                scores.append(PromptLogprobs(c.request_id, c.start + t.first + 1, [-1.0] * n, [[] for _ in range(n)]))
            s.update(StepResult(plan.mb_id, [Sampled(c.request_id, 7) for c in plan.chunks if c.sample], [], scores))

    run(Request("a", prompt, PLAIN))
    scored, plain = Request("b", prompt, SCORED), Request("c", prompt, PLAIN)
    run(scored, plain)
    assert scored.num_cached_tokens == 0 and starts["b"][:4] == [0, 8, 16, 24]
    assert targets == {"b": prompt[1:]} and len(scored.prompt_scores) == len(prompt) - 1
    assert plain.num_cached_tokens == 28  # the cache still serves everyone else
    assert s.flush_cache() > 0
    run(Request("e", prompt, SCORED))  # alone in a flushed cache: the blocks it fills are findable
    run(late := Request("f", prompt[:20] + [99] * 5, PLAIN))
    assert late.num_cached_tokens == 20


def test_scored_prompt_chunks_are_bounded() -> None:
    """A scored prompt goes in chunks of at most PROMPT_SCORE_CHUNK tokens (each row brings a
    [vocab] row of float32 logits to the last stage), whatever the chunked-prefill size; a plain
    prompt keeps the configured size."""
    s = Scheduler(SchedulerConfig(num_blocks=256, block_size=16, pp_size=1, async_depth=0, chunked_prefill_size=1024))
    s.add(Request("scored", list(range(700)), SCORED))
    s.add(Request("plain", list(range(1000, 1700)), PLAIN))  # its own prompt: no prefix to share
    plan = s.schedule()
    assert plan is not None
    assert [(c.request_id, c.num_new) for c in plan.chunks] == [("scored", PROMPT_SCORE_CHUNK), ("plain", 700)]


def test_only_scored_chunks_get_full_logits(llama_dir: Path) -> None:
    """A micro-batch with a scored and a plain prompt: the last stage returns one row per
    sampled chunk plus the scored chunk's rows, none of the plain prompt's."""
    pipe = pipeline(llama_dir, pp_size=2, block_size=BLOCK, num_kv_blocks=32)
    s = scheduler(pipe, 32)
    vocab = pipe.config.model_config.vocab_size
    rng = random.Random(1)
    s.add(request("scored", random_prompt(rng, 12, vocab), SCORED, pipe))
    s.add(request("plain", random_prompt(rng, 14, vocab), PLAIN, pipe))
    plan = s.schedule()
    assert plan is not None and [c.request_id for c in plan.chunks] == ["scored"]  # 2 stages: one each
    (target,) = plan.prompt_targets
    assert (target.chunk, target.first, len(target.token_ids)) == (0, 0, 11)
    plain = s.schedule()
    assert plain is not None and plain.prompt_targets == []
    rows: list[int] = []
    runner = pipe.executor.runners[-1]
    execute = runner.execute

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        out = execute(*args, **kwargs)  # type: ignore[arg-type]
        rows.append(out.shape[0])
        return out

    runner.execute = spy  # type: ignore[method-assign]
    s.update(pipe.executor.run(plan))
    s.update(pipe.executor.run(plain))
    assert rows == [1 + 11, 1]


def engine_config(model_dir: Path, pp: int) -> EngineConfig:
    return EngineConfig.create(
        model_dir,
        pp_size=pp,
        tensor_transport="shm",
        threads_per_stage=1,
        block_size=BLOCK,
        num_kv_blocks=128,
        chunked_prefill_size=CHUNK,
        enable_prefix_caching=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 3])
async def test_async_engine_returns_prompt_logprobs_with_a_cached_prefix(llama_dir: Path, pp: int) -> None:
    rng = random.Random(5)
    system = random_prompt(rng, 50)
    plain, scored = system + random_prompt(rng, 4), system + random_prompt(rng, 9)
    async with AsyncEngine(engine_config(llama_dir, pp)) as engine:
        async for out in engine.generate(plain, PLAIN):
            assert out.prompt_logprobs is None
        outputs = [out async for out in engine.generate(scored, SCORED)]
        tokens = [t for out in outputs for t in out.token_ids]
        again = [out async for out in engine.generate(scored, PLAIN)]
    first = outputs[0].prompt_logprobs
    assert first is not None and len(first) == len(scored)
    assert all(out.prompt_logprobs is None for out in outputs[1:])  # the first output carries them
    assert [lp.token_id for lp in first[1:] if lp] == scored[1:]
    check(as_scores(first), scored, hf_log_softmax(llama_dir, scored))
    assert outputs[-1].cached_tokens == 0 and again[-1].cached_tokens >= 48
    assert tokens == [t for out in again for t in out.token_ids]


async def test_disaggregated_engines_refuse_prompt_logprobs(llama_dir: Path) -> None:
    engine = AsyncEngine(EngineConfig.create(llama_dir, disaggregation="decode", disagg_insecure=True))
    with pytest.raises(ValueError, match=r"^prompt_logprobs .* disaggregation"):
        engine._request("r", [1, 2, 3], SCORED)
    engine._request("r", [1, 2, 3], PLAIN)


def test_the_range_is_checked() -> None:
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(ValueError, match=r"^prompt_logprobs must be an integer in \[0, 20\]"):
            SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
    assert SamplingParams(prompt_logprobs=20).wire().prompt_logprobs == 20


def test_results_for_positions_scored_already_are_dropped() -> None:
    r = Request("r", [5, 6, 7, 8], PLAIN)
    r.add_prompt_scores(1, [-1.0, -2.0], [[(6, -1.0)], [(7, -2.0)]])
    r.add_prompt_scores(1, [-9.0, -9.0, -3.0], [[], [], [(8, -3.0)]])  # recomputed: only 3 is new
    assert r.prompt_scores == [(-1.0, [(6, -1.0)]), (-2.0, [(7, -2.0)]), (-3.0, [(8, -3.0)])]
    with pytest.raises(ValueError, match="gap"):
        Request("s", [5, 6, 7, 8], PLAIN).add_prompt_scores(2, [-1.0], [[]])


def test_a_result_after_the_request_ended_is_dropped(llama_dir: Path) -> None:
    pipe = pipeline(llama_dir, block_size=BLOCK, num_kv_blocks=16)
    s = scheduler(pipe, 16)
    r = request("r", [7, 8, 9, 10], SCORED, pipe)
    s.add(r)
    plan = s.schedule()
    assert plan is not None
    s.abort("r")
    s.update(StepResult(plan.mb_id, [Sampled("r", 3)], [], pipe.executor.run(plan).prompt_logprobs))
    assert r.prompt_scores == []
