"""Structured outputs, tool calls and logit_bias over HTTP and the websocket, with the official
`openai` client unmodified, on the demo model."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from live_server import LiveServer
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field

from ppserve.server.tool_calls import MAX_PARALLEL_CALLS

pytestmark = pytest.mark.slow


class City(BaseModel):
    """Bounded, so that any sampled reply fits the tests' max_tokens: no extra fields (a small model
    adds them), short strings, a small integer."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=32)
    country: str = Field(max_length=32)
    population_millions: int = Field(ge=0, le=1000)


WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path) -> Iterator[LiveServer]:
    srv = LiveServer(smollm2_gguf, "--pp-size", "2", "--kv-cache-gb", "0.05")
    yield srv
    assert srv.stop() == 0, "".join(srv.output)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)


def _chat(server: LiveServer, **body: Any) -> tuple[int, dict[str, Any]]:
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 40, **body}
    code, _, raw = server.request("POST", "/v1/chat/completions", body)
    return code, json.loads(raw)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_parse_with_a_pydantic_model(client: OpenAI, server: LiveServer, stream: bool) -> None:
    messages: Any = [{"role": "user", "content": "Describe Paris as JSON."}]
    if not stream:
        completion = client.chat.completions.parse(
            model=server.model, messages=messages, response_format=City, max_tokens=200, temperature=0.8, seed=1
        )
        city = completion.choices[0].message.parsed
    else:
        with client.chat.completions.stream(
            model=server.model, messages=messages, response_format=City, max_tokens=200, temperature=0.8, seed=1
        ) as s:
            for _ in s:
                pass
            city = s.get_final_completion().choices[0].message.parsed
    assert isinstance(city, City)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip_with_tool_choice_required(client: OpenAI, server: LiveServer, stream: bool) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Lyon?"}]
    # Greedy: a sampled call may ramble inside its JSON strings past any token budget.
    kw: Any = {"model": server.model, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 100}
    kw["temperature"] = 0
    if not stream:
        reply = client.chat.completions.create(messages=messages, **kw)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls
    else:
        chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        deltas = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
        calls = deltas  # sent whole: one delta per call
    assert calls
    call = calls[0]
    assert call.id and call.type == "function" and call.function and call.function.name == "get_weather"
    args = json.loads(call.function.arguments or "")
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    # The round trip: the call and its result go back, and the model answers in text.
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.id, "type": "function", "function": call.function.model_dump()}],
        },
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    final = client.chat.completions.create(
        model=server.model, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=30
    )
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


@pytest.mark.parametrize("seed", [1, 2])
def test_required_parallel_calls_end(server: LiveServer, seed: int) -> None:
    """tool_choice "required" with parallel calls allowed, sampled: the array of calls closes by
    MAX_PARALLEL_CALLS (each call here is bounded: a short string and an enum) within 400 tokens,
    and the answer is tool calls, never raw text cut at max_tokens."""
    code, body = _chat(
        server, tools=[WEATHER], tool_choice="required", max_tokens=400, temperature=0.9, seed=seed,
        messages=[{"role": "user", "content": "Weather in Lyon, Paris and Nice?"}],
    )  # fmt: skip
    assert code == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    assert 1 <= len(choice["message"]["tool_calls"]) <= MAX_PARALLEL_CALLS


CITY: Any = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}
ZONE: Any = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}}}
OPEN_TOOLS: Any = [  # schemas that allow more keys than they list, as most clients write them
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": ZONE}},
]
QUESTIONS = [
    f"{q} {place}?"
    for q in ("What is the weather in", "What time is it in", "Should I take an umbrella in", "Is it night in")
    for place in ("Paris", "Tokyo", "Lima", "Oslo", "Cairo")
]


def test_required_tool_calls_end_on_twenty_prompts(server: LiveServer) -> None:
    """tool_choice "required" with two tools whose schemas are open, parallel calls allowed: every
    one of 20 prompts ends with tool calls (never text cut at max_tokens), each naming a tool and
    giving only the keys its schema lists (a small model copies the schema's own keywords in
    when it may); and under strict, every listed key."""
    bodies = [
        {"messages": [{"role": "user", "content": q}], "tools": OPEN_TOOLS, "tool_choice": "required",
         "max_tokens": 400, "temperature": 0}
        for q in QUESTIONS
    ]  # fmt: skip
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in OPEN_TOOLS]
    bodies += [{**b, "tools": strict} for b in bodies[:4]]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: _chat(server, **b), bodies))
    listed = {t["function"]["name"]: set(t["function"]["parameters"]["properties"]) for t in OPEN_TOOLS}
    for body, (code, answer) in zip(bodies, answers, strict=True):
        assert code == 200, answer
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
        for call in choice["message"]["tool_calls"]:
            keys = set(json.loads(call["function"]["arguments"]))
            allowed = listed[call["function"]["name"]]
            assert keys == allowed if body["tools"] is strict else keys <= allowed, (body, call)


def test_named_tool_choice_and_regex_and_choice(server: LiveServer) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    code, body = _chat(server, tools=[WEATHER], tool_choice=named, max_tokens=100)
    assert code == 200, body
    calls = body["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    code, body = _chat(server, structured_outputs={"regex": "[0-9]{3}-[0-9]{4}"}, temperature=0.9)
    assert code == 200 and re.fullmatch("[0-9]{3}-[0-9]{4}", body["choices"][0]["message"]["content"]), body
    code, body = _chat(server, structured_outputs={"choice": ["red", "green", "blue"]}, temperature=0.9)
    assert code == 200 and body["choices"][0]["message"]["content"] in ("red", "green", "blue"), body
    code, _, raw = server.request(
        "POST",
        "/generate",
        {"text": "Colour:", "sampling_params": {"structured_outputs": {"choice": ["cyan", "mauve"]}}},
    )
    assert code == 200 and json.loads(raw)["text"] in ("cyan", "mauve"), raw
    # Greedy: any object is allowed, so a sampled reply may run past max_tokens inside a string.
    code, body = _chat(server, response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    assert code == 200 and body["choices"][0]["finish_reason"] == "stop", body
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict), body


def test_bad_constraints_are_400s_naming_the_field(server: LiveServer) -> None:
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    unknown = {"type": "function", "function": {"name": "nope"}}
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"response_format": bad_schema}, "response_format", "strin"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
        ({"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs", "foo"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"99999999": 1}}, "prompt", "outside the vocabulary"),
        ({"tools": [WEATHER], "tool_choice": unknown}, "tool_choice", "nope"),
        ({"structured_outputs": {"regex": "a" * 70000}}, "structured_outputs", "more than"),
    ]  # fmt: skip
    for extra, field, words in cases:
        code, body = _chat(server, **extra)
        assert code == 400, (extra, body)
        assert body["error"]["param"] == field and words in body["error"]["message"], body
    code, body = _chat(server)  # and the server serves on
    assert code == 200


def _generate(server: LiveServer, **sp: Any) -> list[int]:
    code, _, raw = server.request("POST", "/generate", {"text": "Hello", "sampling_params": sp})
    assert code == 200, raw
    ids: list[int] = json.loads(raw)["token_ids"]
    return ids


def test_logit_bias_bans_and_forces_over_http(server: LiveServer) -> None:
    token = _generate(server, max_tokens=4, temperature=0)[0]
    for seed in range(3):
        assert token not in _generate(server, max_tokens=6, temperature=1.0, seed=seed, logit_bias={str(token): -100})
    assert _generate(server, max_tokens=4, temperature=1.0, ignore_eos=True, logit_bias={"42": 100}) == [42] * 4


async def test_websocket_chat_and_completions_take_constraints(server: LiveServer) -> None:
    constrained = {"max_tokens": 40, "temperature": 0.9, "structured_outputs": {"regex": "(yes|no), [0-9]{2}"}}
    async with (
        aiohttp.ClientSession(headers=server.headers) as session,
        session.ws_connect(server.url + "/ws") as ws,
    ):
        messages = [{"role": "user", "content": "Answer yes or no, and a number."}]
        await ws.send_json({"type": "chat", "id": "a", "messages": messages, "sampling_params": constrained})
        await ws.send_json({"type": "generate", "id": "b", "text": "Q:", "sampling_params": constrained})
        text = {"a": "", "b": ""}
        done: dict[str, Any] = {}
        while len(done) < 2:
            event = await ws.receive_json(timeout=60)
            if event["type"] == "token":
                text[event["id"]] += event["text"]
            elif event["type"] == "done":
                done[event["id"]] = event
            else:
                raise AssertionError(event)
    assert all(re.fullmatch("(yes|no), [0-9]{2}", t) for t in text.values()), text
    assert all(d["finish_reason"] == "stop" for d in done.values())
    schema = City.model_json_schema()
    for props in schema["properties"].values():
        props.setdefault("maxLength", 20) if props["type"] == "string" else props.update(maximum=99, minimum=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    body = {"model": server.model, "prompt": "A city:", "max_tokens": 120, "response_format": fmt}
    code, _, raw = server.request("POST", "/v1/completions", body)
    assert code == 200, raw
    City.model_validate_json(json.loads(raw)["choices"][0]["text"])
