"""What a client may send: each list and string bounded (a 400 naming the field and the limit,
before any tokenizing), null taking the default, repetition_penalty reaching the sampler, and
numbers beyond float64 named. The app runs in-process on an engine stand-in that records what
reaches it: no stage processes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from stand_in_engine import StandInEngine

from ppserve.engine.config import EngineConfig
from ppserve.engine.model.tokenizer import Tokenizer
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.server.app import create_app
from ppserve.server.cli import build_parser, main
from ppserve.server.cli_clients import _limits
from ppserve.server.limits import RequestLimits
from ppserve.server.openapi import openapi_schema
from ppserve.server.state import STATE, ServerOptions

LIMITS = RequestLimits(max_stop=3, max_stop_chars=8, max_stop_token_ids=4, max_messages=3, max_content_parts=2)
COMP, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
USER = {"role": "user", "content": "hi"}


@pytest.fixture
async def client(llama_dir: Path) -> AsyncIterator[TestClient[Any, Any]]:
    app = create_app(EngineConfig.create(llama_dir, num_kv_blocks=8), ServerOptions(limits=LIMITS))
    app.cleanup_ctx.clear()  # no stages: the stand-in is the engine
    app[STATE].engine = StandInEngine(Tokenizer(llama_dir))  # type: ignore[assignment]
    async with TestClient(TestServer(app)) as c:
        yield c


def _engine(client: TestClient[Any, Any]) -> StandInEngine:
    engine: StandInEngine = client.app[STATE].engine
    return engine


async def _post(client: TestClient[Any, Any], path: str, body: Any) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with client.post(path, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


def _generate(**sampling: Any) -> dict[str, Any]:
    return {"text": "x", "sampling_params": {"max_tokens": 1, **sampling}}


# (path, body at the limit, body past it, param, limit flag)
CASES = [
    (COMP, {"prompt": "x", "stop": ["a", "b", "c"]}, {"prompt": "x", "stop": list("abcd")}, "stop", "--max-stop"),
    (COMP, {"prompt": "x", "stop": "a" * 8}, {"prompt": "x", "stop": "a" * 9}, "stop", "--max-stop-chars"),
    (GEN, _generate(stop=["b" * 8]), _generate(stop=["b", "b" * 9]), "sampling_params.stop", "--max-stop-chars"),
    (GEN, _generate(stop=list("xyz")), _generate(stop=list("wxyz")), "sampling_params.stop", "--max-stop"),
    (
        CHAT,
        {"messages": [USER], "stop_token_ids": [1, 2, 3, 4]},
        {"messages": [USER], "stop_token_ids": [1, 2, 3, 4, 5]},
        "stop_token_ids",
        "--max-stop-token-ids",
    ),
    (CHAT, {"messages": [USER] * 3}, {"messages": [USER] * 4}, "messages", "--max-messages"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 2}]},
        {"messages": [USER, {"role": "user", "content": [{"type": "text", "text": ""}] * 3}]},
        "messages",
        "--max-content-parts",
    ),
]


@pytest.mark.parametrize(("path", "at", "past", "param", "flag"), CASES)
async def test_each_limit(client: TestClient[Any, Any], path: str, at: Any, past: Any, param: str, flag: str) -> None:
    status, body = await _post(client, path, at)
    assert status == 200, body
    calls = len(_engine(client).params)
    status, body = await _post(client, path, past)
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"
    assert flag in body["error"]["message"] and param.rsplit(".", 1)[-1] in body["error"]["message"]
    assert len(_engine(client).params) == calls  # refused before it reached the engine


async def test_a_million_stop_strings_are_refused(llama_dir: Path) -> None:
    """With the default limits: the request that took 37 s is a 400 (and reaches nothing)."""
    app = create_app(EngineConfig.create(llama_dir, num_kv_blocks=8))
    app.cleanup_ctx.clear()
    app[STATE].engine = engine = StandInEngine(Tokenizer(llama_dir))  # type: ignore[assignment]
    async with TestClient(TestServer(app)) as client:
        status, body = await _post(client, COMP, {"prompt": "x", "stop": ["a"] * 1_000_000})
        assert status == 400 and body["error"]["param"] == "stop"
        assert "1000000 stop strings; the limit is 16 (--max-stop)" in body["error"]["message"]
        status, body = await _post(client, GEN, _generate(stop_token_ids=[1] * 1_000_000))
        assert status == 400 and body["error"]["param"] == "sampling_params.stop_token_ids"
        parts = [{"type": "text", "text": ""}] * 500_000
        status, body = await _post(client, CHAT, {"messages": [{"role": "user", "content": parts}]})
        assert status == 400 and body["error"]["param"] == "messages"
    assert engine.params == []


async def test_websocket_messages_have_the_limits(client: TestClient[Any, Any]) -> None:
    async with client.ws_connect("/ws") as ws:
        await ws.send_json({"type": "generate", "id": "a", **_generate(stop=list("abcd"))})
        event = await ws.receive_json()
        assert event["type"] == "error" and event["id"] == "a" and "--max-stop" in event["message"]
        await ws.send_json({"type": "chat", "id": "b", "messages": [USER] * 4})
        event = await ws.receive_json()
        assert event["type"] == "error" and "--max-messages" in event["message"]


_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
NULLS = dict.fromkeys((*_SAMPLING, "stop_token_ids", "stop", "seed", "max_tokens", "ignore_eos", "logprobs"))


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (GEN, {"text": "x", "sampling_params": NULLS, "stream": None}),
        (COMP, {"prompt": "x", **NULLS, "n": None, "user": None}),
        (CHAT, {"messages": [USER], **NULLS, "top_logprobs": None, "max_completion_tokens": None}),
    ],
)
async def test_null_takes_the_default(client: TestClient[Any, Any], path: str, body: Any) -> None:
    status, answer = await _post(client, path, body)
    assert status == 200, answer
    (params,) = _engine(client).params
    assert replace(params, max_tokens=1) == SamplingParams(max_tokens=1)


async def test_null_takes_the_default_on_the_websocket(client: TestClient[Any, Any]) -> None:
    async with client.ws_connect("/ws") as ws:
        await ws.send_json({"type": "generate", "id": "a", "text": "x", "sampling_params": NULLS})
        assert (await ws.receive_json())["type"] == "token"
    (params,) = _engine(client).params
    assert replace(params, max_tokens=1) == SamplingParams(max_tokens=1)


@pytest.mark.parametrize("path", [COMP, CHAT, GEN])
async def test_repetition_penalty_reaches_the_sampler(client: TestClient[Any, Any], path: str) -> None:
    def body(value: Any) -> dict[str, Any]:
        if path == GEN:
            return _generate(repetition_penalty=value)
        base = {"prompt": "x"} if path == COMP else {"messages": [USER]}
        return {**base, "max_tokens": 1, "repetition_penalty": value}

    assert (await _post(client, path, body(1.3)))[0] == 200
    assert _engine(client).params[-1].repetition_penalty == 1.3
    for bad in ("1.3", 0, 2.5):
        status, answer = await _post(client, path, body(bad))
        assert status == 400 and "repetition_penalty" in answer["error"]["param"], answer


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        (COMP, b'{"prompt": "x", "temperature": 1e999}', "temperature"),
        (GEN, b'{"text": "x", "sampling_params": {"top_p": -1e999}}', "sampling_params.top_p"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x", "w": 1e400}]}', "messages[0].w"),
    ],
)
async def test_a_number_beyond_float64_names_its_field(
    client: TestClient[Any, Any], path: str, raw: bytes, param: str
) -> None:
    status, body = await _post(client, path, raw)
    assert status == 400 and body["error"]["param"] == param, body
    assert param in body["error"]["message"]


async def test_strings_kept_but_unused_are_bounded(client: TestClient[Any, Any]) -> None:
    for field in ("user", "model"):
        status, body = await _post(client, COMP, {"prompt": "x", field: "u" * 257})
        assert status == 400 and body["error"]["param"] == field, body


async def test_the_openapi_document_shows_the_servers_limits(client: TestClient[Any, Any]) -> None:
    async with client.get("/openapi.json") as r:
        served = await r.json()
    assert served == openapi_schema(LIMITS) != openapi_schema()
    schemas = served["components"]["schemas"]
    stop = schemas["NativeSampling"]["properties"]["stop"]["anyOf"]
    assert {"type": "string", "minLength": 1, "maxLength": 8} in stop
    assert any(b.get("maxItems") == 3 and b["items"]["maxLength"] == 8 for b in stop)
    chat = schemas["ChatRequest"]["properties"]
    assert chat["messages"]["maxItems"] == 3
    assert chat["stop_token_ids"]["anyOf"][0]["maxItems"] == 4
    assert chat["user"]["anyOf"][0]["maxLength"] == 256
    content = schemas["ChatMessage"]["properties"]["content"]["anyOf"]
    assert [b["maxItems"] for b in content if b.get("type") == "array"] == [2]
    assert schemas["NativeSampling"]["properties"]["temperature"]["anyOf"][-1] == {"type": "null"}


def test_limit_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", "tiny-random", "--max-stop-token-ids", "0"])
    assert exit_info.value.code == 2
    assert "--max-stop-token-ids must be an integer >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--max-messages"):
        RequestLimits(max_messages=-1)
    args = build_parser().parse_args(["serve", "--max-stop", "4", "--max-stop-chars", "9", "--max-content-parts", "7"])
    assert _limits(args) == RequestLimits(max_stop=4, max_stop_chars=9, max_content_parts=7)
    args = build_parser().parse_args(["serve", "--max-stop-token-ids", "5", "--max-messages", "6"])
    assert _limits(args) == RequestLimits(max_stop_token_ids=5, max_messages=6)
