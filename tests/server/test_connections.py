"""Client connections against a live server: floods of idle connections, requests that never
finish arriving, bodies too large to read, the connection limit, and who may read /metrics."""

from __future__ import annotations

import json
import resource
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from live_server import API_KEY, LiveServer

from ppserve.server import connections
from ppserve.server.demo import TINY_RANDOM

pytestmark = pytest.mark.slow

FLOOD = 5000  # idle connections held at once (the test process holds them: about 5,000 descriptors)
CLOSED_WITHIN_S = 60.0  # generous: the server's timeouts below are 2 s; before them, never
POST_HEAD = (
    "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
    "Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
)


@pytest.fixture(scope="module")
def tiny_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A cache directory of this module's own for the random tiny model (built once)."""
    return {"PPSERVE_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}


@pytest.fixture(scope="module")
def quick_server(tiny_env: dict[str, str]) -> Iterator[LiveServer]:
    """Short timeouts, and room for the whole flood."""
    flags = ("--read-timeout", "2", "--keepalive-timeout", "2", "--max-connections", str(FLOOD + 1000))
    server = LiveServer(Path(TINY_RANDOM), *flags, "--kv-cache-gb", "0.02", env=tiny_env)
    yield server
    assert server.stop() == 0, "".join(server.output)


@pytest.fixture(scope="module")
def small_server(tiny_env: dict[str, str]) -> Iterator[LiveServer]:
    """Room for 50 connections; long timeouts (held connections stay, however slow the test); /metrics public."""
    flags = ("--max-connections", "50", "--metrics-public", "--read-timeout", "600", "--keepalive-timeout", "600")
    server = LiveServer(Path(TINY_RANDOM), *flags, env=tiny_env)
    yield server
    assert server.stop() == 0, "".join(server.output)


def _connect(server: LiveServer) -> socket.socket:
    url = urlsplit(server.url)
    assert url.hostname is not None and url.port is not None
    return socket.create_connection((url.hostname, url.port), timeout=30)


def _read_response(sock: socket.socket) -> bytes:
    """One whole response: its headers, then as many bytes as its Content-Length says."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _content_length(data):
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before a whole response: {data!r}"
        data += chunk
    return data


def _content_length(data: bytes) -> int:
    head = data.partition(b"\r\n\r\n")[0].lower()
    return next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"content-length:")), 0)


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (the socket's timeout bounds each wait)."""
    return b"".join(iter(lambda: sock.recv(65536), b""))


def _health(server: LiveServer) -> int:
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        return int(_read_all(sock).split(b" ", 2)[1])


def _json_body(answer: bytes) -> dict[str, object]:
    body: dict[str, object] = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    return body


def _wait_for_eof(socks: list[socket.socket], server: LiveServer) -> None:
    """Until every socket has seen the server close it (EOF), polling /health meanwhile."""
    pending = set(socks)
    deadline = time.monotonic() + CLOSED_WITHIN_S
    next_probe = 0.0
    with selectors.DefaultSelector() as sel:
        for sock in pending:
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
        while pending:
            assert time.monotonic() < deadline, f"{len(pending)} of {len(socks)} connections still open"
            if time.monotonic() >= next_probe:
                assert _health(server) == 200
                next_probe = time.monotonic() + 0.5
            for key, _ in sel.select(timeout=0.5):
                ready = key.fileobj
                assert isinstance(ready, socket.socket)
                try:
                    data = ready.recv(65536)
                except ConnectionResetError:
                    data = b""
                assert data == b"", data  # an idle connection gets no answer, only its end
                sel.unregister(ready)
                pending.discard(ready)


def test_idle_and_slow_connections_are_closed_while_health_answers(quick_server: LiveServer) -> None:
    server = quick_server
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # this process holds the flood's sockets
    if soft != resource.RLIM_INFINITY and soft < FLOOD + 500:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else FLOOD * 2, hard))
    held: list[socket.socket] = []
    try:
        # A request whose headers stop half-way, and one that completes and then idles.
        partial = _connect(server)
        partial.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0")
        kept = _connect(server)
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")
        held += [partial, kept]
        for i in range(FLOOD):
            held.append(_connect(server))
            if i % 1000 == 999:
                assert _health(server) == 200, f"/health with {i + 1} idle connections open"
        _wait_for_eof(held, server)
    finally:
        for sock in held:
            sock.close()


def test_a_body_that_trickles_in_gets_408(quick_server: LiveServer) -> None:
    """A small declared body sent a byte at a time, slower than the read timeout allows."""
    with _connect(quick_server) as sock:
        sock.sendall(POST_HEAD.format(key=API_KEY, length=100).encode())
        deadline = time.monotonic() + CLOSED_WITHIN_S
        answer = b""
        with selectors.DefaultSelector() as sel:
            sel.register(sock, selectors.EVENT_READ)
            while not answer.endswith(b"}") and time.monotonic() < deadline:
                if sel.select(timeout=0.2):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break  # closed: also an acceptable end for a body that never came
                    answer += chunk
                else:
                    sock.sendall(b" ")
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"Connection: close" in answer and _json_body(answer)["error"]["code"] == 408  # type: ignore[index]


def test_a_body_declared_too_large_is_413_before_it_is_read(quick_server: LiveServer) -> None:
    """Nothing of the body is sent: the answer comes from the header alone (not a 408 later)."""
    with _connect(quick_server) as sock:
        sock.sendall(POST_HEAD.format(key=API_KEY, length=1_000_000_000).encode())
        answer = _read_response(sock)
    assert answer.startswith(b"HTTP/1.1 413"), answer
    error = _json_body(answer)["error"]
    assert isinstance(error, dict) and error["code"] == 413 and "1000000000 bytes" in error["message"]


def test_past_max_connections_503_but_health(small_server: LiveServer) -> None:
    server = small_server
    held = [_connect(server) for _ in range(50)]
    extra: list[socket.socket] = []
    try:
        for _ in range(10):  # each asks at once: past the limit, a connection gets 2 s to send a request
            extra.append(sock := _connect(server))
            sock.sendall(
                f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n\r\n".encode()
            )
            answer = _read_all(sock)  # the server closes the connection after its answer
            head = answer.split(b"\r\n\r\n", 1)[0]
            assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head and b"Connection: close" in head
            assert "too many open connections" in _json_body(answer)["error"]["message"]  # type: ignore[index]
        assert _health(server) == 200  # probes get through past the limit
        server.wait_until(
            lambda: any("past the limit of 50 open connections" in line for line in server.output),
            what="the server to log the refusals",
        )
    finally:
        for sock in held + extra:
            sock.close()
    # Once they are closed, there is room again.
    server.wait_until(lambda: server.request("GET", "/v1/models")[0] == 200, what="room for a connection")


def test_metrics_needs_the_key_unless_public(quick_server: LiveServer, small_server: LiveServer) -> None:
    no_key = {"Authorization": ""}
    code, _, raw = quick_server.request("GET", "/metrics", headers=no_key)
    assert code == 401 and json.loads(raw)["error"]["code"] == 401
    assert quick_server.request("GET", "/metrics")[0] == 200  # with the key
    assert small_server.request("GET", "/metrics", headers=no_key)[0] == 200  # --metrics-public
    assert small_server.request("GET", "/v1/models", headers=no_key)[0] == 401  # only /metrics is opened


def test_aiohttp_still_shows_its_handlers_state() -> None:
    """The header timeout reads two fields of aiohttp's RequestHandler; an aiohttp without them
    would leave only the keep-alive timer."""
    assert connections.CAN_TELL_IDLE


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--read-timeout", "0", "read_timeout_s (--read-timeout) must be > 0 seconds"),
        ("--keepalive-timeout", "nan", "keepalive_timeout_s (--keepalive-timeout) must be > 0 seconds"),
        ("--max-connections", "0", "max_connections (--max-connections) must be >= 1"),
    ],
)
def test_bad_connection_flags(flag: str, value: str, message: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "ppserve.server.cli", "serve", "--port", "0", "--model", TINY_RANDOM, flag, value],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 2 and message in res.stderr, res.stderr
