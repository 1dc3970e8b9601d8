"""Generation through the local pipeline: stop conditions, seeds across batches, KV accounting."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from helpers import pipeline, random_prompt

from ppserve.engine.offline import OfflineEngine
from ppserve.scheduler.request import FinishReason
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.transport.messages import StepPlan, StepResult

PROMPT = random_prompt(random.Random(5), 12)


def _greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


def test_stop_token_ids_and_eos_from_generation_config(llama_dir: Path, tmp_path: Path) -> None:
    free_run = pipeline(llama_dir).generate([PROMPT], _greedy(20, ignore_eos=True))[0].token_ids
    target = free_run[6]
    first = free_run.index(target)

    out = pipeline(llama_dir).generate([PROMPT], _greedy(20, stop_token_ids=(target,)))[0]
    assert out.token_ids == free_run[: first + 1] and out.finish_reason == FinishReason.STOP

    # The same token as EOS, from generation_config.json (a list, as Llama 3 writes it).
    ckpt = shutil.copytree(llama_dir, tmp_path / "eos")
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [99999, target]}))
    pipe = pipeline(ckpt)
    assert pipe.config.model_config.eos_token_ids == (target,)  # 99999 is past the vocabulary: never sampled
    out = pipe.generate([PROMPT], _greedy(20))[0]
    assert out.token_ids == free_run[: first + 1] and out.finish_reason == FinishReason.STOP
    out = pipe.generate([PROMPT], _greedy(20, ignore_eos=True))[0]
    assert out.token_ids == free_run and out.finish_reason == FinishReason.LENGTH


def test_context_length_ends_generation(llama_dir: Path) -> None:
    out = pipeline(llama_dir, max_model_len=16).generate([PROMPT], _greedy(50, ignore_eos=True))[0]
    assert len(PROMPT) + len(out.token_ids) == 16 and out.finish_reason == FinishReason.LENGTH


def test_seeded_output_independent_of_batch(llama_dir: Path) -> None:
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_k=50, seed=42, ignore_eos=True)
    pipe = pipeline(llama_dir, pp_size=2, chunked_prefill_size=5)  # prompts prefilled over several steps
    alone = pipe.generate([PROMPT], seeded)[0].token_ids
    rng = random.Random(1)
    others = [random_prompt(rng, n) for n in (3, 30, 7)]
    batch = pipe.generate(
        [others[0], PROMPT, others[1], others[2]],
        [SamplingParams(max_tokens=30, ignore_eos=True), seeded, _greedy(5), SamplingParams(seed=1, max_tokens=9)],
    )
    assert batch[1].token_ids == alone
    assert pipe.generate([PROMPT], seeded)[0].token_ids == alone  # and again, later
    assert pipe.allocator.num_free == pipe.allocator.num_blocks


def test_penalties_change_greedy_output(llama_dir: Path) -> None:
    pipe = pipeline(llama_dir)
    plain = pipe.generate([PROMPT], _greedy(30, ignore_eos=True))[0].token_ids
    penalised = pipe.generate([PROMPT], _greedy(30, ignore_eos=True, frequency_penalty=2.0))[0].token_ids
    assert len(set(penalised)) > len(set(plain))  # repeats are discouraged


def test_out_of_kv_blocks_preempts_and_frees_everything(llama_dir: Path) -> None:
    pipe = pipeline(llama_dir, num_kv_blocks=4, enable_prefix_caching=False)  # 64 tokens in all: one request at a time
    alone = pipe.generate([PROMPT], _greedy(40, ignore_eos=True))[0].token_ids
    both = pipe.generate([PROMPT, PROMPT], _greedy(40, ignore_eos=True))
    assert [g.token_ids for g in both] == [alone, alone]
    assert pipe.scheduler.num_preemptions > 0
    assert pipe.allocator.num_free == 4


def record_plans(pipe: OfflineEngine, monkeypatch: pytest.MonkeyPatch) -> list[StepPlan]:
    """The plans `pipe` runs from now on, in order."""
    planned: list[StepPlan] = []
    run = pipe.executor.run

    def recorded(plan: StepPlan) -> StepResult:
        planned.append(plan)
        return run(plan)

    monkeypatch.setattr(pipe.executor, "run", recorded)
    return planned


def test_decoding_ahead_changes_no_output(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At PP=1 each decode step is planned before the token it reads is back (scheduler.py); the
    stage fills that token in. Sampling state (seeds, penalties), stop tokens, max_tokens and
    logprobs come out as with the step planned after it, and as at PP=2, which never plans ahead."""
    rng = random.Random(3)
    prompts = [random_prompt(rng, n) for n in (12, 3, 30, 7, 12)]
    free_run = pipeline(llama_dir, pp_size=2).generate([prompts[4]], _greedy(20, ignore_eos=True))[0].token_ids
    params = [
        _greedy(17, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, top_k=50, seed=42, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=9, temperature=0.8, seed=7, frequency_penalty=1.5, repetition_penalty=1.3),
        _greedy(1),  # its only token is sampled by the prefill: nothing to plan ahead
        _greedy(20, stop_token_ids=(free_run[5],)),  # ends with a step planned ahead still in flight
    ]
    runs = {}
    for name, pp, ahead in (("pp1", 1, True), ("pp1-behind", 1, False), ("pp2", 2, True)):
        pipe = pipeline(llama_dir, pp_size=pp, decode_ahead=ahead)
        planned = record_plans(pipe, monkeypatch)
        runs[name] = [(g.token_ids, g.finish_reason, g.samples) for g in pipe.generate(prompts, params)]
        assert pipe.allocator.num_free == pipe.allocator.num_blocks
        assert not pipe.scheduler.inflight  # the step planned ahead past the stop token came back
        again = pipe.generate([prompts[4]], params[4])[0]  # the same pipeline serves on
        assert (again.token_ids, again.finish_reason) == runs[name][4][:2]
        assert any(c.follows for p in planned for c in p.chunks) == (name == "pp1"), name
    assert runs["pp1"] == runs["pp1-behind"] == runs["pp2"]
    assert runs["pp1"][4][0] == free_run[: free_run.index(free_run[5]) + 1]


def test_a_failed_step_planned_past_the_end_leaves_the_engine_clean(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step planned ahead past a stop token is still in flight when the request ends; if it
    fails, `generate` raises, and the engine is left with nothing in flight and every block
    free, so the next batch runs (it waited forever for that step's result before). Without
    drafts: a request that would draft waits for its token rather than plan a step ahead."""
    pipe = pipeline(llama_dir, speculative="off")
    free_run = pipe.generate([PROMPT], _greedy(20, ignore_eos=True))[0].token_ids
    stop = free_run[3]
    params = _greedy(20, stop_token_ids=(stop,))
    run, ended = pipe.executor.run, [False]

    def fails_after_the_stop(plan: StepPlan) -> StepResult:
        if ended[0]:
            raise RuntimeError("the step after the stop token failed")
        result = run(plan)
        ended[0] = any(s.token_id == stop for s in result.samples)
        return result

    monkeypatch.setattr(pipe.executor, "run", fails_after_the_stop)
    with pytest.raises(RuntimeError, match="after the stop token"):
        pipe.generate([PROMPT], params)
    assert not pipe.scheduler.inflight and pipe.allocator.num_free == pipe.allocator.num_blocks
    monkeypatch.undo()
    out = pipe.generate([PROMPT], params)[0]
    assert out.token_ids == free_run[: free_run.index(stop) + 1] and out.finish_reason == FinishReason.STOP
    assert pipe.allocator.num_free == pipe.allocator.num_blocks


def test_offline_prompts_as_text_or_token_ids(llama_dir: Path) -> None:
    """One prompt or a list; text is tokenized with the model's tokenizer (and the output comes
    back as text too); anything else is a TypeError that says what a prompt is."""
    pipe = pipeline(llama_dir)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ids = pipe.tokenizer.encode("a pipeline stage")
    by_text = pipe.generate("a pipeline stage", params)
    both: list[str | list[int]] = [ids, "a pipeline stage"]
    by_ids = pipe.generate(both, params)
    assert len(by_text) == 1 and by_text[0].token_ids == by_ids[0].token_ids == by_ids[1].token_ids
    assert by_text[0].text == pipe.tokenizer.decode(by_text[0].token_ids) and by_ids[0].text is None
    assert pipe.generate(ids, params)[0].token_ids == by_ids[0].token_ids  # one prompt of token ids
    with pytest.raises(TypeError, match="text or a list of token ids"):
        pipe.generate([[1.5, 2]], params)  # type: ignore[arg-type]
