"""Prompt logprobs over HTTP: /v1/completions with echo and logprobs, OpenAI's legacy shape (as
vLLM gives it), max_tokens 0 for scoring only, streaming, and the 400s; against a live
`ppserve serve` with two stages."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import pytest
from aiohttp import StreamReader, web
from aiohttp.test_utils import make_mocked_request
from helpers import hf_log_softmax, random_prompt
from live_server import LiveServer

from ppserve.engine.config import EngineConfig
from ppserve.engine.model.tokenizer import Tokenizer
from ppserve.server.errors import ApiError
from ppserve.server.openai_api import completions
from ppserve.server.state import STATE, ServerOptions, ServerState

TOL = 1e-4


def _post(server: LiveServer, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, _, raw = server.request("POST", "/v1/completions", {"model": server.model, "temperature": 0, **body})
    return status, json.loads(raw)


def _stream(server: LiveServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    status, _, raw = server.request(
        "POST", "/v1/completions", {"model": server.model, "stream": True, "temperature": 0, **body}
    )
    assert status == 200
    lines = [line.removeprefix("data: ") for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _check_prompt_part(lp: dict[str, Any], ids: list[int], ref: Any, tokenizer: Tokenizer, top_n: int) -> None:
    """The first len(ids) entries: the prompt's tokens, their logprobs and top dicts."""

    def decode(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False)

    tokens = [decode(t) for t in ids]
    assert lp["tokens"][: len(ids)] == tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(ids))]
    assert lp["text_offset"][: len(ids)] == offsets
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) <= TOL, i
        top = lp["top_logprobs"][i]
        assert tokens[i] in top and abs(top[tokens[i]] - lp["token_logprobs"][i]) <= TOL  # the prompt's own token
        # Tokens that decode alike (byte tokens: "\ufffd") share a key, as in vLLM's answers.
        best = ref[i - 1].topk(top_n).indices.tolist()
        for t in best:
            key = decode(t)
            assert any(abs(top[key] - ref[i - 1, u].item()) <= TOL for u in [*best, ids[i]] if decode(u) == key)
        assert len(top) <= top_n + 1


@pytest.mark.slow
def test_echo_with_logprobs_scores_the_prompt(live_server: LiveServer, llama_dir: Path) -> None:
    tokenizer = Tokenizer(llama_dir)
    ids = random_prompt(random.Random(4), 70)  # longer than a block: the second request could find it cached
    ref = hf_log_softmax(llama_dir, ids)

    # max_tokens 0: the prompt only, scored (lm-evaluation-harness's loglikelihood requests).
    status, body = _post(live_server, {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2})
    assert status == 200, body
    (choice,) = body["choices"]
    assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=False) and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    _check_prompt_part(choice["logprobs"], ids, ref, tokenizer, 2)
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)

    # With generated tokens: the prompt's entries, then those a plain request gets. The same
    # prompt again is computed again (a cached prefix has no logits), yet gives the same.
    plain_status, plain = _post(live_server, {"prompt": ids, "max_tokens": 3, "logprobs": 2, "ignore_eos": True})
    assert plain_status == 200
    status, echoed = _post(
        live_server, {"prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 2, "ignore_eos": True}
    )
    assert status == 200 and echoed["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the scoring request left its blocks
    lp, generated = echoed["choices"][0]["logprobs"], plain["choices"][0]["logprobs"]
    _check_prompt_part(lp, ids, ref, tokenizer, 2)
    echo_text = tokenizer.decode(ids, skip_special_tokens=False)
    assert echoed["choices"][0]["text"] == echo_text + plain["choices"][0]["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert lp[key][len(ids) :] == generated[key]
    assert lp["text_offset"][len(ids) :] == [len(echo_text) + o for o in generated["text_offset"]]

    # Streamed: the first chunk carries the prompt's entries, the joined chunks equal the answer.
    chunks = _stream(live_server, {"prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 2, "ignore_eos": True})
    joined: dict[str, list[Any]] = {key: [] for key in lp}
    for chunk in chunks:
        for key in joined:
            joined[key] += chunk["choices"][0]["logprobs"][key]
    # (The generated tokens' text offsets follow the streamed text, which holds back partial
    # characters; the prompt's are the same.)
    assert joined["text_offset"][: len(ids)] == lp["text_offset"][: len(ids)]
    assert {k: v for k, v in joined.items() if k != "text_offset"} == {
        k: v for k, v in lp.items() if k != "text_offset"
    }
    assert "".join(c["choices"][0]["text"] for c in chunks) == echoed["choices"][0]["text"]
    (only,) = _stream(live_server, {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2})
    assert only["choices"][0]["logprobs"] == choice["logprobs"] and only["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_text_prompts_and_several_choices(live_server: LiveServer, llama_dir: Path) -> None:
    tokenizer = Tokenizer(llama_dir)
    prompts = ["The pipeline stage", "Small bright garden"]
    status, body = _post(live_server, {"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 0, "n": 2})
    assert status == 200, body
    assert [c["text"] for c in body["choices"]] == [p for p in prompts for _ in range(2)]
    for i, c in enumerate(body["choices"]):
        ids = tokenizer.encode(prompts[i // 2])
        _check_prompt_part(c["logprobs"], ids, hf_log_softmax(llama_dir, ids), tokenizer, 0)
        assert all(len(top) == 1 for top in c["logprobs"]["top_logprobs"][1:])  # logprobs 0: its own token only


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"max_tokens": 0}, "max_tokens", "needs echo"),
        ({"max_tokens": 0, "logprobs": 1}, "max_tokens", "needs echo"),
        ({"max_tokens": -1, "echo": True}, "max_tokens", ">= 0"),
        ({"echo": True, "logprobs": 21}, "logprobs", "<= 20"),
    ],
)
def test_bad_combinations_are_400s(live_server: LiveServer, body: dict[str, Any], field: str, words: str) -> None:
    status, answer = _post(live_server, {"prompt": "Hi", **body})
    assert status == 400 and answer["error"]["param"] == field and words in answer["error"]["message"], answer


async def test_a_disaggregated_server_refuses_echo_with_logprobs(llama_dir: Path) -> None:
    app = web.Application()
    config = EngineConfig.create(llama_dir, disaggregation="decode", disagg_insecure=True)
    app[STATE] = ServerState(config, ServerOptions(api_key=None))
    body = json.dumps({"prompt": "Hi", "echo": True, "logprobs": 1, "max_tokens": 0}).encode()
    payload = StreamReader(Mock(), 2**16, loop=asyncio.get_running_loop())
    payload.feed_data(body)
    payload.feed_eof()
    request = make_mocked_request("POST", "/v1/completions", app=app, payload=payload)
    with pytest.raises(ApiError) as e:
        await completions(request)
    assert e.value.status == 400 and e.value.param == "echo" and "disaggregation" in e.value.message
