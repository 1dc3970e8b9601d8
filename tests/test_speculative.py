"""Speculative decoding through the pipeline: output with drafts is the output without them.

Greedy tokens and logprobs are equal token for token (every row of a step with drafts is computed
as a decode step of its own), seeded sampling draws the same tokens, and unseeded sampling has the
model's distribution (a chi-square test). Across PP sizes, stop tokens and strings, max_tokens,
prefix caching, preemption and grammars (whose forced tokens are drafted: jump-forward).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
from helpers import pipeline, random_prompt
from scipy.stats import chi2_contingency

from ppserve.engine.model.grammar import build_grammar
from ppserve.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from ppserve.engine.offline import Generation, OfflineEngine
from ppserve.engine.request_stream import RequestStream
from ppserve.scheduler.request import FinishReason, Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.transport.messages import Sampled


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
        engine = _engine(llama_dir, 1, mode, max_running_requests=256, num_kv_blocks=4096)
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
