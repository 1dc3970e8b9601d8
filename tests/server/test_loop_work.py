"""No work that grows with a request's input runs on the event loop: a 16 MiB body of numbers
that are slow to parse, and a chat template that runs away, leave every other client served.
(The chat template's sandbox and worker on their own: tests/model/test_chat_template.py.)"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from live_server import LiveServer
from procs import read
from stand_in_engine import StandInEngine

from ppserve.engine.config import EngineConfig
from ppserve.engine.model.chat_template import RenderBudget
from ppserve.engine.model.tokenizer import Tokenizer
from ppserve.server import json_body
from ppserve.server.app import create_app
from ppserve.server.json_body import decode, decode_async, peek_id
from ppserve.server.protocol import CompletionRequest
from ppserve.server.state import STATE, ServerOptions

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
USER = {"role": "user", "content": "hi"}
MAX_TOKEN_GAP_S = 1.0  # the bound on a bystander's stream (and /health) while the body is decoded
NESTED_RANGES = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# No call, attribute, item or operator inside the loops: only the worker's timer stops it.
HOOKLESS_LOOPS = "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"


def _exponents_body(size: int) -> bytes:
    """A valid completion request of `size` bytes, padded with an unknown field of 9e307s."""
    head, tail = b'{"prompt": "hi", "max_tokens": 2, "junk": [', b"]}"
    return head + b",".join([b"9e307"] * ((size - len(head) - len(tail)) // 6)) + tail


def test_floats_decode_exactly_as_msgspec_does() -> None:
    literals = ["1.5", "-0.0", "1e23", "9e307", "-9e307", "5e-324", "1.7976931348623157e308", "2.2250738585072014e-308"]
    raw = f'{{"prompt": "x", "temperature": 0.7, "junk": [{", ".join(literals)}]}}'
    assert decode(raw, CompletionRequest).temperature == 0.7
    values = json_body._DECODER.decode(raw)["junk"]
    assert values == msgspec.json.decode(raw)["junk"]
    assert [str(v) for v in values] == [str(float(s)) for s in literals]  # -0.0 too


async def test_large_bodies_decode_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[int] = []

    def spy(body: bytes | str, type_: type[Any]) -> Any:
        threads.append(threading.get_ident())
        return decode(body, type_)

    monkeypatch.setattr(json_body, "decode", spy)
    small, large = _exponents_body(json_body.INLINE_BODY_BYTES), _exponents_body(json_body.INLINE_BODY_BYTES + 6)
    assert (await decode_async(small, CompletionRequest)).prompt == "hi"
    assert (await decode_async(large, CompletionRequest)).prompt == "hi"
    assert threads[0] == threading.get_ident() != threads[1]


def test_a_websocket_message_id_is_peeked_without_building_the_rest() -> None:
    assert peek_id('{"junk": [' + ", ".join(["9e307"] * 1000) + '], "id": "r1"}') == "r1"
    for data in ('{"id": 5}', "[1]", "not json", '{"id": "' + "a" * 300 + '"}', '{"id": ""}'):
        assert peek_id(data) is None, data


@pytest.mark.slow
async def test_a_16_mib_body_of_huge_exponents_leaves_streams_and_health_alone(live_server: LiveServer) -> None:
    """Before: decoding this body held the event loop (and the GIL) for most of a minute."""
    body = _exponents_body(16 * 2**20 - 1024)
    arrivals: list[float] = []  # when each token of the bystander's stream arrived
    order: list[str] = []  # what the client saw, in the order it saw it
    async with aiohttp.ClientSession(headers=live_server.headers) as session:
        request = {"prompt": "Keep going", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        stream = await session.post(live_server.url + COMP, json=request)
        assert stream.status == 200
        new_token = asyncio.Condition()

        async def read_stream() -> None:
            async for line in stream.content:
                if line.startswith(b"data: {"):
                    arrivals.append(time.monotonic())
                    order.append("token")
                    async with new_token:
                        new_token.notify_all()

        async def tokens_at_least(n: int) -> None:
            async with new_token:
                await asyncio.wait_for(new_token.wait_for(lambda: order.count("token") >= n), 60)

        async def send_body() -> tuple[int, Any]:
            order.append("sent body")
            headers = {"Content-Type": "application/json"}
            async with session.post(live_server.url + COMP, data=body, headers=headers) as resp:
                answer = await resp.json()
            order.append("answered body")
            return resp.status, answer

        reader = asyncio.create_task(read_stream())
        await tokens_at_least(3)
        first = len(arrivals)
        big = asyncio.create_task(send_body())
        health_waits = []  # how long each /health took, while the body was in flight
        while not big.done():
            asked = time.monotonic()
            async with session.get(live_server.url + "/health") as resp:
                assert resp.status == 200
            health_waits.append(time.monotonic() - asked)
            if not big.done():
                order.append("health")
        status, answer = await big
        await tokens_at_least(order.count("token") + 3)  # the stream runs on
        reader.cancel()
        stream.close()
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer  # the unknown field is ignored
    during = order[order.index("sent body") : order.index("answered body")]
    assert during.count("health") >= 2 and "token" in during, order
    gaps = [b - a for a, b in zip(arrivals[first - 1 :], arrivals[first:], strict=False)]
    print(
        "DEBUG gaps max",
        max(gaps),
        "n",
        len(gaps),
        "health",
        during.count("health"),
        max(health_waits),
        "tokens during",
        during.count("token"),
    )
    assert max(gaps) <= MAX_TOKEN_GAP_S, f"the stream stalled for {max(gaps):.1f} s"
    assert max(health_waits) <= MAX_TOKEN_GAP_S, f"/health took {max(health_waits):.1f} s"


@pytest.fixture
async def client(llama_dir: Path) -> AsyncIterator[TestClient[Any, Any]]:
    app = create_app(EngineConfig.create(llama_dir, num_kv_blocks=8), ServerOptions())
    app.cleanup_ctx.clear()  # no stages: the stand-in is the engine
    app[STATE].engine = StandInEngine(Tokenizer(llama_dir))  # type: ignore[assignment]
    async with TestClient(TestServer(app)) as c:
        yield c
    app[STATE].engine.tokenizer.close()  # type: ignore[union-attr]


async def _post(client: TestClient[Any, Any], path: str, body: Any) -> tuple[int, dict[str, Any]]:
    async with client.post(path, data=json.dumps(body), headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


async def _chat(client: TestClient[Any, Any], order: list[str]) -> tuple[int, dict[str, Any]]:
    answer = await _post(client, CHAT, {"messages": [USER]})
    order.append("chat")
    return answer


def _cpu_ticks(pid: int) -> int:
    fields = read(pid, "stat").rsplit(b")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


async def test_a_runaway_chat_template_fails_alone(client: TestClient[Any, Any]) -> None:
    """A template that runs away is a 500 that blames the template, within its budget, while
    other requests are served; the model's own template then renders as transformers does."""
    engine: StandInEngine = client.app[STATE].engine
    tok = engine.tokenizer
    own = tok.hf.chat_template
    tok.template_budget = RenderBudget(seconds=2.0)
    cases = [
        (NESTED_RANGES, "range() more than"),
        ("{{ 'x' * 10**9 }}", "built a sequence of 1000000000"),
        ("{% for m in messages %}{% for i in range(99999) %}{{ m.content * 999 }}{% endfor %}{% endfor %}", "grew"),
        (HOOKLESS_LOOPS, "ran for more than 2 s"),
    ]
    for template, says in cases:
        tok.hf.chat_template = template
        order: list[str] = []
        task = asyncio.create_task(_chat(client, order))
        async with client.get("/health") as resp:
            assert resp.status == 200
        assert (await _post(client, COMP, {"prompt": "hi", "max_tokens": 1}))[0] == 200
        order.append("others")
        status, body = await task
        assert status == 500 and body["error"]["type"] == "server_error", body
        assert body["error"]["message"].startswith("the model's chat template failed: "), body
        assert says in body["error"]["message"], body
        if template is HOOKLESS_LOOPS:  # this one runs its whole budget: the others were served meanwhile
            assert order == ["others", "chat"]
    tok.hf.chat_template = own
    status, _ = await _post(client, CHAT, {"messages": [USER]})
    assert status == 200
    text = str(tok.hf.apply_chat_template([USER], add_generation_prompt=True, tokenize=False))
    assert engine.prompts[-1] == tok.encode(text, add_special_tokens=False)


async def test_shutdown_ends_a_render_in_progress(client: TestClient[Any, Any]) -> None:
    tok = client.app[STATE].engine.tokenizer
    assert (await _post(client, CHAT, {"messages": [USER]}))[0] == 200  # the worker is up, and idle
    pid = tok._templates.pid
    assert pid is not None
    idle = _cpu_ticks(pid)
    tok.hf.chat_template, tok.template_budget = HOOKLESS_LOOPS, RenderBudget(seconds=600.0)
    chat = asyncio.create_task(_post(client, CHAT, {"messages": [USER]}))
    while _cpu_ticks(pid) == idle:  # until the worker is rendering
        assert not chat.done(), chat.result()
        await asyncio.sleep(0.01)
    await client.app.shutdown()  # what SIGTERM runs (server/app.py shut_down)
    status, body = await asyncio.wait_for(chat, 60)  # a guard against a hang: the render had 600 s
    assert status == 500 and "shutting down" in body["error"]["message"], body
