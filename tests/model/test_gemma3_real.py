"""The real Gemma 3: google/gemma-3-270m as people download it (llama.cpp's Q4_K_M GGUF,
benchmarks/fetch_gemma3.py), served by ppserve.

- `--quantization none` (the blocks dequantized as transformers dequantizes them): the greedy
  continuations of six prompts, one of them longer than the 512-token sliding window, are
  transformers' on its own GGUF loader (float32), token for token, at PP=1 and PP=3, and so (to
  rounding) are the chosen tokens' log-probabilities.
- `--quantization auto` (the blocks kept as they are): the perplexity of the window that
  llama.cpp's `llama-perplexity` scored (benchmarks/results/kquant_reference.json, by
  benchmarks/kquant_reference.py: the same token ids, the same scored tokens) is within 1% of
  llama.cpp's figure on the same file.

Token ids in, token ids out: no chat template. transformers is loaded once, its references
computed and the model freed before any engine is built; one engine per configuration.
"""

from __future__ import annotations

import gc
import inspect
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import pipeline
from live_server import ROOT

from benchmarks.fetch_gemma3 import gemma3_270m_q4_k_m
from ppserve.engine.config import EngineConfig
from ppserve.engine.model.file_hash import file_sha256
from ppserve.engine.model.model_config import ConfigError
from ppserve.engine.model.tokenizer import Tokenizer
from ppserve.engine.offline import OfflineEngine
from ppserve.scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NEW = 16
WINDOW = 512  # the model's sliding window
LONG = 640  # tokens of the long prompt: past the window, so its sliding layers drop the oldest
PROMPTS = [
    "The lighthouse keeper climbed the stairs at dusk, as he had every evening for eleven years, and",
    "Question: What is the boiling point of water at sea level, in degrees Celsius?\nAnswer:",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Ingredients for a simple bread: 500 g flour, 10 g salt, 7 g yeast and",
    "Bonjour! Je m'appelle Claire et j'habite à Lyon. Le week-end, j'aime",
]
LOGPROB_TOL = 1e-4  # float32 through 18 layers, summed in another order than transformers sums (seen: 1.2e-5)
REFERENCE = ROOT / "benchmarks" / "results" / "kquant_reference.json"
REFERENCE_MODEL = "gemma3_270m_q4_k_m"
TEXTS = ("perplexity_long", "perplexity")  # the long text's window first: 1769 tokens, past the window
PPL_TOL = 0.01


@pytest.fixture(scope="module")
def gemma3_gguf() -> Path:
    try:
        return gemma3_270m_q4_k_m()
    except ConfigError as e:  # Gemma3Unavailable: no registry, no pip, not as pinned
        pytest.skip(f"Gemma 3 270M Q4_K_M unavailable: {e}")


@pytest.fixture(scope="module")
def prompts(gemma3_gguf: Path) -> list[list[int]]:
    """The prompts' token ids (ppserve's tokenizer, with the BOS Gemma needs), the long one from
    the start of benchmarks/data/perplexity_long.txt."""
    tokenizer = Tokenizer(EngineConfig.create(gemma3_gguf, num_kv_blocks=1).model)
    long_text = (ROOT / "benchmarks" / "data" / "perplexity_long.txt").read_text()
    ids = [tokenizer.encode(text) for text in PROMPTS] + [tokenizer.encode(long_text)[:LONG]]
    bos = ids[-1][0]
    assert bos == 2 and all(p[0] == bos and bos not in p[1:] for p in ids)
    assert len(ids[-1]) == LONG > WINDOW + NEW
    return ids


@dataclass(frozen=True)
class Reference:
    tokens: list[int]  # greedy, NEW of them
    logprobs: list[float]  # of each, float32
    margins: list[float]  # logit of the chosen token minus the runner-up's, per step


@pytest.fixture(scope="module")
def references(gemma3_gguf: Path, prompts: list[list[int]]) -> list[Reference]:
    """transformers' greedy continuations on its own reading of the GGUF (dequantized, float32),
    with its KV cache (a sliding-window cache for the sliding layers). The model is freed after."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(
        str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name, dtype=torch.float32
    ).eval()
    assert hf.config.sliding_window == WINDOW
    loaded = time.perf_counter()
    refs = [_hf_greedy(hf, p) for p in prompts]
    print(f"\ntransformers: loaded in {loaded - start:.1f} s, greedy in {time.perf_counter() - loaded:.1f} s")
    del hf
    gc.collect()
    return refs


def _hf_greedy(hf: Any, prompt: list[int]) -> Reference:
    from transformers import DynamicCache

    tokens, logprobs, margins = [], [], []
    # The cache is updated in place; transformers 5 renamed the argument past_key_values to cache.
    cache = DynamicCache(config=hf.config)
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(NEW):
            logits = hf(input_ids=ids, use_cache=True, logits_to_keep=1, **{name: cache}).logits[0, -1].float()
            top = logits.topk(2)
            token = int(top.indices[0])
            tokens.append(token)
            logprobs.append(torch.log_softmax(logits, dim=-1)[token].item())
            margins.append((top.values[0] - top.values[1]).item())
            ids = torch.tensor([[token]])
    return Reference(tokens, logprobs, margins)


@pytest.fixture(scope="module", params=[1, 3], ids=lambda pp: f"pp{pp}")
def float_engine(request: pytest.FixtureRequest, gemma3_gguf: Path) -> Iterator[OfflineEngine]:
    """ppserve with the GGUF's blocks dequantized (float32), at PP=1 and PP=3 (six layers per stage,
    one global layer at the end of each)."""
    pipe = pipeline(gemma3_gguf, pp_size=request.param, quantization="none")
    yield pipe
    pipe.close()
    del pipe
    gc.collect()


def test_greedy_equals_transformers(
    float_engine: OfflineEngine, prompts: list[list[int]], references: list[Reference]
) -> None:
    """All six prompts in one batch: each continuation is transformers', token for token, and the
    chosen tokens' log-probabilities agree to LOGPROB_TOL."""
    # A turn ends at <end_of_turn> (106), which the file does not name as its EOT token.
    assert set(float_engine.config.model_config.eos_token_ids) == {1, 106}
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)
    start = time.perf_counter()
    outs = float_engine.generate(prompts, params)
    seconds, worst = time.perf_counter() - start, 0.0
    for i, (out, ref) in enumerate(zip(outs, references, strict=True)):
        diverged = next((j for j, (a, b) in enumerate(zip(out.token_ids, ref.tokens, strict=True)) if a != b), None)
        assert diverged is None, (
            f"prompt {i} ({len(prompts[i])} tokens): new token {diverged} is {out.token_ids[diverged]}, "
            f"transformers' {ref.tokens[diverged]} (its margin over the runner-up {ref.margins[diverged]:.4f}); "
            f"ours {out.token_ids}, theirs {ref.tokens}"
        )
        got = [float(s.logprob) for s in out.samples if s.logprob is not None]
        assert len(got) == NEW
        worst = max(worst, float(np.abs(np.subtract(got, ref.logprobs)).max()))
        assert worst <= LOGPROB_TOL, (i, worst, got, ref.logprobs)
    margin = min(min(r.margins) for r in references)
    print(
        f"\nppserve PP={float_engine.config.pp_size}: {seconds:.1f} s; log-probabilities within {worst:.1e} of "
        f"transformers'; its smallest margin of a chosen token's logit over the runner-up {margin:.4f}"
    )


def _recorded_window(path: Path) -> tuple[str, dict[str, Any]]:
    """The first of TEXTS that the reference records for this file (skips where it records none,
    fails where it was measured on another file)."""
    if not REFERENCE.is_file():
        pytest.skip(f"{REFERENCE.relative_to(ROOT)} is missing")
    entry = json.loads(REFERENCE.read_text()).get("models", {}).get(REFERENCE_MODEL)
    if not entry or not entry.get("runs"):
        pytest.skip(f"{REFERENCE.relative_to(ROOT)} records no {REFERENCE_MODEL} run")
    assert entry["sha256"] == file_sha256(path), f"the reference was measured on another {entry['file']}"
    for text in TEXTS:
        if text in entry["runs"]:
            return text, entry["runs"][text]
    pytest.skip(f"{REFERENCE.relative_to(ROOT)} records none of {TEXTS} for {REFERENCE_MODEL}")


def test_kept_quantized_perplexity_is_llama_cpps(gemma3_gguf: Path) -> None:
    """ppserve with the K-quant blocks kept as they are scores the window llama-perplexity scored:
    the same token ids, tokens n_ctx // 2 + 1 .. n_ctx - 1 each with every token before it (the
    engine's prompt log-probs), perplexity within 1% of llama.cpp's."""
    text, run = _recorded_window(gemma3_gguf)
    ids, n_ctx = [int(t) for t in run["ids"]], int(run["n_ctx"])
    first, last = run["scored_positions"]
    assert len(ids) == n_ctx and (first, last) == (n_ctx // 2 + 1, n_ctx - 1)
    assert len(run["logprobs"]) == last - first + 1
    pipe = pipeline(gemma3_gguf, pp_size=1, quantization="auto")
    try:
        start = time.perf_counter()
        request = pipe.request(ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
        pipe.run([request])
        seconds = time.perf_counter() - start
    finally:
        pipe.close()
    scores = [logprob for logprob, _ in request.prompt_scores]  # of tokens 1 .. n_ctx - 1
    assert len(scores) == n_ctx - 1
    ours = scores[first - 1 : last]
    theirs = [float(v) for v in run["logprobs"]]
    ppl_ours, ppl_theirs = math.exp(-float(np.mean(ours))), float(run["perplexity"])
    diff = np.subtract(ours, theirs)
    relative = abs(ppl_ours - ppl_theirs) / ppl_theirs
    print(
        f"\n{text} ({n_ctx} tokens, {len(ours)} scored, {seconds:.1f} s): perplexity ppserve {ppl_ours:.4f}, "
        f"llama.cpp {ppl_theirs:.4f} ({relative:.2%} apart); per token: mean {diff.mean():+.4f}, "
        f"mean size {np.abs(diff).mean():.4f}, largest {np.abs(diff).max():.4f}"
    )
    assert relative <= PPL_TOL, (ppl_ours, ppl_theirs)
