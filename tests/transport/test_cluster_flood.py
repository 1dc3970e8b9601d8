"""Peers without the cluster key that retry as fast as they can: the Guard stops reading a
socket's refusals for a while (its monitor off), they stay refused, and peers with the key are
untouched (transport/cluster_key.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
import zmq
import zmq.asyncio

from ppserve.transport import cluster_key
from ppserve.transport.cluster_key import CurveKeys, Guard, next_pause
from ppserve.transport.control import PullSocket, PushSocket, context
from ppserve.transport.messages import Heartbeat

KEYS = CurveKeys.from_secret(b"the-cluster-secret-of-the-flood")
WRONG = CurveKeys.from_secret(b"a-guess-that-is-not-the-secret")
FLOOD = 5  # refusals that make a flood here (the window is wide: a slow machine still floods)


@dataclass
class Plane:
    guard: Guard
    pull: PullSocket
    peers: zmq.asyncio.Context  # where the wrong-key clients and the member connect from


@pytest.fixture
async def plane(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Plane]:
    monkeypatch.setattr(cluster_key, "FLOOD_REFUSALS", FLOOD)
    monkeypatch.setattr(cluster_key, "FLOOD_WINDOW_S", 600.0)
    ctx, peers = context(), context()
    guard = Guard(ctx, KEYS, "stage 1")
    pull = PullSocket(ctx, "tcp://127.0.0.1:*", bind=True, guard=guard)
    try:
        yield Plane(guard, pull, peers)
    finally:  # term() waits for every socket: a failed check must not leave one open
        pull.close()
        guard.stop()
        ctx.term()
        peers.term()


async def _wrong_key_try(plane: Plane) -> None:
    """One connection with the wrong key, until the server drops it (no reconnecting)."""
    sock = plane.peers.socket(zmq.PUSH)
    sock.linger, sock.reconnect_ivl = 0, -1
    WRONG.apply(sock, server=False)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.connect(plane.pull.address)
        await asyncio.wait_for(monitor.recv_multipart(), 30)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close()


async def _until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(600):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_flood_pauses_the_watch_and_a_member_still_gets_in(
    plane: Plane, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cluster_key, "PAUSE_S", 600.0)  # the whole test happens within the first pause
    caplog.set_level(logging.WARNING, logger="ppserve.cluster")
    tries = 4 * FLOOD
    for _ in range(tries):
        await _wrong_key_try(plane)
    await _until(lambda: plane.guard.pauses == 1, "the flood to pause the watch")
    # Every try was refused; the event loop read FLOOD of them, then none.
    assert plane.guard.refused == FLOOD < tries
    floods = [r.message for r in caplog.records if "a flood" in r.message]
    assert len(floods) == 1 and floods[0].startswith(f"stage 1: {FLOOD - 1} connections refused on")
    assert "not watching that port for 600 s" in floods[0]
    # A peer with the key, from the same address as the flood, connects during the pause.
    peer_guard = Guard(plane.peers, KEYS, "stage 0")
    member = PushSocket(plane.peers, plane.pull.address, bind=False, guard=peer_guard)
    try:
        await member.send(Heartbeat(7))
        assert await asyncio.wait_for(plane.pull.recv(), 30) == Heartbeat(7)
    finally:
        member.close()
        peer_guard.stop()
    assert plane.guard.refused == FLOOD


async def test_the_watch_resumes_after_its_pause(plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_key, "PAUSE_S", 0.01)
    for _ in range(600):  # until the watch came back, counted again, and paused again
        if plane.guard.pauses >= 2:
            break
        await _wrong_key_try(plane)
    assert plane.guard.pauses >= 2 and plane.guard.refused >= 2 * FLOOD


def test_pauses_grow_while_floods_follow_each_other() -> None:
    pause = cluster_key.PAUSE_S
    for _ in range(20):
        pause = next_pause(pause, since_resumed_s=0.0)
    assert pause == cluster_key.PAUSE_MAX_S
    assert next_pause(pause, since_resumed_s=pause + 1.0) == cluster_key.PAUSE_S  # a quiet spell
