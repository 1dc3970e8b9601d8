"""Junk on a client-facing port: one INFO line per connection, at most a burst of them per
window, and never a traceback (server/client_errors.py; the router installs it as the servers do)."""

from __future__ import annotations

import logging
import re
import socket
import time
import uuid
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
from aiohttp.http_exceptions import BadStatusLine
from live_server import LiveServer

from ppserve.server import client_errors

CLUSTER = {"PPSERVE_CLUSTER_KEY": "the-router-and-servers-secret"}
JUNK = (
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(range(64)),  # a TLS client hello
    b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 9000 + b"\r\n\r\n",
    b"GET / HTTP/1.1\r\nHo",  # half a request, then the connection closes
)
CONNECTIONS = 50
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ")


def _send(url: str, data: bytes) -> None:
    """`data` on a connection of its own; waits for the router's answer and close (or, for half a
    request, closes first)."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        sock.sendall(data)
        if data.endswith(b"\r\n"):
            b"".join(iter(lambda: sock.recv(65536), b""))


@pytest.mark.slow
def test_junk_connections_to_the_router_log_a_bounded_number_of_single_lines() -> None:
    down = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]
    router = LiveServer(None, *down, api_key=None, command="router", env=CLUSTER)
    try:
        mark = len(router.output)
        started = time.monotonic()
        for i in range(CONNECTIONS):
            _send(router.url, JUNK[i % len(JUNK)])
        windows = 2 + int((time.monotonic() - started) // client_errors.LOG_EVERY_S)  # the junk spans these
        # Everything the router logged about the junk is in `output` once this request's access line is.
        sentinel = f"/health?sentinel={uuid.uuid4().hex}"  # logged: no backend is up, so it fails
        router.request("GET", sentinel)
        router.wait_until(lambda: any(sentinel in line for line in router.output[mark:]), what="the log")
    finally:
        assert router.stop() == 0
    out = router.output[mark:]
    assert all(LOG_LINE.match(line) or line.startswith("ppserve: ") for line in out), "".join(out)
    assert not any("Traceback" in line or " ERROR " in line for line in out), "".join(out)
    junk = [line for line in out if " aiohttp.server: " in line]
    assert junk and all(" INFO " in line and ": bad HTTP (" in line for line in junk), "".join(junk)
    assert len(junk) <= min(windows * client_errors.LOG_BURST, CONNECTIONS - 1), "".join(junk)


def test_client_mistakes_past_the_burst_are_counted_in_the_next_line(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(client_errors, "time", SimpleNamespace(monotonic=lambda: now[0]))
    logger = logging.getLogger("aiohttp.server")
    # A filter of its own: the process's one (quiet_client_errors) has a history.
    monkeypatch.setattr(logger, "filters", [client_errors._ClientErrorsAsInfo()])
    with caplog.at_level(logging.INFO, logger="aiohttp.server"):
        for _ in range(client_errors.LOG_BURST + 5):
            try:
                raise BadStatusLine("GET / HTTP/9.9")
            except BadStatusLine:
                logger.exception("Error handling request from %s", "127.0.0.1")  # as aiohttp does
        assert len(caplog.records) == client_errors.LOG_BURST
        now[0] += client_errors.LOG_EVERY_S  # a new window
        try:
            raise ConnectionResetError("gone")
        except ConnectionResetError:
            logger.exception("Error handling request from %s", "127.0.0.1")
    assert len(caplog.records) == client_errors.LOG_BURST + 1
    assert all(r.levelname == "INFO" and r.exc_info is None for r in caplog.records)
    last = caplog.records[-1].getMessage()
    assert last.endswith("the client went away (gone) (5 more client mistakes not logged since the last line)")
