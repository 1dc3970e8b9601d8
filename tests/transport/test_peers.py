"""Talking to peers: which addresses are taken, and how the sockets to them stay bounded."""

from __future__ import annotations

import asyncio
import logging

import pytest

from ppserve.transport.control import PullSocket, context
from ppserve.transport.messages import RoomFailed
from ppserve.transport.peers import AddressError, LogLimiter, PeerLinks, check_address


@pytest.mark.parametrize(
    "address", ["tcp://127.0.0.1:5", "tcp://[::1]:80", "tcp://node-a.cluster.local:9100", "ipc:///tmp/ppserve/x"]
)
def test_addresses_a_peer_may_announce(address: str) -> None:
    assert check_address(address) == address


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("not an endpoint", "is not tcp://HOST:PORT"),
        ("tcp://*:5", "not a host name"),
        ("tcp://0.0.0.0:5", "wildcard"),
        ("tcp://a:0", "port in 1..65535"),
        ("tcp://a:99999", "port in 1..65535"),
        ("tcp://a:١٢", "port in 1..65535"),  # digits, but not ASCII ones
        ("tcp://[zz]:1", "not an IPv6 address"),
        ("tcp://a b:1", "not a host name"),
        ("ipc://relative", "absolute path"),
        ("inproc://x", "is not tcp://HOST:PORT"),
        ("tcp://h:1" + "0" * 400, "at most 300 characters"),
        (5, "must be a string"),
    ],
)
def test_addresses_refused_with_the_reason(address: object, why: str) -> None:
    with pytest.raises(AddressError, match=why):
        check_address(address, "reply_to")


async def test_past_the_cap_the_least_recently_used_link_closes_and_its_waiting_send_fails() -> None:
    """A peer that takes nothing keeps its link busy; it must not keep out the others. Its send
    fails (never hangs, never is cancelled silently), and messages to live peers go through."""
    ctx = context()
    links = PeerLinks(ctx, None, max_links=1, send_timeout_s=30.0)
    inbox = PullSocket(ctx, "tcp://127.0.0.1:*", bind=True)
    try:
        nowhere = asyncio.create_task(links.send("tcp://127.0.0.1:21999", RoomFailed("a", "x")))
        while not links.busy("tcp://127.0.0.1:21999"):  # it takes the lock, waits for a peer never there
            assert not nowhere.done(), nowhere
            await asyncio.sleep(0)
        await links.send(inbox.address, RoomFailed("b", "x"))
        assert await asyncio.wait_for(inbox.recv(), 10) == RoomFailed("b", "x")
        with pytest.raises(AddressError, match="closed to make room"):
            await nowhere
        assert list(links.socks) == [inbox.address]
        short = PeerLinks(ctx, None, send_timeout_s=0.2)
        with pytest.raises(TimeoutError):  # undelivered: fails, never queued for a peer to come
            await short.send("tcp://127.0.0.1:21998", RoomFailed("c", "x"))
        short.close()
    finally:
        links.close()
        inbox.close()
        ctx.term()


def test_a_repeated_warning_is_one_line_per_window(caplog: pytest.LogCaptureFixture) -> None:
    limiter = LogLimiter(logging.getLogger("ppserve.test"), every_s=3600)
    for i in range(100):
        limiter.warning("dropped junk %d", i)
    assert [r.getMessage() for r in caplog.records] == ["dropped junk 0"]
    limiter.logged_at -= 3600  # the window is over
    limiter.warning("dropped junk %d", 100)
    assert caplog.records[-1].getMessage() == "dropped junk 100 (99 more like it since the last report)"
