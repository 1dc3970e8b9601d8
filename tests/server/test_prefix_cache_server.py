"""Prefix caching as clients see it: `usage.prompt_tokens_details.cached_tokens`, the metrics,
and the /flush_cache admin endpoint, against a live `ppserve serve` with two stages."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from live_server import LiveServer
from openai.types import CompletionUsage
from prometheus_client.parser import text_string_to_metric_families

from ppserve.engine.config import EngineConfig
from ppserve.server.app import flush_cache
from ppserve.server.errors import ApiError
from ppserve.server.state import STATE, ServerOptions, ServerState

SYSTEM = "You are a terse assistant for a pipeline-parallel serving engine. " * 12
BLOCK = 16  # the server's default --block-size


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)


def _metric(server: LiveServer, name: str) -> float:
    status, _, body = server.request("GET", "/metrics")
    assert status == 200
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} is not in /metrics")


def _chat(server: LiveServer, question: str, n: int = 1) -> tuple[list[str], int, int]:
    """(the choices' texts, prompt tokens, cached tokens) of a greedy chat completion."""
    resp = _client(server).chat.completions.create(
        model=server.model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=8,
        temperature=0,
        n=n,
    )
    assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
    cached = resp.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return [c.message.content or "" for c in resp.choices], resp.usage.prompt_tokens, cached


def _streamed_usage(server: LiveServer, prompt: str) -> CompletionUsage:
    stream = _client(server).completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = list(stream)[-1].usage
    assert usage is not None
    return usage


@pytest.mark.slow
def test_a_shared_system_prompt_is_reported_cached_and_changes_nothing(live_server: LiveServer) -> None:
    assert live_server.request("POST", "/flush_cache", {})[0] == 200
    hits_before = _metric(live_server, "ppserve_prefix_cache_hits_total")
    first, prompt_tokens, cached = _chat(live_server, "What is a stage?")
    assert cached == 0
    again, _, cached = _chat(live_server, "What is a stage?")
    assert again == first
    assert 0 < cached < prompt_tokens and cached % BLOCK == 0 and prompt_tokens - cached <= BLOCK
    _, other_tokens, other_cached = _chat(live_server, "And a micro-batch, what is that?")
    assert 0 < other_cached < other_tokens  # the system prompt, not the question
    assert _metric(live_server, "ppserve_prefix_cache_hits_total") - hits_before == cached + other_cached
    assert _metric(live_server, "ppserve_prefix_cache_blocks") > 0

    # n = 3: usage counts the prompt once, with its first choice's cached tokens.
    texts, _, n_cached = _chat(live_server, "What is a stage?", n=3)
    assert texts == [first[0]] * 3 and n_cached == cached

    # Streams and /generate report it too: the second of two equal streamed prompts finds it cached.
    streams = [_streamed_usage(live_server, SYSTEM + "Q: what is a stage?") for _ in range(2)]
    assert streams[1].prompt_tokens_details is not None and streams[1].prompt_tokens_details.cached_tokens
    assert streams[1].prompt_tokens_details.cached_tokens > 0
    body = {"text": SYSTEM + "Q: what is a stage?", "sampling_params": {"max_tokens": 4, "temperature": 0}}
    status, _, raw = live_server.request("POST", "/generate", body)
    assert status == 200 and json.loads(raw)["usage"]["cached_tokens"] > 0


@pytest.mark.slow
def test_flush_cache_needs_the_key_and_empties_the_cache(live_server: LiveServer) -> None:
    first, _, _ = _chat(live_server, "Flush me?")
    assert _chat(live_server, "Flush me?")[2] > 0
    status, _, body = live_server.request("POST", "/flush_cache", {}, headers={"Authorization": "Bearer wrong"})
    assert status == 401 and "API key" in json.loads(body)["error"]["message"]
    status, _, body = live_server.request("POST", "/flush_cache", {})
    assert status == 200 and json.loads(body)["freed_blocks"] > 0
    assert _metric(live_server, "ppserve_prefix_cache_blocks") == 0
    again, _, cached = _chat(live_server, "Flush me?")
    assert cached == 0 and again == first
    assert live_server.request("GET", "/flush_cache")[0] == 405


def test_a_flush_with_a_salt_prefix_forgets_only_those_blocks() -> None:
    """The scheduler: requests of two salts cache their blocks; flushing one salt's prefix frees
    its cached blocks and leaves the other's findable."""
    from scheduler_by_hand import drain, make, req

    s = make(pp=1, enable_prefix_caching=True)
    for salt in ("tenant:aa:1", "tenant:bb:1"):
        r = req(f"r-{salt}", 12)
        r.cache_salt = salt
        s.add(r)
    drain(s)
    cached = s.allocator.num_cached
    assert cached > 0
    assert s.flush_cache("tenant:aa:") == cached // 2
    again = req("again", 12)
    again.cache_salt = "tenant:bb:1"
    s.add(again)
    drain(s)
    assert again.num_cached_tokens and again.num_cached_tokens > 0
    gone = req("gone", 12)
    gone.cache_salt = "tenant:aa:1"
    s.add(gone)
    drain(s)
    assert gone.num_cached_tokens == 0


@pytest.mark.slow
def test_a_tenants_flush_empties_its_own_cache_and_the_admin_key_everyones(llama_dir: Path) -> None:
    key_a, key_b, admin = "tenant-a-key", "tenant-b-key", "the-admin-key"
    server = LiveServer(llama_dir, "--api-key", key_b, "--admin-key", admin, "--kv-cache-gb", "0.02", api_key=key_a)

    def cached(key: str) -> int:
        body = {"prompt": SYSTEM + "Q: who flushes?", "max_tokens": 1}
        status, _, raw = server.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {key}"})
        assert status == 200, raw
        return int(json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"])

    def flush(key: str) -> tuple[int, dict[str, object]]:
        status, _, raw = server.request("POST", "/flush_cache", {}, {"Authorization": f"Bearer {key}"})
        return status, json.loads(raw)

    try:
        for key in (key_a, key_b):
            cached(key)
            assert cached(key) > 0
        status, answer = flush(key_b)
        assert status == 200 and answer["scope"] == "tenant" and answer["freed_blocks"], answer
        assert cached(key_a) > 0  # A's prefixes are still there
        assert cached(key_b) == 0  # B's are gone (and cached again now)
        assert flush("not-the-admin-key")[0] == 401
        status, answer = flush(admin)
        assert status == 200 and answer["scope"] == "all" and answer["freed_blocks"], answer
        assert cached(key_a) == 0 and cached(key_b) == 0
    finally:
        assert server.stop() == 0, "".join(server.output)


async def test_flush_cache_is_refused_by_a_server_without_a_key(llama_dir: Path) -> None:
    app = web.Application()
    app[STATE] = ServerState(EngineConfig.create(llama_dir), ServerOptions(api_key=None))
    with pytest.raises(ApiError) as e:
        await flush_cache(make_mocked_request("POST", "/flush_cache", app=app))
    assert e.value.status == 403 and "--api-key" in str(e.value.body())
