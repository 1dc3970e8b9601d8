"""The official `openai` client against a live `ppserve serve` with two stages."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
from live_server import ROOT, LiveServer
from openai.types.chat import ChatCompletionMessageParam

pytestmark = pytest.mark.slow

PROMPTS = ["The pipeline stage", "Small bright garden 東京 and"]
TOKENS = 16


def _client(server: LiveServer, api_key: str | None = None) -> openai.OpenAI:
    # max_retries=0: the client would otherwise retry 5xx answers and hide them from the test.
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key or server.api_key, max_retries=0)


def _generate(server: LiveServer, prompt: str, *flags: str) -> str:
    """The same request through `ppserve generate` (its own stages, same model and pp size)."""
    cmd = [sys.executable, "-m", "ppserve.server.cli", "generate", "--model", server.model, "--pp-size", "2"]
    cmd += ["--kv-cache-gb", "0.02", "--prompt", prompt, "--max-tokens", str(TOKENS), "--temperature", "0", "--json"]
    out = subprocess.run([*cmd, *flags], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    return str(json.loads(out.stdout)["text"])


@pytest.fixture(scope="module")
def reference(live_server: LiveServer) -> dict[str, str]:
    ref = {p: _generate(live_server, p) for p in PROMPTS}
    ref["chat"] = _generate(live_server, PROMPTS[0], "--chat")
    return ref


def test_completions_equal_ppserve_generate(live_server: LiveServer, reference: dict[str, str]) -> None:
    client = _client(live_server)
    # Both prompts in one request: each choice is the greedy output of its prompt.
    resp = client.completions.create(model=live_server.model, prompt=PROMPTS, max_tokens=TOKENS, temperature=0)
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == [reference[p] for p in PROMPTS]
    assert all(c.finish_reason in ("length", "stop") for c in resp.choices)
    assert resp.usage is not None and resp.usage.completion_tokens > 0

    stream = client.completions.create(
        model=live_server.model,
        prompt=PROMPTS[1],
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference[PROMPTS[1]]
    usage = chunks[-1].usage
    assert (
        usage is not None
        and usage.prompt_tokens > 0
        and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    )


def test_chat_equals_ppserve_generate(live_server: LiveServer, reference: dict[str, str]) -> None:
    client = _client(live_server)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPTS[0]}]
    resp = client.chat.completions.create(model=live_server.model, messages=messages, max_tokens=TOKENS, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == reference["chat"]

    stream = client.chat.completions.create(
        model=live_server.model,
        messages=messages,
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference["chat"]
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_sampling_fields_and_logprobs(live_server: LiveServer) -> None:
    client = _client(live_server)
    one, two = (
        client.completions.create(
            model=live_server.model,
            prompt=PROMPTS[0],
            max_tokens=8,
            temperature=0.8,
            top_p=0.9,
            seed=7,
            extra_body={"top_k": 20, "min_p": 0.05},
        )
        for _ in range(2)
    )
    assert one.choices[0].text == two.choices[0].text  # same seed, same text

    resp = client.completions.create(
        model=live_server.model, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == 4 and all(len(top) <= 3 for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(
        x <= 0 and abs(x - max(top.values())) < 1e-5 for x, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True)
    )

    chat = client.chat.completions.create(
        model=live_server.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        n=2,
        logprobs=True,
        top_logprobs=2,
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)

    echo = client.completions.create(model=live_server.model, prompt="Echo me", max_tokens=2, echo=True)
    assert echo.choices[0].text.startswith("Echo me")
    assert [m.id for m in client.models.list()] == [live_server.model]


def test_errors_are_client_exceptions(live_server: LiveServer) -> None:
    client = _client(live_server)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=live_server.model, prompt="x", temperature=-1)
    assert bad.value.status_code == 400 and "temperature" in str(bad.value)
    with pytest.raises(openai.BadRequestError, match="model"):
        client.completions.create(model="not-this-one", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=live_server.model, prompt="x", max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=live_server.model, messages=[])
    with pytest.raises(openai.AuthenticationError) as auth:
        _client(live_server, api_key="wrong").completions.create(model=live_server.model, prompt="x")
    assert auth.value.status_code == 401
