"""No client can starve the others: one client (an API key on a server with several, else a
connection) holds at most `max_requests_per_client` running and waiting requests, and prompt
scoring with `n` scores the prompt once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from live_server import LiveServer

COMP = "/v1/completions"
KEY_A, KEY_B = "key-of-a", "key-of-b"
SHARE = 4


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[LiveServer]:
    """Two tenants, each allowed SHARE requests at once; room for many more in the queue."""
    server = LiveServer(
        llama_dir, "--api-key", KEY_B, "--max-requests-per-client", str(SHARE), "--kv-cache-gb", "0.02", api_key=KEY_A
    )
    yield server
    assert server.stop() == 0, "".join(server.output)


def _finished(server: LiveServer) -> float:
    return sum(v for k, v in server.metrics().items() if k.startswith("ppserve_requests_total"))


@pytest.mark.slow
async def test_one_websocket_with_3000_requests_leaves_room_for_another_client(server: LiveServer) -> None:
    """Client A's websocket asks for 3,000 long requests: SHARE of them run, the rest are refused
    at once, naming the limit. Client B's short request is served while A's are still running,
    and A over HTTP is refused too (429) while its socket holds its share."""
    headers = {"Authorization": f"Bearer {KEY_A}"}
    async with aiohttp.ClientSession() as session, session.ws_connect(server.url + "/ws", headers=headers) as ws:
        params = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}
        for i in range(3000):
            await ws.send_json({"type": "generate", "id": str(i), "text": "hello", "sampling_params": params})
        refused, started = 0, set[str]()
        while refused + len(started) < 3000:
            event = await ws.receive_json(timeout=120)
            if event["type"] == "error":
                assert "max_requests_per_client" in event["message"], event
                refused += 1
            elif event["type"] == "token":
                started.add(event["id"])
        assert len(started) == SHARE and refused == 3000 - SHARE

        body = {"prompt": "hi", "max_tokens": 2}
        status, _, answer = await asyncio.to_thread(
            server.request, "POST", COMP, body, {"Authorization": f"Bearer {KEY_B}"}
        )
        assert status == 200, answer
        status, _, answer = await asyncio.to_thread(server.request, "POST", COMP, body)  # A's key
        assert status == 429 and "max_requests_per_client" in json.loads(answer)["error"]["message"], answer
        done = set[str]()
        while len(done) < SHARE:  # B was answered before A's requests were done
            event = await ws.receive_json(timeout=120)
            if event["type"] == "done":
                done.add(event["id"])
        assert done == started


@pytest.mark.slow
def test_scoring_with_n_scores_the_prompt_once(server: LiveServer) -> None:
    """echo + logprobs + max_tokens 0 with n=12: twelve equal choices from one request's work."""
    body: dict[str, Any] = {"prompt": "the quick brown fox", "echo": True, "logprobs": 2, "max_tokens": 0}
    status, _, one = server.request("POST", COMP, body)
    assert status == 200, one
    before = _finished(server)
    status, _, twelve = server.request("POST", COMP, {**body, "n": 12})
    assert status == 200, twelve
    server.wait_until(lambda: _finished(server) >= before + 1, what="the request counted")
    assert _finished(server) == before + 1  # one stream for the twelve choices
    (expected,) = json.loads(one)["choices"]
    choices = json.loads(twelve)["choices"]
    assert [c["index"] for c in choices] == list(range(12))
    assert all({**c, "index": 0} == expected for c in choices)


def _choices(answer: bytes, stream: bool) -> list[dict[str, Any]]:
    """A completion's choices; a stream's chunks merged into them."""
    if not stream:
        return list(json.loads(answer)["choices"])
    merged: dict[int, dict[str, Any]] = {}
    for line in answer.decode().splitlines():
        if not line.startswith("data: {"):
            continue
        for c in json.loads(line[6:])["choices"]:
            m = merged.setdefault(c["index"], {"index": c["index"], "text": "", "logprobs": None})
            m["text"] += c["text"]
            m["finish_reason"] = c["finish_reason"]
            if c["logprobs"] is not None and m["logprobs"] is None:
                m["logprobs"] = c["logprobs"]
            elif c["logprobs"] is not None:
                for k, v in c["logprobs"].items():
                    m["logprobs"][k] += v
    return [merged[i] for i in sorted(merged)]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_n_shares_the_first_choices_prompt_logprobs(server: LiveServer, stream: bool) -> None:
    """echo + logprobs with generated tokens and n=3: only the first choice scores the prompt;
    every choice, echoed scores included, equals the answer of n=1, streaming or not."""
    body: dict[str, Any] = {"prompt": "one two three", "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0}
    status, _, one = server.request("POST", COMP, {**body, "stream": stream})
    assert status == 200, one
    (expected,) = _choices(one, stream)
    status, _, answer = server.request("POST", COMP, {**body, "n": 3, "stream": stream})
    assert status == 200, answer
    choices = _choices(answer, stream)
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all({**c, "index": 0} == expected for c in choices)  # greedy: the same in every choice
