"""Generation through the local pipeline: stop conditions, seeds across batches, KV accounting."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from helpers import pipeline, random_prompt

from ppserve.scheduler.request import FinishReason
from ppserve.scheduler.sampling_params import SamplingParams

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
    assert pipe.config.model_config.eos_token_ids == (99999, target)
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
