"""OpenAI's Responses API (POST /v1/responses) and Anthropic's Messages API (POST /v1/messages),
through the official `openai` and `anthropic` clients, unmodified, on the demo model at PP=2: a
plain reply, a JSON-schema reply and a tool call, each whole and streamed; the conversation's
earlier calls and their results as input; and bad requests as 400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from live_server import LiveServer

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]},
}
QUESTION = "What is the capital of France? Answer in one sentence."
# Anthropic's client no longer takes sampling fields; the API still does (greedy: replies compare).
GREEDY = {"temperature": 0}


def text_of(message: Any) -> str:
    block = message.content[0]
    assert block.type == "text", message
    return str(block.text)


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path) -> Iterator[LiveServer]:
    # float32 weights: whole and streamed replies are compared, and the second of two equal
    # requests starts from the first's cached prefix, which is bitwise exact in float32.
    srv = LiveServer(smollm2_gguf, "--pp-size", "2", "--kv-cache-gb", "0.05", "--quantization", "none")
    yield srv
    assert srv.stop() == 0, "".join(srv.output)


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)


@pytest.fixture(scope="module")
def claude(server: LiveServer) -> anthropic.Anthropic:
    # The client sends x-api-key (Anthropic's header), not Authorization.
    return anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0)


# ---- OpenAI's Responses API -----------------------------------------------------------------


def test_responses_plain_reply(oai: openai.OpenAI, server: LiveServer) -> None:
    r = oai.responses.create(model=server.model, input=QUESTION, instructions="Be brief.", max_output_tokens=24,
                             temperature=0)  # fmt: skip
    assert r.status in ("completed", "incomplete") and r.output_text.strip()
    assert r.output[0].type == "message" and r.usage is not None and r.usage.output_tokens <= 24
    parts: Any = [{"type": "input_text", "text": QUESTION}]
    items: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    again = oai.responses.create(model=server.model, input=items, max_output_tokens=24, temperature=0)
    assert again.output_text == r.output_text  # instructions are the system message
    with oai.responses.stream(model=server.model, input=QUESTION, instructions="Be brief.", max_output_tokens=24,
                              temperature=0) as stream:  # fmt: skip
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response() if r.status == "completed" else None
    assert "".join(deltas) == r.output_text and len(deltas) > 1
    if final is not None:
        assert final.output_text == r.output_text


def test_responses_json_schema_reply(oai: openai.OpenAI, server: LiveServer) -> None:
    text: Any = {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}}
    r = oai.responses.create(model=server.model, input="Name a large city and its population.", text=text,
                             max_output_tokens=60, temperature=0)  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    with oai.responses.stream(model=server.model, input="Name a large city and its population.", text=text,
                              max_output_tokens=60, temperature=0) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert final.output_text == r.output_text


def test_responses_tool_call_and_its_result(oai: openai.OpenAI, server: LiveServer) -> None:
    tools: list[Any] = [{"type": "function", **WEATHER, "strict": True}]
    ask: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = oai.responses.create(model=server.model, input=ask, tools=tools, tool_choice="required", max_output_tokens=80,
                             temperature=0)  # fmt: skip
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    assert all(set(json.loads(c.arguments)) == {"city"} for c in calls)  # strict: no keys beyond the schema
    with oai.responses.stream(model=server.model, input=ask, tools=tools, tool_choice="required",
                              max_output_tokens=80, temperature=0) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == [
        (c.name, c.arguments) for c in calls
    ]
    # The next turn: the calls and their outputs as input items.
    history: list[Any] = [*ask, *({"type": "function_call", "call_id": c.call_id, "name": c.name,
                                  "arguments": c.arguments} for c in calls)]  # fmt: skip
    history += [{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C"} for c in calls]
    answer = oai.responses.create(model=server.model, input=history, tools=tools, tool_choice="none",
                                  max_output_tokens=30, temperature=0)  # fmt: skip
    assert answer.output[0].type == "message" and answer.output_text.strip()


def test_responses_bad_requests(server: LiveServer) -> None:
    cases: list[tuple[dict[str, Any], str | None]] = [
        ({}, None),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "image_generation_call"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"input": "hi", "max_output_tokens": 0}, None),
        ({"input": "hi", "temperature": -1}, "temperature"),
        ({"input": "hi", "model": "other"}, "model"),
    ]
    for body, param in cases:
        status, _, raw = server.request("POST", "/v1/responses", body)
        answer = json.loads(raw)
        assert status == 400, (body, answer)
        if param is not None:
            assert answer["error"]["param"] == param, (body, answer)


# ---- Anthropic's Messages API ---------------------------------------------------------------


def test_messages_plain_reply(claude: anthropic.Anthropic, server: LiveServer) -> None:
    m = claude.messages.create(model=server.model, max_tokens=24, system="Be brief.", extra_body=GREEDY,
                               messages=[{"role": "user", "content": QUESTION}])  # fmt: skip
    assert m.type == "message" and m.role == "assistant" and m.stop_reason in ("end_turn", "max_tokens")
    assert m.content[0].type == "text" and text_of(m).strip() and m.usage.output_tokens <= 24
    system: Any = [{"type": "text", "text": "Be brief."}]
    with claude.messages.stream(model=server.model, max_tokens=24, system=system, extra_body=GREEDY,
                                messages=[{"role": "user", "content": QUESTION}]) as stream:  # fmt: skip
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == text_of(m) == text_of(final) and final.stop_reason == m.stop_reason


def test_messages_stop_sequence(claude: anthropic.Anthropic, server: LiveServer) -> None:
    m = claude.messages.create(model=server.model, max_tokens=40, extra_body=GREEDY,
                               messages=[{"role": "user", "content": QUESTION}])  # fmt: skip
    words = text_of(m).split()
    assert len(words) > 3
    cut = claude.messages.create(model=server.model, max_tokens=40, extra_body=GREEDY, stop_sequences=[words[2]],
                                 messages=[{"role": "user", "content": QUESTION}])  # fmt: skip
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == words[2]
    assert words[2] not in text_of(cut)


def test_messages_json_schema_reply(claude: anthropic.Anthropic, server: LiveServer) -> None:
    config: Any = {"format": {"type": "json_schema", "schema": SCHEMA}}
    ask: Any = [{"role": "user", "content": "Name a large city and its population."}]
    m = claude.messages.create(model=server.model, max_tokens=60, extra_body=GREEDY, output_config=config, messages=ask)
    jsonschema.validate(json.loads(text_of(m)), SCHEMA)
    with claude.messages.stream(model=server.model, max_tokens=60, extra_body=GREEDY, output_config=config,
                                messages=ask) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.content[0].type == "text" and text_of(final) == text_of(m)


def test_messages_tool_use_and_its_result(claude: anthropic.Anthropic, server: LiveServer) -> None:
    tools: Any = [
        {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
    ]
    ask: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = claude.messages.create(model=server.model, max_tokens=80, extra_body=GREEDY, tools=tools,
                               tool_choice={"type": "any"}, messages=ask)  # fmt: skip
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses and all(u.name == "get_weather" for u in uses)
    assert all(isinstance(u.input, dict) and "city" in u.input for u in uses)
    with claude.messages.stream(model=server.model, max_tokens=80, extra_body=GREEDY, tools=tools,
                                tool_choice={"type": "any"}, messages=ask) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    results: Any = [{"type": "tool_result", "tool_use_id": u.id, "content": "Sunny, 21 C"} for u in uses]
    turn: Any = [*ask, {"role": "assistant", "content": m.content}, {"role": "user", "content": results}]
    answer = claude.messages.create(model=server.model, max_tokens=30, extra_body=GREEDY, tools=tools,
                                    tool_choice={"type": "none"}, messages=turn)  # fmt: skip
    assert answer.content[0].type == "text" and text_of(answer).strip()


def test_messages_bad_requests_and_keys(server: LiveServer) -> None:
    ok = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    cases: list[tuple[dict[str, Any], str | None]] = [
        ({"messages": [{"role": "user", "content": "hi"}]}, None),  # max_tokens is required
        ({**ok, "messages": []}, "messages"),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
        ({**ok, "tools": [{"name": "bad name!", "input_schema": {}}]}, None),
        ({**ok, "tool_choice": {"type": "tool", "name": "missing"}}, "tool_choice"),
        ({**ok, "temperature": 3}, "temperature"),
        ({**ok, "model": "other"}, "model"),
    ]
    for body, param in cases:
        status, _, raw = server.request("POST", "/v1/messages", body)
        answer = json.loads(raw)
        assert status == 400, (body, answer)
        if param is not None:
            assert answer["error"]["param"] == param, (body, answer)
    # Anthropic's header carries the key as well as Bearer; a wrong one is refused either way.
    assert server.request("POST", "/v1/messages", ok, headers={"Authorization": "", "x-api-key": "test-key"})[0] == 200
    assert server.request("POST", "/v1/messages", ok, headers={"Authorization": "", "x-api-key": "wrong"})[0] == 401
