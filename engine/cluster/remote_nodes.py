"""The host's view of the other nodes of a cluster: their stages and whether they are there.

A stage on another node is not a child of the host, so its death cannot be seen with waitpid.
Each node's agent (engine/runtime/node_agent.py) sends a NodeHeartbeat every 0.2 s and reports a stage
process that ends; the host sends each agent a HostHeartbeat just as often. A node silent for
`NODE_TIMEOUT_S` (killed, or its link cut) is lost: the engine fails what is in flight, naming
the node and its stages. The agent of a node that no longer hears the host stops its stages, so
the host's heartbeats come from a thread of their own: a busy event loop on the host (a long
tokenization, a pause) must not look like a host that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time

import zmq
import zmq.asyncio

from ppserve.transport.cluster_key import CurveKeys
from ppserve.transport.messages import HostHeartbeat, NodeJoin, Shutdown, encode

BEAT_S = 0.2
NODE_TIMEOUT_S = 1.2  # six beats: well inside the 2 s in which requests in flight must fail


class RemoteStage:
    """A stage process on another node: what StagePool asks of a local process, answered from
    its node's reports (it is stopped by its node's agent, not by the host)."""

    exitcode: int | None = None

    def __init__(self, stage: int, node: int, addr: str) -> None:
        self.stage = stage
        self.node = node
        self.addr = addr
        self.pid: int | None = None  # known from its StageReady
        self.gone = ""  # why it is no longer there

    def claim(self, pid: int) -> bool:
        """Whether a message from process `pid` is this stage's (the first one names it)."""
        if self.pid is None:
            self.pid = pid
        return self.pid == pid

    def is_alive(self) -> bool:
        return not self.gone

    def kill(self) -> None:
        self.gone = self.gone or "stopped by the host"

    def join(self, timeout: float | None = None) -> None:
        pass

    def describe(self) -> str:
        return f"stage {self.stage} on node {self.node} ({self.addr}, pid {self.pid or '?'})"


class RemoteNodes:
    def __init__(self, ctx: zmq.asyncio.Context, joins: dict[int, NodeJoin], keys: CurveKeys | None) -> None:
        self.joins = joins
        self.seen = dict.fromkeys(joins, time.monotonic())
        self.lost: set[int] = set()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(
            ctx.underlying
        )  # plain sockets, owned by the beat thread
        self._keys = keys
        self._orders: queue.SimpleQueue[str] = queue.SimpleQueue()  # "shutdown", then "close"
        self._thread = threading.Thread(target=self._beat, name="node-heartbeat", daemon=True)
        self._thread.start()

    def heard(self, node: int) -> None:
        self.seen[node] = time.monotonic()

    def refresh(self) -> None:
        """The host itself was not running: the nodes' silence says nothing about them."""
        now = time.monotonic()
        self.seen = dict.fromkeys(self.seen, now)

    def newly_lost(self) -> list[tuple[int, float]]:
        """Nodes silent past the timeout, each reported once: (node, seconds silent)."""
        now = time.monotonic()
        lost = [(n, now - t) for n, t in self.seen.items() if n not in self.lost and now - t > NODE_TIMEOUT_S]
        self.lost.update(n for n, _ in lost)
        return lost

    def _beat(self) -> None:
        socks = []
        for join in self.joins.values():
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            if self._keys is not None:
                self._keys.apply(sock, server=False)
            sock.connect(join.control)
            socks.append(sock)
        heartbeat, shutdown, linger_ms = encode(HostHeartbeat()), encode(Shutdown()), 0
        while True:
            try:
                order = self._orders.get(timeout=BEAT_S)
            except queue.Empty:
                order = "beat"
            if order == "close":
                break
            linger_ms = 500 if order == "shutdown" else linger_ms  # let the Shutdown go out
            for sock in socks:
                with contextlib.suppress(zmq.Again):  # not connected (yet, or any more): nothing to tell
                    sock.send(shutdown if order == "shutdown" else heartbeat, zmq.NOBLOCK)
        for sock in socks:
            sock.close(linger=linger_ms)

    def shutdown(self) -> None:
        """Every node's agent stops its stages (after letting them drain for a moment)."""
        self._orders.put("shutdown")

    async def close(self) -> None:
        """Before the context is terminated (the beat thread's sockets must be closed by then).
        Awaited, not joined: the thread ends at once, but a join would hold the event loop."""
        self._orders.put("close")
        deadline = time.monotonic() + 5.0
        while self._thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
