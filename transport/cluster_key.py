"""The cluster secret: who may talk to a multi-node pipeline.

Every node holds the same secret (`--cluster-key-file`, or env `PPSERVE_CLUSTER_KEY`). Its
ZeroMQ sockets use CURVE (encryption and authentication, built into libzmq) with one keypair
derived from the secret: a server socket speaks only to clients that present that public key,
which takes its secret half. A peer without the secret cannot finish the handshake, so nothing
it sends reaches a stage; refusals are logged. Joining the cluster (engine/cluster/rendezvous.py)
proves the secret too, with an HMAC, so that a node with the wrong one is refused by name.

A peer that retries without the key costs each try: libzmq accepts, handshakes and closes in its
I/O thread, and the socket's monitor wakes this process's event loop (and takes the GIL from the
stage it runs) once per refusal. libzmq decides before asking the ZAP handler (a peer that lacks
the server's key fails at its HELLO, and ZAP comes after the INITIATE) and its monitor names no
peer address, so a refusal by address cannot be made here; what is ours is the monitor. During a
flood the `Guard` stops reading a socket's refusals for a while (`FLOOD_REFUSALS`, `PAUSE_S`):
the handshakes are refused as before, legitimate peers are untouched, and only the counting and
the event-loop work pause. A firewall in front of the cluster ports is what keeps floods out.

What the key does not cover: torch.distributed's own traffic (its TCPStore and the gloo/nccl
activations), which has no authentication of its own; `--tensor-transport zmq` sends
activations over CURVE as well.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

ENV = "PPSERVE_CLUSTER_KEY"
MIN_KEY_BYTES = 16
ZAP_DOMAIN = "ppserve"
LOG_EVERY_S = 10.0
# A flood: FLOOD_REFUSALS refusals on one socket within FLOOD_WINDOW_S (a peer that lacks the key
# retries every 0.1 s, so a few of them stay under it). Its pause starts at PAUSE_S and doubles
# while floods follow each other, up to PAUSE_MAX_S.
FLOOD_REFUSALS = 50
FLOOD_WINDOW_S = 1.0
PAUSE_S = 1.0
PAUSE_MAX_S = 60.0
REFUSED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
log = logging.getLogger("ppserve.cluster")


def load_key(path: str | None) -> bytes | None:
    """The secret from `path` (its whole content, surrounding whitespace stripped), else from the
    environment; None if neither is given."""
    if path is not None:
        try:
            with open(path, "rb") as f:
                key = f.read().strip()
        except OSError as e:
            raise ValueError(f"--cluster-key-file: cannot read {path}: {e.strerror or e}") from None
        where = path
    else:
        key = os.environ.get(ENV, "").strip().encode()
        if not key:
            return None
        where = ENV
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the cluster key in {where} is {len(key)} bytes; use at least {MIN_KEY_BYTES}")
    return key


def proof(key: bytes, *parts: str) -> str:
    """An HMAC that shows the sender holds `key`, bound to `parts` (so it cannot be replayed
    for another node or another start-up)."""
    return hmac.new(key, "\x00".join(parts).encode(), hashlib.sha256).hexdigest()


def proof_matches(key: bytes, claimed: str, *parts: str) -> bool:
    """`claimed` comes from an open store: any text, compared in constant time as bytes."""
    return hmac.compare_digest(proof(key, *parts).encode(), claimed.encode(errors="replace"))


def route_proof(key: bytes, prefill: str) -> str:
    """What a router sends beside the prefill server it names to a decode server, so that only a
    holder of the key (not any HTTP client) can make a decode server open a room somewhere."""
    return proof(key, "prefill-route", prefill)


def route_proof_matches(key: bytes, claimed: str, prefill: str) -> bool:
    return proof_matches(key, claimed, "prefill-route", prefill)


@dataclass(frozen=True)
class CurveKeys:
    """One CURVE keypair (Z85 text) for every socket of the cluster, both roles."""

    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def from_secret(cls, key: bytes) -> CurveKeys:
        seed = hashlib.blake2b(key, digest_size=32, person=b"ppserve-curve").digest()
        secret = zmq.utils.z85.encode(seed)
        return cls(public=zmq.curve_public(secret), secret=secret)

    def apply(self, sock: zmq.Socket[Any], *, server: bool) -> None:
        """Before bind/connect. A server also asks the context's ZAP handler (`Guard`) about
        each client's key."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        if server:
            sock.curve_server = True
            sock.zap_domain = ZAP_DOMAIN.encode()
        else:
            sock.curve_serverkey = self.public


class Guard:
    """The ZAP handler of one process's context: lets in only clients that hold the cluster key,
    and logs the handshakes refused on the server sockets it watches."""

    def __init__(self, ctx: zmq.asyncio.Context, keys: CurveKeys, who: str) -> None:
        self.keys = keys
        self.who = who  # names this process in the log ("host", "stage 2", "node 1")
        self.auth = AsyncioAuthenticator(ctx, log=logging.getLogger("ppserve.cluster.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)
        self._watches: list[_Watch] = []
        self.refused = 0  # refusals read from the monitors (none are read during a pause)
        self.pauses = 0  # floods that paused a monitor

    def callback(self, domain: str, client_key: bytes) -> bool:
        return hmac.compare_digest(client_key, self.keys.public)

    def watch(self, sock: zmq.asyncio.Socket) -> None:
        """Log the handshakes that `sock` (a bound server socket) refuses."""
        watch = _Watch(sock)
        watch.task = asyncio.get_running_loop().create_task(self._watch(watch))
        self._watches.append(watch)

    async def _watch(self, watch: _Watch) -> None:
        pause, resumed_at = PAUSE_S, -PAUSE_MAX_S
        while (monitor := watch.open()) is not None:
            unlogged = await self._read_until_flood(watch, monitor)
            watch.close()
            now = time.monotonic()
            # A flood again soon after the last pause is the same flood: pause longer.
            pause = next_pause(pause, now - resumed_at)
            self.pauses += 1
            log.warning(
                "%s: %d connections refused on %s since the last report, from peers without the cluster key: "
                "a flood; not watching that port for %g s (its handshakes are refused all the same)",
                self.who,
                unlogged,
                watch.endpoint,
                pause,
            )
            await asyncio.sleep(pause)
            resumed_at = time.monotonic()

    async def _read_until_flood(self, watch: _Watch, monitor: zmq.asyncio.Socket) -> int:
        """Logs refusals (one line per LOG_EVERY_S at most: a refused peer retries every 0.1 s)
        until FLOOD_REFUSALS of them come within FLOOD_WINDOW_S; returns how many were not logged."""
        recent: deque[float] = deque(maxlen=FLOOD_REFUSALS)
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            now = time.monotonic()
            self.refused += 1
            watch.unlogged += 1
            recent.append(now)
            if len(recent) == FLOOD_REFUSALS and now - recent[0] <= FLOOD_WINDOW_S:
                unlogged, watch.unlogged, watch.logged_at = watch.unlogged, 0, now
                return unlogged
            if now - watch.logged_at < LOG_EVERY_S:
                continue
            more = f"; {watch.unlogged - 1} more since the last report" if watch.unlogged > 1 else ""
            log.warning(
                "%s: refused a connection on %s from a peer without the cluster key (%s%s)",
                self.who,
                watch.endpoint,
                zmq.Event(event["event"]).name,
                more,
            )
            watch.logged_at, watch.unlogged = now, 0

    def stop(self) -> None:
        """Before the context is terminated (which waits for every socket to close)."""
        for watch in self._watches:
            if watch.task is not None:
                watch.task.cancel()
            watch.close()
        self._watches.clear()
        self.auth.stop()


class _Watch:
    """The monitor of one server socket, while it is open (closed during a flood's pause)."""

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.monitor: zmq.asyncio.Socket | None = None
        self.task: asyncio.Task[None] | None = None
        self.logged_at, self.unlogged = -LOG_EVERY_S, 0

    def open(self) -> zmq.asyncio.Socket | None:
        """None once the socket's owner has closed it: nothing is left to watch."""
        if self.sock.closed:
            return None
        self.monitor = self.sock.get_monitor_socket(REFUSED_EVENTS)
        return self.monitor

    def close(self) -> None:
        """Synchronous, so that `Guard.stop` leaves no socket open for the context's term()."""
        if self.monitor is None:
            return
        if not self.sock.closed:
            self.sock.disable_monitor()  # libzmq stops sending the events, not only this process reading them
        self.monitor.close(linger=0)
        self.monitor = None


def next_pause(pause: float, since_resumed_s: float) -> float:
    """The pause after a flood, `since_resumed_s` after the last pause (of `pause` seconds) ended:
    twice as long when the flood came back within that time (up to PAUSE_MAX_S), else PAUSE_S."""
    return min(2 * pause, PAUSE_MAX_S) if since_resumed_s < pause else PAUSE_S
