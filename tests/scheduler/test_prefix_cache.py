"""Prefix caching changes nothing but the work: outputs are equal with it on and off, and the
cached part of a prompt is computed by no stage.

The in-process tests drive the real scheduler with every stage's runner in this process, the way
the pipeline does: up to pp_size plans in flight, each run by every stage in order, results fed
back oldest first. The last one runs the stage processes."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from helpers import pipeline, random_prompt
from stepper import Stepper

from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.config import EngineConfig
from ppserve.engine.offline import OfflineEngine
from ppserve.engine.runtime.latency_profile import profile_points
from ppserve.scheduler.chunk_predictor import LatencyModel
from ppserve.scheduler.request import Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.scheduler.scheduler import Scheduler, SchedulerConfig

BLOCK = 8
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)


@dataclass(frozen=True)
class Arrival:
    step: int  # the pipeline step at which the request comes in
    name: str
    prompt: list[int]
    params: SamplingParams
    abort_at: int | None = None  # the step at which the client goes away, if it does


@dataclass
class Served:
    outputs: dict[str, list[int]]
    cached: dict[str, int]  # name -> prompt tokens its first admission found cached
    scheduler: Scheduler
    chunk_sizes: set[int]  # of the prefill chunks that did not end a prompt


# A steep attention term: with dynamic chunking, chunks after a prefix of 64 shrink from 32 to 8.
STEEP = LatencyModel(a=1e-6, b=1e-5, c=1e-3)


def serve(
    pipe: OfflineEngine, arrivals: Sequence[Arrival], caching: bool, num_blocks: int, dynamic: bool = False
) -> Served:
    cfg = pipe.config
    s = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=cfg.block_size,
            pp_size=cfg.pp_size,
            async_depth=0,
            max_batched_tokens=64,
            chunked_prefill_size=32 if dynamic else 16,
            dynamic_chunking=dynamic,
            chunk_smooth=1.0,
            enable_prefix_caching=caching,
            speculative=cfg.speculative,
        )
    )
    if dynamic:
        fresh, prefixed = profile_points(32, 1024)
        s.set_profile(0, [(p, x, STEEP.chunk(p, x)) for p, x in [*fresh, *prefixed]])
    pending = deque(sorted(arrivals, key=lambda a: a.step))
    aborts = {a.name: a.abort_at for a in arrivals if a.abort_at is not None}
    requests: dict[str, Request] = {}

    def script(steps: Stepper) -> bool:
        while pending and pending[0].step <= steps.step:
            a = pending.popleft()
            requests[a.name] = pipe.request(a.prompt, a.params, a.name)
            s.add(requests[a.name])
        for name, at in aborts.items():
            if at == steps.step and name in requests:
                s.abort(name)
        return bool(pending) or any(at >= steps.step for at in aborts.values())

    steps = Stepper(pipe, s)
    steps.run(script)
    chunk_sizes = {c.num_new for plan in steps.ran for c in plan.chunks if not c.sample}
    assert s.allocator.num_free == num_blocks, "KV blocks leaked"
    return Served(
        {n: r.output_token_ids for n, r in requests.items()},
        {n: r.num_cached_tokens or 0 for n, r in requests.items()},
        s,
        chunk_sizes,
    )


def workload(seed: int, vocab: int) -> list[Arrival]:
    """Prompts that share random prefixes (some whole, some a block-aligned cut, some exact
    repeats), a seeded sampled request, and n = 3 choices of one prompt, arriving at random
    steps among each other's decodes."""
    rng = random.Random(seed)
    bases = [random_prompt(rng, rng.randrange(24, 72), vocab) for _ in range(3)]
    arrivals: list[Arrival] = []
    for i in range(14):
        base = rng.choice(bases)
        cut = rng.choice([len(base), rng.randrange(1, len(base)), (len(base) // BLOCK) * BLOCK])
        prompt = base[:cut] + random_prompt(rng, rng.randrange(0, 20), vocab)
        if i % 5 == 4:
            prompt = list(arrivals[rng.randrange(len(arrivals))].prompt)  # an exact repeat
        arrivals.append(Arrival(rng.randrange(40), f"g{i}", prompt or base, GREEDY))
    arrivals.append(Arrival(5, "full-blocks", bases[0][: 4 * BLOCK], GREEDY))  # all blocks full: last is recomputed
    arrivals.append(Arrival(25, "full-blocks-again", bases[0][: 4 * BLOCK], GREEDY))
    arrivals.append(Arrival(rng.randrange(40), "seeded", bases[1] + random_prompt(rng, 9, vocab), SEEDED))
    choices = bases[2] + random_prompt(rng, 5, vocab)
    for i in range(3):  # as the OpenAI server submits n = 3: seed + i for choice i
        arrivals.append(Arrival(12, f"n3-{i}", choices, replace(SEEDED, seed=99 + i)))
    for i in range(2):  # clients that go away mid-prompt or mid-answer, sharing a prefix
        step = rng.randrange(30)
        prompt = bases[i] + random_prompt(rng, 30, vocab)
        arrivals.append(Arrival(step, f"gone-{i}", prompt, GREEDY, abort_at=step + rng.randrange(1, 12)))
    return arrivals


@pytest.mark.parametrize("pp", [1, 3])
def test_outputs_equal_with_caching_on_and_off(llama_dir: Path, pp: int) -> None:
    num_blocks = 24  # small enough that requests are preempted
    pipe = pipeline(llama_dir, pp_size=pp, block_size=BLOCK, num_kv_blocks=num_blocks)
    for seed in range(4):
        arrivals = workload(seed, pipe.config.model_config.vocab_size)
        dynamic = seed == 3  # chunks that shrink with the prefix, as with --enable-dynamic-chunking
        on = serve(pipe, arrivals, caching=True, num_blocks=num_blocks, dynamic=dynamic)
        off = serve(pipe, arrivals, caching=False, num_blocks=num_blocks, dynamic=dynamic)
        # The aborted requests end at the same step, not after the same tokens: left out.
        kept = [a.name for a in arrivals if a.abort_at is None]
        assert [on.outputs[n] for n in kept] == [off.outputs[n] for n in kept]
        # The chunking meant is the one tested: shrinking from 32 to 8, or at most 16 throughout.
        assert {32, 8} <= on.chunk_sizes if dynamic else max(on.chunk_sizes) == 16, on.chunk_sizes
        assert on.scheduler.prefix_hits > 0 and off.scheduler.prefix_hits == 0
        assert on.scheduler.num_preemptions > 0 and on.scheduler.allocator.num_evictions > 0, "no pressure"
        assert on.cached["full-blocks-again"] <= 3 * BLOCK  # never all 4: one token is always computed
        assert on.cached["n3-1"] > 0 and on.cached["n3-2"] > 0  # the choices share the prompt's blocks
        assert len({tuple(on.outputs[f"n3-{i}"]) for i in range(3)}) > 1  # ... yet sample apart


def test_repetition_penalty_counts_a_cached_prompt(llama_dir: Path) -> None:
    """The penalty covers the prompt's tokens, also those of a cached prefix, which no stage
    computes: the last stage gets them with the request. Same output as the local pipeline
    (which knows the prompt), with caching on and off, and unlike the unpenalised output."""
    pipe = pipeline(llama_dir, block_size=BLOCK, num_kv_blocks=32)
    prompt = random_prompt(random.Random(9), 3 * BLOCK + 2, pipe.config.model_config.vocab_size)
    params = replace(GREEDY, max_tokens=12, repetition_penalty=1.8)
    expected = pipe.generate([prompt], params)[0].token_ids
    assert expected != pipe.generate([prompt], replace(params, repetition_penalty=1.0))[0].token_ids
    arrivals = [Arrival(0, "first", prompt, params), Arrival(40, "again", prompt, params)]
    on = serve(pipe, arrivals, caching=True, num_blocks=32)
    assert on.cached["again"] > 0
    off = serve(pipe, arrivals, caching=False, num_blocks=32)
    assert on.outputs == off.outputs == {"first": expected, "again": expected}


def test_every_stage_skips_the_cached_tokens(llama_dir: Path) -> None:
    # (No drafts: the counts below are one row per token; drafts add rows that are rolled back.)
    pipe = pipeline(llama_dir, pp_size=3, block_size=BLOCK, num_kv_blocks=64, speculative="off")
    rng = random.Random(5)
    system = random_prompt(rng, 100, pipe.config.model_config.vocab_size)
    first = Arrival(0, "first", system + random_prompt(rng, 7), GREEDY)
    second = Arrival(0, "second", system + random_prompt(rng, 11), GREEDY)
    before = [r.tokens_computed for r in pipe.executor.runners]
    served = serve(pipe, [first], caching=True, num_blocks=64)
    assert [r.tokens_computed - b for r, b in zip(pipe.executor.runners, before, strict=True)] == [
        107 + 7
    ] * 3  # 8 tokens: 7 decodes

    before = [r.tokens_computed for r in pipe.executor.runners]
    both = serve(pipe, [first, second], caching=True, num_blocks=64)
    cached = both.cached["second"]
    assert cached == 96 and both.cached["first"] == 0  # 12 full blocks of the 100 shared tokens
    computed = [r.tokens_computed - b for r, b in zip(pipe.executor.runners, before, strict=True)]
    assert computed == [(107 + 7) + (111 - cached + 7)] * 3
    assert served.outputs["first"] == both.outputs["first"]


def engine_config(model_dir: Path, caching: bool) -> EngineConfig:
    return EngineConfig.create(
        model_dir,
        pp_size=3,
        tensor_transport="shm",
        threads_per_stage=1,
        block_size=BLOCK,
        num_kv_blocks=128,
        chunked_prefill_size=32,
        enable_prefix_caching=caching,
        speculative="off",  # the counts below are one row per token (drafts add rows, rolled back)
    )


@pytest.mark.slow
async def test_stage_processes_skip_cached_tokens_and_match_the_reference(llama_dir: Path) -> None:
    rng = random.Random(11)
    system = random_prompt(rng, 90)
    prompts = [system + random_prompt(rng, n) for n in (6, 13, 2)]
    reference = [g.token_ids for g in pipeline(llama_dir, chunked_prefill_size=16).generate(prompts, GREEDY)]
    async with AsyncEngine(engine_config(llama_dir, caching=True)) as engine:
        outputs, cached = [], []
        for prompt in prompts:
            tokens, before = [], engine.stats().stage_tokens
            async for out in engine.generate(prompt, GREEDY):
                tokens += out.token_ids
            outputs.append(tokens)
            cached.append(out.cached_tokens)
            computed = [a - b for a, b in zip(engine.stats().stage_tokens, before, strict=True)]
            # Every stage computed the uncached prompt tokens and the 7 decode steps, nothing else.
            assert computed == [len(prompt) - out.cached_tokens + 7] * 3
        stats = engine.stats()
        assert stats.prefix_cache_hits == sum(cached) and stats.prefix_cache_queries == sum(map(len, prompts))
        assert engine.scheduler.flush_cache() > 0 and engine.stats().prefix_cache_blocks == 0
        tokens = []
        async for out in engine.generate(prompts[0], GREEDY):
            tokens += out.token_ids
        assert out.cached_tokens == 0 and tokens == reference[0]  # flushed: computed again, the same
    assert cached == [0, 88, 88]  # 11 full blocks of the 90 shared tokens
    assert outputs == reference
