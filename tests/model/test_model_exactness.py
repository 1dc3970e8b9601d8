"""The engine's model against transformers, and against itself split into stages."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import ARCHS
from helpers import GREEDY_TOKENS, hf_greedy, pipeline, prompt_logits, random_prompt
from transformers import AutoModelForCausalLM

from ppserve.scheduler.sampling_params import SamplingParams

MOE = ("qwen3-moe", "mixtral")  # conftest.SPECS' mixtures of experts
GREEDY = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)

# (device, dtype, logit tolerance relative to the logit scale). CUDA cases join when a GPU is present.
PRECISIONS = [("cpu", "float32", 1e-4), ("cpu", "bfloat16", 2e-2), ("cpu", "float16", 2e-2)]
if torch.cuda.is_available():
    PRECISIONS += [("cuda", "float32", 1e-3), ("cuda", "bfloat16", 5e-2)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("device", "dtype", "tol"), PRECISIONS)
def test_matches_transformers(checkpoints: dict[str, Path], arch: str, device: str, dtype: str, tol: float) -> None:
    model_dir = checkpoints[arch]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    hf = hf.to(device).eval()  # type: ignore[arg-type]
    prompt = random_prompt(random.Random(arch), 40)  # longer than mistral's 24-token window
    with torch.no_grad():
        expected = hf(torch.tensor([prompt], device=device)).logits[0].float()
    pipe = pipeline(model_dir, pp_size=2, device=device, dtype=dtype)
    got = prompt_logits(pipe, prompt)
    scale = max(1.0, expected.abs().max().item())
    close = (got - expected).abs().amax(dim=-1) <= tol * scale  # per position
    if arch in MOE and dtype != "float32":
        # In 16 bits two experts' scores are often a unit in the last place apart, and any other
        # rounding routes such a token the other way: nearly all positions agree (39 of 40 here),
        # and the tokens are compared in float32.
        assert close.float().mean().item() >= 0.9, close.tolist()
        return
    assert close.all(), close.tolist()

    ours = pipe.generate([prompt], GREEDY)[0].token_ids
    reference = hf_greedy(hf, prompt, GREEDY_TOKENS)
    if dtype == "float32":
        assert ours == reference
        return
    # In 16-bit types the top two logits of a random model are often one unit in the last place
    # apart, and any other order of summation may break such a tie either way. The tokens must
    # agree up to the first tie within the tolerance, and there transformers' own logits must
    # rank the two tokens within the tolerance.
    i = next((i for i, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b), None)
    if i is not None:
        with torch.no_grad():
            step = hf(torch.tensor([prompt + reference[:i]], device=device)).logits[0, -1].float()
        gap = (step[reference[i]] - step[ours[i]]).item()
        assert gap <= tol * scale, f"token {i}: {ours[i]} instead of {reference[i]}, {gap:.4f} below it"


@pytest.mark.parametrize("arch", ARCHS)
def test_split_equals_unsplit_bitwise(checkpoints: dict[str, Path], arch: str) -> None:
    prompt = random_prompt(random.Random(7), 37)
    whole = pipeline(checkpoints[arch], pp_size=1)
    reference = prompt_logits(whole, prompt)
    reference_tokens = whole.generate([prompt], GREEDY)[0].token_ids
    for pp, partition in [(2, None), (3, None), (4, None), (3, "1,1,2"), (2, "3,1")]:
        split = pipeline(checkpoints[arch], pp_size=pp, layer_partition=partition)
        assert torch.equal(prompt_logits(split, prompt), reference), (pp, partition)
        assert split.generate([prompt], GREEDY)[0].token_ids == reference_tokens, (pp, partition)


@pytest.mark.parametrize(("arch", "block_size"), [(a, 16) for a in ARCHS] + [("llama", 1), ("mistral", 3)])
def test_chunked_batch_equals_alone(checkpoints: dict[str, Path], arch: str, block_size: int) -> None:
    """8 prompts of different lengths, prefilled together in random chunk sizes (1-token chunks
    included), then decoded together: each gets exactly the tokens it gets alone."""
    rng = random.Random(11)
    prompts = [random_prompt(rng, n) for n in (1, 2, 5, 16, 17, 33, 48, 70)]
    pipe = pipeline(checkpoints[arch], pp_size=2, block_size=block_size, num_kv_blocks=4096 // block_size)
    alone = [pipe.generate([p], GREEDY)[0].token_ids for p in prompts]

    from ppserve.engine.model.sampler import Sampler  # the batch is driven by hand here to control chunking
    from ppserve.scheduler.request import Request
    from ppserve.transport.messages import SeqChunk

    sampler = Sampler(pipe.config.model_config.vocab_size, torch.device("cpu"))
    reqs = [Request(str(i), p, GREEDY) for i, p in enumerate(prompts)]
    for r in reqs:
        sampler.add_request(r.request_id, r.params)
    chunk_sizes_seen: set[int] = set()
    while any(not r.finished for r in reqs):
        chunks, active = [], []
        for r in reqs:
            if r.finished:
                continue
            left = r.num_tokens - r.num_computed_tokens
            n = min(left, rng.choice([1, 1, 2, 3, 7, 16, 40]))
            chunk_sizes_seen.add(n)
            pipe.allocator.grow(r.block_table, r.num_computed_tokens + n)
            ids = r.token_slice(r.num_computed_tokens, r.num_computed_tokens + n)
            chunks.append(SeqChunk(r.request_id, ids, r.num_computed_tokens, list(r.block_table), n == left))
            active.append(r)
        rng.shuffle(chunks)  # batch order must not matter either
        logits = pipe.executor.forward(chunks)
        by_id = {r.request_id: r for r in active}
        sampled = [by_id[c.request_id] for c in chunks if c.sample]
        for c in chunks:
            by_id[c.request_id].num_computed_tokens += c.num_new
        for r, s in zip(sampled, sampler.sample([r.request_id for r in sampled], logits), strict=True):
            r.append_token(s.token_id)
    assert 1 in chunk_sizes_seen and max(chunk_sizes_seen) > 1
    assert [r.output_token_ids for r in reqs] == alone
    for r in reqs:
        pipe.allocator.free(r.block_table)
    assert pipe.allocator.num_free == pipe.allocator.num_blocks
