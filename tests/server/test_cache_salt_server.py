"""Tenants through a live `ppserve serve`: with several API keys, each key's requests find only
their own cached prefixes (`cached_tokens` says so), a `cache_salt` separates within one key, and
`--prefix-cache-scope shared` lets keys share again. Each test uses prompts of its own."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from live_server import LiveServer

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
SMALL = ("--kv-cache-gb", "0.02")


def _prompt(topic: str) -> str:
    # The topic first: prompts of different tests share no block.
    return f"{topic}: " + "a long shared system prompt, " * 8  # several 16-token blocks


@pytest.fixture(scope="module")
def tenants_server(llama_dir: Path) -> Iterator[LiveServer]:
    """Two keys on the command line, the default scope (api-key)."""
    server = LiveServer(llama_dir, "--api-key", KEY_B, *SMALL, api_key=KEY_A)
    yield server
    assert server.stop() == 0, "".join(server.output)


@pytest.fixture(scope="module")
def shared_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Three keys from a file (blank lines between), the cache shared by all."""
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text(f"{KEY_A}\n\n  {KEY_B}  \nthird-key\n")
    server = LiveServer(
        llama_dir, "--api-key-file", str(key_file), "--prefix-cache-scope", "shared", *SMALL, api_key=None
    )
    server.api_key = KEY_A
    yield server
    assert server.stop() == 0, "".join(server.output)


def _post(server: LiveServer, path: str, body: dict[str, Any], key: str) -> tuple[int, dict[str, Any]]:
    status, _, raw = server.request("POST", path, body, headers={"Authorization": f"Bearer {key}"})
    return status, json.loads(raw)


def _cached(server: LiveServer, key: str, prompt: str, salt: str | None = None, path: str = "/v1/completions") -> int:
    """cached_tokens of a greedy request, as its endpoint reports it."""
    body: dict[str, Any]
    if path == "/v1/completions":
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    elif path == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "temperature": 0}
    else:
        body = {"text": prompt, "sampling_params": {"max_tokens": 2, "temperature": 0}}
    if salt is not None:
        body["cache_salt"] = salt
    status, answer = _post(server, path, body, key)
    assert status == 200, answer
    usage = answer["usage"]
    return int(usage["cached_tokens"] if path == "/generate" else usage["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_tenants_share_no_cached_prefixes(tenants_server: LiveServer, path: str) -> None:
    prompt = _prompt(f"stages {path}")
    assert _cached(tenants_server, KEY_A, prompt, path=path) == 0
    assert _cached(tenants_server, KEY_A, prompt, path=path) > 0  # a key finds its own
    assert _cached(tenants_server, KEY_B, prompt, path=path) == 0  # another key does not
    assert _cached(tenants_server, KEY_B, prompt, path=path) > 0
    # Within one key, a cache_salt separates; the same salt shares.
    assert _cached(tenants_server, KEY_A, prompt, "user-1", path=path) == 0
    assert _cached(tenants_server, KEY_A, prompt, "user-1", path=path) > 0
    assert _cached(tenants_server, KEY_B, prompt, "user-1", path=path) == 0  # the same salt, another key


@pytest.mark.slow
def test_each_key_is_accepted_and_a_wrong_one_refused(tenants_server: LiveServer) -> None:
    for key in (KEY_A, KEY_B):
        assert tenants_server.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})[0] == 200
    for wrong in ("wrong", KEY_A + KEY_B, KEY_A[:-1], ""):
        assert tenants_server.request("GET", "/v1/models", headers={"Authorization": f"Bearer {wrong}"})[0] == 401
    assert KEY_A not in "".join(tenants_server.output) and KEY_B not in "".join(tenants_server.output)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_a_bad_cache_salt_is_a_400(tenants_server: LiveServer, path: str) -> None:
    bases: dict[str, dict[str, Any]] = {
        "/v1/completions": {"prompt": "hi"},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
        "/generate": {"text": "hi"},
    }
    base = bases[path]
    for salt in ("", "s" * 257, 12, ["s"]):
        status, answer = _post(tenants_server, path, {**base, "cache_salt": salt}, KEY_A)
        assert status == 400 and answer["error"]["param"] == "cache_salt", answer


async def _ws_cached(server: LiveServer, prompt: str, key: str, header: bool, salt: str | None = None) -> list[int]:
    """cached_tokens of the same prompt sent twice on one socket (the key as header or as the
    first message)."""
    headers = {"Authorization": f"Bearer {key}"} if header else {}
    out = []
    async with aiohttp.ClientSession() as session, session.ws_connect(server.url + "/ws", headers=headers) as ws:
        if not header:
            await ws.send_json({"type": "auth", "api_key": key})
            assert (await ws.receive_json(timeout=60)) == {"type": "auth_ok"}
        for i in range(2):
            msg: dict[str, Any] = {
                "type": "generate",
                "id": f"g{i}",
                "text": prompt,
                "sampling_params": {"max_tokens": 2},
            }
            if salt is not None:
                msg["cache_salt"] = salt
            await ws.send_json(msg)
            while (event := await ws.receive_json(timeout=60))["type"] not in ("done", "error"):
                pass
            assert event["type"] == "done", event
            out.append(event["usage"]["cached_tokens"])
    return out


@pytest.mark.slow
def test_websocket_requests_are_their_keys_tenant(tenants_server: LiveServer) -> None:
    prompt = _prompt("websockets")
    assert _cached(tenants_server, KEY_A, prompt) == 0  # tenant A's, over HTTP
    first, second = asyncio.run(_ws_cached(tenants_server, prompt, KEY_B, header=False))
    assert first == 0 and second > 0  # the key sent as a message: tenant B
    first, second = asyncio.run(_ws_cached(tenants_server, prompt, KEY_A, header=True))
    assert first > 0 and second > 0  # the key as header: tenant A, who has it cached
    first, second = asyncio.run(_ws_cached(tenants_server, prompt, KEY_A, header=False, salt="ws"))
    assert first == 0 and second > 0


@pytest.mark.slow
def test_shared_scope_lets_keys_share(shared_server: LiveServer) -> None:
    prompt = _prompt("sharing")
    assert _cached(shared_server, KEY_A, prompt) == 0
    assert _cached(shared_server, KEY_B, prompt) > 0  # a key from the file's third line, blank lines skipped
    assert _cached(shared_server, "third-key", prompt) > 0
    assert _cached(shared_server, KEY_B, prompt, "mine") == 0  # only a salt separates
    assert _cached(shared_server, "third-key", prompt, "mine") > 0
    assert shared_server.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
