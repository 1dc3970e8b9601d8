"""Property-based fuzzing of the whole API, generated from its OpenAPI document (server/openapi.py).

- HTTP: schemathesis runs, per operation, the schema's boundary cases (its coverage phase) and
  EXAMPLES random requests, valid and invalid, and checks each answer: no 5xx (none inside an
  event stream either), status, content type, headers and body as documented, the API key
  enforced, other methods refused.
- Edge values: a small valid request per operation with each numeric field in turn set to the
  edges of int32 / int64 / float64.
- Websocket: messages generated from the WsMessage schema (valid and not, plus arbitrary text
  and bytes) over one connection; each must be answered, and the socket must stay open.
- Any answer later than HANG_S is a hang, a failure. Afterwards the server must answer a greedy
  request exactly as before the fuzzing, and have logged no error.

Reproducible: a fixed seed, Hypothesis derandomized.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import LiveServer

from ppserve.server.openapi import openapi_schema
from ppserve.server.responses import WsEvent

pytestmark = pytest.mark.slow

HANG_S = 10.0  # an answer later than this is a hang
EXAMPLES = 50  # random requests per operation, after the boundary cases
GREEDY = {"input_ids": [5, 6, 7, 8, 9, 10, 11, 12], "sampling_params": {"max_tokens": 16, "temperature": 0}}
SETTINGS = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


@dataclass
class Target:
    server: LiveServer
    greedy_before: list[int]  # token ids of GREEDY before any fuzzing


def _greedy(server: LiveServer) -> list[int]:
    status, _, body = server.request("POST", "/generate", GREEDY)
    assert status == 200, body
    ids: list[int] = json.loads(body)["token_ids"]
    return ids


@pytest.fixture(scope="module")
def target(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    # A short context keeps fuzzed requests cheap (a larger max_tokens is a 400): the costliest
    # request of a run takes about 1 s here, well under HANG_S. A request that names no max_tokens
    # gets the model's max_new_tokens (8 here), not the rest of the context: most valid fuzzed
    # chat requests name none, and generating 100 tokens each took most of the run.
    model = tmp_path_factory.mktemp("fuzzed-model")
    for f in llama_dir.iterdir():
        if f.name != "generation_config.json":
            (model / f.name).symlink_to(f)
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 8}))
    server = LiveServer(
        model, "--pp-size", "2", "--kv-cache-gb", "0.02", "--max-model-len", "128", "--tensor-transport", "shm"
    )
    try:
        yield Target(server, _greedy(server))
    finally:
        code = server.stop()
    assert code == 0, "".join(server.output)


# ---- HTTP ---------------------------------------------------------------------------------

# Loaded when the module is (so each operation is a test of its own) from the document the server
# serves (test_openapi.py checks they are the same). Not `schemathesis.pytest.from_fixture`: its
# lazy loader fails on pytest 9.2 (it sets `Node._nodeid`, which pytest no longer has).
schema = schemathesis.openapi.from_dict(
    openapi_schema(),
    config=schemathesis.Config.from_dict(
        {
            "seed": 1,
            # The API key comes from the test; the ignored_auth check also sends each request without.
            "generation": {"max-examples": EXAMPLES, "deterministic": True, "with-security-parameters": False},
            "phases": {"stateful": {"enabled": False}},  # no links between operations to follow
            # The schema cannot say everything the server checks (context length, exactly one of
            # text and input_ids...): a valid-looking body may get a 400.
            "checks": {"positive_data_acceptance": {"enabled": False}},
            "output": {"sanitization": {"enabled": False}},  # show max_tokens etc. in reports
        }
    ),
)


def _whole(value: Any) -> Any:
    """`value` with whole floats as integers. JSON Schema counts 2.0 as an integer, the server
    does not (a 400); left as they are, most generated bodies would stop at that."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole(v) for v in value]
    return value


@schema.parametrize()
@SETTINGS
def test_http_api(case: schemathesis.Case, target: Target) -> None:
    case.body = _whole(case.body)
    _call(case, target)


def _call(case: schemathesis.Case, target: Target, headers: dict[str, str] | None = None) -> None:
    """Send `case` and check the answer (schemathesis' checks, and no error event >= 500)."""
    headers = {**target.server.headers, **(headers or {})}
    response = case.call_and_validate(base_url=target.server.url, headers=headers, timeout=HANG_S)
    # A stream that failed after its 200 ends with an error event instead of a status.
    streamed = response.headers.get("content-type", [""])[0].startswith("text/event-stream")
    for line in response.text.splitlines() if streamed else []:
        if line.startswith("data: {"):
            code = json.loads(line[6:]).get("error", {}).get("code", 0)
            assert code < 500, f"{case.method} {case.path} {case.body!r}: the stream ended with {line}"


# ---- edge values ----------------------------------------------------------------------------
# Random bodies seldom are valid but for one extreme field; this sweep is: a small valid request
# per operation, with each numeric field of its schema (found there, so new fields are covered)
# set in turn to values at the edges of int32 / int64 / float64, where overflow bugs live.

BASES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2, "n": 2},  # n = 2: seed + i for choice i
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "n": 2,
        "logprobs": True,
    },
    "/generate": {"text": "hi", "sampling_params": {"max_tokens": 2}},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/embeddings": {"input": "hi"},
}
EDGES: dict[str, list[Any]] = {
    "integer": [-1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30],
    "number": [5e-324, 1e-300, -0.0, 1e308, 2**64, 10**30],
}


def _slots(prop: dict[str, Any], depth: int = 0) -> set[tuple[str, int]]:
    """(JSON type, array depth) of the numbers a property can hold: ("integer", 1) for [int]."""
    kind = prop.get("type")
    found = {(kind, depth)} if kind in EDGES else set()
    if kind == "array" and isinstance(prop.get("items"), dict):
        found |= _slots(prop["items"], depth + 1)
    for branch in prop.get("anyOf", []):
        found |= _slots(branch, depth)
    return found


def _edge_cases() -> list[Any]:
    doc = openapi_schema()
    components = doc["components"]["schemas"]
    cases = []
    for path, base in BASES.items():
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        objects: list[tuple[tuple[str, ...], dict[str, Any]]] = [((), components[ref.rsplit("/", 1)[1]])]
        if "sampling_params" in base:
            objects.append((("sampling_params",), components["NativeSampling"]))
        for prefix, obj in objects:
            for name, prop in obj["properties"].items():
                for kind, depth in sorted(_slots(prop)):
                    for value in EDGES[kind]:
                        body = _with(base, (*prefix, name), _nest(value, depth))
                        if name == "input_ids":
                            del body["text"]  # exactly one of them
                        label = f"{path} {'.'.join((*prefix, name))}={_nest(value, depth)!r}"
                        cases.append(_param("POST", path, body, {}, label))
    # Header values that are not UTF-8 (requests sends str headers as latin-1).
    cases.append(_param("GET", "/v1/models", None, {"Authorization": "Bearer \xff"}, "non-UTF-8 Authorization"))
    return cases


def _param(method: str, path: str, body: Any, headers: dict[str, str], label: str) -> Any:
    return pytest.param(method, path, body, headers, id=label)


def _nest(value: Any, depth: int) -> Any:
    return _nest([value], depth - 1) if depth else value


def _with(body: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """A copy of `body` with body[path[0]][path[1]]... = value."""
    head, *rest = path
    inner = body.get(head, {})
    return {**body, head: _with(inner, tuple(rest), value) if rest else value}


@pytest.mark.parametrize(("method", "path", "body", "headers"), _edge_cases())
def test_edge_values(target: Target, method: str, path: str, body: Any, headers: dict[str, str]) -> None:
    operation = schema[path][method]
    case = operation.Case(body=body) if body is not None else operation.Case()
    _call(case, target, headers)


# ---- websocket ----------------------------------------------------------------------------


def _ws_messages() -> st.SearchStrategy[Any]:
    """Messages from the WsMessage schema, valid and not, plus arbitrary text and bytes."""
    doc = openapi_schema()
    ref = "#/components/schemas/WsMessage"
    body = {"required": True, "content": {"application/json": {"schema": {"$ref": ref}}}}
    operation = {"requestBody": body, "responses": {"200": {"description": "answered by events"}}}
    messages = schemathesis.openapi.from_dict(
        {**doc, "paths": {"/ws": {"post": operation}}}, config=schemathesis.Config.from_dict({"seed": 1})
    )["/ws"]["POST"]
    generated = messages.as_strategy() | messages.as_strategy(schemathesis.GenerationMode.NEGATIVE)
    return generated.map(lambda case: _whole(case.body)) | st.text() | st.binary()


@dataclass
class Socket:
    """One websocket to the target, kept open across examples, driven from its own event loop."""

    loop: asyncio.AbstractEventLoop
    session: aiohttp.ClientSession
    ws: aiohttp.ClientWebSocketResponse

    def exchange(self, message: Any) -> list[dict[str, Any]]:
        return self.loop.run_until_complete(self._exchange(message))

    async def _exchange(self, message: Any) -> list[dict[str, Any]]:
        """Send one message; return its events, up to the one that ends it (done or error)."""
        if isinstance(message, bytes):
            await self.ws.send_bytes(message)
        else:
            await self.ws.send_str(message if isinstance(message, str) else json.dumps(message))
        rid = message.get("id") if isinstance(message, dict) else None
        expected_id = rid if isinstance(rid, str) else None
        events: list[dict[str, Any]] = []
        while True:
            try:
                reply = await self.ws.receive(timeout=HANG_S)
            except TimeoutError:
                raise AssertionError(f"no answer within {HANG_S} s to {message!r}; so far {events}") from None
            assert reply.type == aiohttp.WSMsgType.TEXT, f"the socket closed after {message!r}: {reply}"
            event = json.loads(reply.data)
            msgspec.convert(event, WsEvent)  # as documented
            assert event.get("id") == expected_id, f"{event} answers {message!r}?"  # auth_ok has none
            events.append(event)
            if event["type"] != "token":
                return events


@pytest.fixture(scope="module")
def socket(target: Target) -> Iterator[Socket]:
    async def connect() -> tuple[aiohttp.ClientSession, aiohttp.ClientWebSocketResponse]:
        session = aiohttp.ClientSession()
        return session, await session.ws_connect(target.server.url + "/ws", headers=target.server.headers)

    loop = asyncio.new_event_loop()
    session, ws = loop.run_until_complete(connect())
    try:
        yield Socket(loop, session, ws)
    finally:
        loop.run_until_complete(ws.close())
        loop.run_until_complete(session.close())
        loop.close()


@given(message=_ws_messages())
@settings(SETTINGS, max_examples=2 * EXAMPLES)
def test_websocket_messages(socket: Socket, message: Any) -> None:
    events = socket.exchange(message)
    last = events[-1]
    assert not (last["type"] == "error" and last["message"].startswith("internal error")), (message, last)


# ---- afterwards (tests run in file order) -------------------------------------------------


def test_server_unharmed(target: Target, socket: Socket) -> None:
    assert _greedy(target.server) == target.greedy_before
    assert socket.exchange({"type": "cancel", "id": "x"})[-1]["type"] == "error"  # the socket is still open
    status, _, _ = target.server.request("GET", "/health")
    assert status == 200
    errors = [line for line in target.server.output if " ERROR " in line or line.startswith("Traceback")]
    assert not errors, "".join(target.server.output)
