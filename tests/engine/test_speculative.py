"""Speculative decoding through the pipeline: output with drafts is the output without them.

Greedy tokens and logprobs are equal token for token (every row of a step with drafts is computed
as a decode step of its own), seeded sampling draws the same tokens, and unseeded sampling has the
model's distribution (a chi-square test). Across PP sizes, stop tokens and strings, max_tokens,
prefix caching, preemption and grammars (whose forced tokens are drafted: jump-forward).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from collections import Counter
from pathlib import Path

import pytest
from helpers import collect, engine_config, pipeline, random_prompt, wait_until
from prometheus_client.parser import text_string_to_metric_families
from scipy.stats import chi2_contingency

from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.config import EngineConfig
from ppserve.engine.model.grammar import build_grammar
from ppserve.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from ppserve.engine.offline import Generation, OfflineEngine
from ppserve.engine.outputs import EngineStats, RequestOutput
from ppserve.engine.request_stream import RequestStream
from ppserve.engine.runtime.prompt_logprobs import last_stage_outputs, make_sampler
from ppserve.engine.runtime.synthetic import SyntheticRunner
from ppserve.scheduler.request import FinishReason, Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.server.metrics import ServerMetrics
from ppserve.server.native_api import _usage as native_usage
from ppserve.server.openai_api import _usage as openai_usage
from ppserve.transport.messages import NewRequest, Sampled, SeqChunk, StepPlan


class _Cheap:
    """A step cost under which every draft pays (so that tests draft whatever the timings say)."""

    ratio = 1e-3

    def observe(self, rows: int, seconds: float) -> None:
        pass


def _engine(model: Path, pp: int, mode: str, **kw: object) -> OfflineEngine:
    pipe = pipeline(model, pp_size=pp, speculative=mode, **kw)
    pipe.scheduler.spec.cost = _Cheap()  # type: ignore[assignment]
    return pipe


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    base = [random_prompt(rng, n) for n in (5, 20, 40)]
    return [*base, base[1] * 3, base[2][:10] * 4]  # repeats: the n-gram drafter finds them


def _same(a: list[Generation], b: list[Generation]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        assert [(s.logprob, s.top_logprobs) for s in x.samples] == [(s.logprob, s.top_logprobs) for s in y.samples]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])  # mistral: sliding-window layers
@pytest.mark.parametrize("pp", [1, 2, 3])
def test_greedy_tokens_and_logprobs_equal_with_and_without_drafts(
    checkpoints: dict[str, Path], arch: str, pp: int
) -> None:
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=3)
    plain = _engine(checkpoints[arch], pp, "off").generate(_prompts(), params)
    spec = _engine(checkpoints[arch], pp, "ngram")
    _same(plain, spec.generate(_prompts(), params))
    stats = spec.scheduler.spec.stats
    assert stats.draft_tokens > 50 and 0 < stats.accepted_tokens < stats.draft_tokens  # kept some, not all
    assert spec.scheduler.allocator.num_free == spec.config.num_kv_blocks  # every block back


def test_stops_and_max_tokens_inside_an_accepted_run(llama_dir: Path) -> None:
    prompts = _prompts()
    free = _engine(llama_dir, 1, "off").generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    spec = _engine(llama_dir, 2, "ngram")
    off = _engine(llama_dir, 2, "off")
    for max_tokens in (1, 2, 7, 23):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        _same(off.generate(prompts, params), spec.generate(prompts, params))
    # A stop token (as EOS would) in the middle of the output: a draft run ends there.
    for prompt, g in zip(prompts, free, strict=True):
        stop = g.token_ids[len(g.token_ids) // 2]
        params = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop,))
        want, got = off.generate([prompt], params), spec.generate([prompt], params)
        _same(want, got)
        assert got[0].finish_reason == FinishReason.STOP
    assert spec.scheduler.spec.stats.accepted_tokens > 0


def test_seeded_sampling_draws_the_same_tokens(llama_dir: Path) -> None:
    prompts = _prompts()
    params = [SamplingParams(max_tokens=50, temperature=t, seed=i, ignore_eos=True) for i, t in enumerate((0.3, 1.0))]
    for p in params:
        _same(_engine(llama_dir, 2, "off").generate(prompts, p), _engine(llama_dir, 2, "ngram").generate(prompts, p))


def test_sampling_keeps_the_model_distribution(llama_dir: Path) -> None:
    """Draws of the first two generated tokens, with and without drafts, from a prompt whose repeats
    make the drafter guess the second token (so rejection sampling decides it), compared by a
    chi-square test of homogeneity at the 0.1% level. The draws are seeded, each arm with seeds of
    its own (independent samples, the same every run: the test cannot flake); with one seed, the
    tokens are equal (the test above). Its power is checked below against a 5% shift."""
    rng = random.Random(11)
    motif = random_prompt(rng, 6)
    prompt = motif * 5 + motif[:3]
    # The third token lets the second be drafted (a step's last token is never a draft).
    # A logit bias keeps the draws mostly on the motif's tokens, which the drafter has continuations for.
    bias = tuple(sorted((t, 6.0) for t in set(motif)))
    n = 6000

    def draws(mode: str, seeds: range) -> Counter[tuple[int, ...]]:
        engine = _engine(llama_dir, 2, mode, max_running_requests=16, num_kv_blocks=1024)
        params = [SamplingParams(max_tokens=3, ignore_eos=True, logit_bias=bias, seed=i) for i in seeds]
        out = engine.generate([prompt] * n, params)
        if mode == "ngram":
            assert engine.scheduler.spec.stats.draft_tokens >= n // 2  # most second tokens were drafted
        return Counter(tuple(g.token_ids[:2]) for g in out)

    plain, spec = draws("off", range(n)), draws("ngram", range(n, 2 * n))  # independent draws, repeatable
    common = [k for k, _ in (plain + spec).most_common() if plain[k] + spec[k] >= 20]
    table: list[list[float]] = [[float(c[k]) for k in common] + [n - sum(c[k] for k in common)] for c in (plain, spec)]
    assert len(common) >= 10 and chi2_contingency(table).pvalue > 1e-3
    # The power check: a sampler that keeps drafts too often moves mass onto the sequences whose
    # second token is the draft (what followed the first in the prompt). Moving 5% of all the mass
    # there, from the other sequences in proportion, is found at this level with these draws.
    follows = {motif[i]: motif[(i + 1) % len(motif)] for i in range(len(motif))}
    drafted = [k for k in common if follows.get(k[0]) == k[1]]
    others = [k for k in common if k not in drafted]
    move = 0.05 * n
    to, fro = sum(plain[k] for k in drafted), sum(plain[k] for k in others)
    shifted = {k: plain[k] * (1 + move / to) for k in drafted} | {k: plain[k] * (1 - move / fro) for k in others}
    table = [[c[k] for k in common] + [n - sum(c[k] for k in common)] for c in (plain, shifted)]
    assert chi2_contingency(table).pvalue < 1e-3


def test_prefix_caching_and_preemption_change_nothing(llama_dir: Path) -> None:
    prompts = _prompts()
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    want = _engine(llama_dir, 1, "off").generate(prompts, params)
    # A cache this small preempts requests (their KV recomputed from their tokens).
    small = _engine(llama_dir, 2, "ngram", num_kv_blocks=32, block_size=4)  # room for the longest alone
    _same(want, small.generate(prompts, params))
    assert small.scheduler.num_preemptions > 0 and small.scheduler.spec.stats.accepted_tokens > 0
    assert small.scheduler.allocator.num_free == 32
    cached = _engine(llama_dir, 2, "ngram", chunked_prefill_size=8, block_size=4)
    _same(want, cached.generate(prompts, params))
    _same(want, cached.generate(prompts, params))  # again, from the cache the drafts' blocks filled
    assert cached.scheduler.prefix_hits > 0


def test_jump_forward_drafts_a_grammar_forced_tokens_in_fewer_steps(llama_dir: Path) -> None:
    tok = Tokenizer(llama_dir)
    schema = {
        "type": "object",
        "properties": {
            "answer_to_the_question": {"enum": ["yes", "no"]},
            "confidence_level": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["answer_to_the_question", "confidence_level"],
        "additionalProperties": False,
    }
    prompts = [tok.encode(f"question {i}") for i in range(4)]
    params = SamplingParams(max_tokens=60, temperature=0.0, grammar=build_grammar("json", schema))
    runs = {}
    for mode in ("off", "ngram"):
        engine = _engine(llama_dir, 2, mode)
        runs[mode] = (engine.generate(prompts, params), engine.scheduler.next_mb_id)
    (plain, plain_steps), (spec, spec_steps) = runs["off"], runs["ngram"]
    _same(plain, spec)
    for g in spec:
        assert json.loads(tok.decode(g.token_ids))["answer_to_the_question"] in ("yes", "no")
    assert spec_steps < plain_steps * 0.7, (spec_steps, plain_steps)  # the keys come in one step each


def _stream(tok: Tokenizer, r: Request) -> RequestStream:
    return RequestStream(r, IncrementalDetokenizer(tok))


def test_a_stop_string_inside_a_step_with_drafts_cuts_the_text_as_one_token_at_a_time(llama_dir: Path) -> None:
    tok = Tokenizer(llama_dir)
    ids = tok.encode(" alpha beta gamma delta epsilon")
    params = SamplingParams(max_tokens=50, stop=("gamma",))
    outputs = []
    for grouping in ([1] * len(ids), [len(ids)], [2, len(ids) - 2]):
        r = Request("r", [1, 2], params)
        stream, stopped, i = _stream(tok, r), [0], 0

        def stop(stopped: list[int] = stopped) -> None:
            stopped[0] += 1

        for size in grouping:
            step = ids[i : i + size]
            i += size
            for t in step:  # what the scheduler appends before the engine pushes
                r.append_token(t)
            for j, t in enumerate(step):
                stream.push(Sampled("r", t), stop, last=j == len(step) - 1)
        text, tokens = "", 0
        while not stream.queue.empty():
            out = stream.queue.get_nowait()
            assert not isinstance(out, Exception)
            text, tokens = text + out.text, out.completion_tokens
        outputs.append((text, tokens, stopped[0]))
    assert outputs[0] == outputs[1] == outputs[2] and outputs[0][0] == " alpha beta "


# ---- the demo model through stage processes ----------------------------------------------------

_CODE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
DEMO_PROMPTS = [_CODE * 3, "Repeat after me: the quick brown fox jumps over the lazy dog. " * 3, "Once upon a time"]


@pytest.mark.slow
async def test_demo_model_at_pp2_with_a_stage_killed_mid_stream(smollm2_gguf: Path) -> None:
    """The demo model as served (Q4_1 weights, int8 activations), PP=2 in stage processes: the same
    greedy tokens with drafts as without, also when the last stage is killed mid-stream (replaced,
    its requests recomputed from their tokens), and /metrics-level counts of the drafts."""
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

    async def run(mode: str, kill: bool = False) -> tuple[list[list[int]], int]:
        config = engine_config(smollm2_gguf, 2, chunked_prefill_size=64, speculative=mode)
        async with AsyncEngine(config) as engine:
            tasks = asyncio.gather(*[collect(engine, p, params) for p in DEMO_PROMPTS])
            if kill:
                assert engine._pool is not None
                await wait_until(lambda: all(len(r.output_token_ids) > 4 for r in engine.scheduler.running), 120)
                os.kill(engine._pool.procs[1].pid or 0, signal.SIGKILL)
            out = await asyncio.wait_for(tasks, timeout=300)  # a guard against a hang, not a speed check
            assert engine.stage_restarts == [0, int(kill)] and engine.stats().kv_blocks_used == 0
            return out, engine.stats().spec_accepted_tokens

    plain, _ = await run("off")
    spec, accepted = await run("ngram")
    assert spec == plain and accepted > 0
    healed, _ = await run("ngram", kill=True)
    assert healed == plain


def test_metrics_and_usage_say_what_the_drafts_did() -> None:
    stats = EngineStats(
        1, 0, 1, 10, (0.5,), {}, None, 0, (0,), False, 0, 0, 0, 0, (9,), 3, 12, 7
    )  # 3 steps with 12 drafts, 7 kept
    m = {
        s.name: s.value
        for f in text_string_to_metric_families(ServerMetrics(lambda: stats).render().decode())
        for s in f.samples
    }
    assert m["ppserve_spec_decode_num_drafts_total"] == 3 and m["ppserve_spec_decode_num_draft_tokens_total"] == 12
    assert m["ppserve_spec_decode_num_accepted_tokens_total"] == 7
    out = RequestOutput("r", "", [], True, "length", 5, 20, draft_tokens=12, accepted_tokens=7, spec_steps=3)
    usage = openai_usage(5, 20, 0, [out], speculative=True)  # the request's speculative_usage: true
    details = {"accepted_prediction_tokens": 7, "rejected_prediction_tokens": 5}
    assert usage["completion_tokens_details"] == details
    assert usage["speculative"]["mean_acceptance_length"] == pytest.approx(10 / 3)
    undrafted = RequestOutput("r", "", [], True, "length", 5, 20)
    assert "speculative" not in openai_usage(5, 20, 0, [undrafted], speculative=True)
    assert native_usage(out, True)["speculative"]["accepted_tokens"] == 7
    assert "speculative" not in native_usage(undrafted, True)
    # Not asked for: OpenAI's counts stay, ppserve's own object does not appear.
    plain = openai_usage(5, 20, 0, [out])
    assert plain["completion_tokens_details"] == details and "speculative" not in plain
    assert "speculative" not in native_usage(out)


def test_synthetic_stages_verify_drafts_too(llama_dir: Path) -> None:
    """Stages that do no math (--synthetic-latency) give a step with drafts a logits row per token,
    which the sampler verifies like any (their one favoured token: every draft of it is kept)."""
    config = EngineConfig.create(llama_dir, synthetic_latency=(0.0, 0.0, 0.0), num_kv_blocks=8)
    runner, sampler = SyntheticRunner(config, 0), make_sampler(config)
    favoured = config.model_config.vocab_size - 1
    params = SamplingParams(temperature=0.0).wire()
    plan = StepPlan(
        0,
        [
            SeqChunk("a", [5, favoured, favoured], 4, [0], True, True, drafts=2),
            SeqChunk("b", [5, 6], 9, [1], True, True, drafts=1),
        ],
        [NewRequest("a", params), NewRequest("b", params)],
    )
    samples, _, _ = last_stage_outputs(sampler, plan, runner.execute_plan(plan), runner.pooled)
    assert [(s.request_id, s.token_id) for s in samples] == [("a", favoured)] * 3 + [("b", favoured)]
