"""Embeddings from the served causal LM (AsyncEngine.embed, POST /v1/embeddings): the last token's
final hidden state, L2-normalized, equal to transformers' within 1e-5 in float32 at PP 1 and 3,
whether the prompt is one chunk, many, or starts from a cached prefix, and beside generation
that it leaves unchanged; OpenAI's input forms and encodings; bad input is a 400 naming the field."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import struct
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from helpers import random_prompt
from live_server import LiveServer

from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.config import EngineConfig
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.server.responses import EmbeddingList

TOL = 1e-5
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def hf_embeddings(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' last_hidden_state at each prompt's last token, L2-normalized (float32)."""
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.nn.functional.normalize(hf(torch.tensor([p])).last_hidden_state[0, -1], dim=-1) for p in prompts]


def engine_config(model_dir: Path, pp: int) -> EngineConfig:
    return EngineConfig.create(
        model_dir,
        pp_size=pp,
        tensor_transport="shm",
        threads_per_stage=1,
        block_size=8,
        num_kv_blocks=128,
        chunked_prefill_size=16,  # the 50-token prompts take four chunks
        enable_prefix_caching=True,
    )


@pytest.mark.parametrize("pp", [1, pytest.param(3, marks=pytest.mark.slow)])
async def test_embeddings_equal_transformers(llama_dir: Path, pp: int) -> None:
    rng = random.Random(7)
    system = random_prompt(rng, 48)
    prompts = [random_prompt(rng, 1), random_prompt(rng, 5), system + random_prompt(rng, 3), [*system, 9, 10]]
    generated = random_prompt(rng, 20)
    async with AsyncEngine(engine_config(llama_dir, pp)) as engine:
        alone = [t async for out in engine.generate(generated, GREEDY) for t in out.token_ids]
        first = await engine.embed(prompts[2])  # its blocks are cached for the last prompt

        async def tokens() -> list[int]:
            return [t async for out in engine.generate(generated, GREEDY) for t in out.token_ids]

        together = asyncio.create_task(tokens())  # generation in the same micro-batches
        outs = await asyncio.gather(*(engine.embed(p) for p in prompts))
        beside = await together
        text = await engine.embed("a prompt as text")
        assert engine.scheduler.allocator.num_free == 128  # none leaked (cached ones count as free)
    assert beside == alone
    assert first.embedding == outs[2].embedding  # cached or not, the same vector
    assert outs[3].cached_tokens >= 40 and first.finish_reason == "stop" and first.token_ids == []
    for out, ref in zip(outs, hf_embeddings(llama_dir, prompts), strict=True):
        assert out.embedding is not None and len(out.embedding) == ref.numel()
        assert torch.allclose(torch.tensor(out.embedding), ref, atol=TOL, rtol=0), out.request_id
    assert text.embedding is not None and text.prompt_tokens > 1


def _post(server: LiveServer, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, _, raw = server.request("POST", "/v1/embeddings", body)
    return status, json.loads(raw)


def test_embeddings_endpoint(live_server: LiveServer, llama_dir: Path) -> None:
    """OpenAI's four input forms give the same vectors; base64 is those vectors' float32 bytes."""
    ids = [[5, 17, 33, 8], [40, 41]]
    status, answer = _post(live_server, {"input": ids, "model": live_server.model})
    assert status == 200 and answer["object"] == "list" and answer["model"] == live_server.model, answer
    msgspec.convert(answer, EmbeddingList)  # as documented
    assert [d["index"] for d in answer["data"]] == [0, 1] and answer["usage"]["prompt_tokens"] == 6
    vectors = [d["embedding"] for d in answer["data"]]
    for got, ref in zip(vectors, hf_embeddings(llama_dir, ids), strict=True):
        assert torch.allclose(torch.tensor(got), ref, atol=TOL, rtol=0)
    status, one = _post(live_server, {"input": ids[1], "encoding_format": "base64", "dimensions": 64})
    assert status == 200 and len(one["data"]) == 1
    raw = base64.b64decode(one["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == vectors[1]
    status, texts = _post(live_server, {"input": ["hello there", "hello there"]})
    assert status == 200 and texts["data"][0]["embedding"] == texts["data"][1]["embedding"]


def test_embeddings_bad_input_is_a_400_naming_the_field(live_server: LiveServer) -> None:
    cases: list[tuple[dict[str, Any], str | None]] = [
        ({}, None),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": {"text": "a"}}, "input"),
        ({"input": [[1, -2]]}, "input"),
        ({"input": [1, 512]}, "input"),  # outside the vocabulary
        ({"input": "a", "dimensions": 8}, "dimensions"),
        ({"input": "a", "encoding_format": "hex"}, None),
        ({"input": "a", "model": "other"}, "model"),
        ({"input": "a", "extra": 1}, None),
        ({"input": ["a"] * 100_000}, "input"),  # more than the queue can ever hold
    ]
    for body, param in cases:
        status, answer = _post(live_server, body)
        assert status == 400, (body, answer)
        assert "message" in answer["error"]
        if param is not None:
            assert answer["error"]["param"] == param, (body, answer)
    assert live_server.request("GET", "/health")[0] == 200
