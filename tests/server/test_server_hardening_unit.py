"""Request guards that need no server: tokenizing off the event loop, the browser checks'
helpers, quiet client disconnects, and the key-file flag's errors. (Against a live server:
test_server_hardening.py.)"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from aiohttp.client_exceptions import ClientConnectionResetError
from aiohttp.http_exceptions import BadStatusLine
from aiohttp.test_utils import make_mocked_request
from live_server import ROOT

from ppserve.engine.model.tokenizer import Tokenizer
from ppserve.server import tokens
from ppserve.server.client_errors import quiet_client_errors
from ppserve.server.errors import ApiError
from ppserve.server.security import bearer_token, host_allowed, origin_allowed
from ppserve.server.streams import sse_response


class _SpyTokenizer(Tokenizer):
    """Records which thread each tokenizer call ran on."""

    calls: list[tuple[str, int]]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append(("encode", threading.get_ident()))
        return super().encode(text, add_special_tokens)

    def decode(self, token_ids: Any, skip_special_tokens: bool = True) -> str:
        self.calls.append(("decode", threading.get_ident()))
        return super().decode(token_ids, skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: Any = None) -> str:
        self.calls.append(("render", threading.get_ident()))
        return super().render_chat(messages, add_generation_prompt, tools)


async def test_large_inputs_are_tokenized_off_the_loop(llama_dir: Path) -> None:
    spy = _SpyTokenizer(llama_dir)
    spy.calls = []
    loop_thread, context = threading.get_ident(), 2048
    words = "the pipeline café 東京 " * 1000  # 21 K characters: large, yet within the bound
    assert len(words) <= context * spy.max_token_chars

    assert await tokens.encode(spy, "short", context, "prompt") == spy.encode("short")
    assert spy.calls[0] == ("encode", loop_thread)  # small: inline, a thread hop costs more
    spy.calls.clear()
    ids = await tokens.encode(spy, words, context, "prompt")
    await tokens.encode_chat(spy, [{"role": "user", "content": words}], True, context)
    await tokens.decode(spy, ids)
    assert [name for name, _ in spy.calls] == ["encode", "render", "encode", "decode"]
    assert all(thread != loop_thread for _, thread in spy.calls), spy.calls

    # Over the bound: refused from the length alone, nothing is tokenized.
    spy.calls.clear()
    over = "x" * (context * spy.max_token_chars + 1)
    for coro, field in [
        (tokens.encode(spy, over, context, "text"), "text"),
        (tokens.encode_chat(spy, [{"role": "user", "content": over}], True, context), "messages"),
    ]:
        with pytest.raises(ApiError) as refused:
            await coro
        assert refused.value.status == 400 and refused.value.param == field
    assert [name for name, _ in spy.calls] == ["render"]  # the template ran; its text was never tokenized


def test_security_helpers() -> None:
    for host in ("localhost", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST.", "127.0.0.2:80", None):
        assert host_allowed(host, "127.0.0.2"), host
    assert not host_allowed("evil.example:8000", "127.0.0.1")
    assert not host_allowed("127.0.0.1.evil.example", "localhost")
    assert host_allowed("evil.example", "0.0.0.0") and host_allowed("evil.example", None)  # not loopback-bound

    assert origin_allowed(None, "localhost:8000", ())  # not a browser
    assert origin_allowed("http://localhost:8000", "localhost:8000", ())
    assert not origin_allowed("http://evil.example", "localhost:8000", ())
    assert not origin_allowed("null", "", ())  # opaque origins are never "the same"
    assert origin_allowed("https://App.example/", "localhost:8000", ("https://app.example",))
    assert origin_allowed("http://evil.example", "localhost:8000", ("*",))

    assert bearer_token("bearer k") == bearer_token("Bearer  k") == b"k"
    assert bearer_token("Basic k") == b""
    assert bearer_token("Bearer \udcff\udcfe") != b""  # a non-UTF-8 header: bytes, not a crash


def test_api_key_file_errors_are_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for flags, message in [
        (["--api-key-file", str(tmp_path / "missing")], "cannot read"),
        (["--api-key-file", str(empty)], "is empty"),
        (["--api-key-file", str(empty), "--api-key", "k"], "not allowed with"),
        (["--allowed-origins", "app.example"], "expected origins like"),
    ]:
        res = subprocess.run(
            [sys.executable, "-m", "ppserve.server.cli", "serve", *flags],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.returncode == 2 and len(lines) == 1 and message in lines[0], res.stderr


async def test_a_client_gone_mid_stream_ends_the_stream_quietly(caplog: pytest.LogCaptureFixture) -> None:
    """The server's write fails once the client is gone (before aiohttp cancels the handler):
    the stream ends, its requests are aborted, and nothing is logged above INFO."""
    closed: list[bool] = []

    async def events() -> AsyncGenerator[dict[str, Any], None]:
        try:
            for i in range(5):
                yield {"i": i}
        finally:
            closed.append(True)  # closing the events is what aborts the engine requests

    writer = mock.Mock(write_headers=mock.AsyncMock(), write_eof=mock.AsyncMock(), drain=mock.AsyncMock())
    writer.write = mock.AsyncMock(side_effect=[None, ClientConnectionResetError("Cannot write to closing transport")])
    with caplog.at_level(logging.INFO):
        response = await sse_response(make_mocked_request("POST", "/v1/completions", writer=writer), events())
    assert response.prepared and closed == [True] and writer.write.await_count == 2
    assert [r.levelname for r in caplog.records] == ["INFO"]


def test_client_mistakes_reach_the_log_as_info(caplog: pytest.LogCaptureFixture) -> None:
    quiet_client_errors()
    logger = logging.getLogger("aiohttp.server")
    with caplog.at_level(logging.INFO, logger="aiohttp.server"):
        for exc in (BadStatusLine("GET / HTTP/9.9"), ClientConnectionResetError("gone"), RuntimeError("a bug")):
            try:
                raise exc
            except Exception:
                logger.exception("Error handling request from %s", "127.0.0.1")  # as aiohttp does
    assert [(r.levelname, r.exc_info is None) for r in caplog.records] == [
        ("INFO", True),
        ("INFO", True),
        ("ERROR", False),  # a server bug stays an error, with its traceback
    ]
