"""The cluster secret: who may talk to a multi-node pipeline.

Every node holds the same secret (`--cluster-key-file`, or env `PPSERVE_CLUSTER_KEY`). Its
ZeroMQ sockets use CURVE (encryption and authentication, built into libzmq) with one keypair
derived from the secret: a server socket speaks only to clients that present that public key,
which takes its secret half. A peer without the secret cannot finish the handshake, so nothing
it sends reaches a stage; each refusal is logged. Joining the cluster (engine/cluster/rendezvous.py)
proves the secret too, with an HMAC, so that a node with the wrong one is refused by name.

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
    and logs every refused handshake on the server sockets it watches."""

    def __init__(self, ctx: zmq.asyncio.Context, keys: CurveKeys, who: str) -> None:
        self.keys = keys
        self.who = who  # names this process in the log ("host", "stage 2", "node 1")
        self.auth = AsyncioAuthenticator(ctx, log=logging.getLogger("ppserve.cluster.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)
        self._monitors: list[tuple[asyncio.Task[None], zmq.asyncio.Socket]] = []

    def callback(self, domain: str, client_key: bytes) -> bool:
        return hmac.compare_digest(client_key, self.keys.public)

    def watch(self, sock: zmq.asyncio.Socket) -> None:
        """Log the handshakes that `sock` (a bound server socket) refuses."""
        monitor = sock.get_monitor_socket(REFUSED_EVENTS)
        self._monitors.append((asyncio.get_running_loop().create_task(self._report(monitor)), monitor))

    async def _report(self, monitor: zmq.asyncio.Socket) -> None:
        """One line per socket and LOG_EVERY_S at most (a refused peer retries every 0.1 s)."""
        logged_at, unlogged = -LOG_EVERY_S, 0
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            now = time.monotonic()
            if now - logged_at < LOG_EVERY_S:
                unlogged += 1
                continue
            more = f"; {unlogged} more since the last report" if unlogged else ""
            log.warning(
                "%s: refused a connection on %s from a peer without the cluster key (%s%s)",
                self.who,
                event["endpoint"].decode(errors="replace"),
                zmq.Event(event["event"]).name,
                more,
            )
            logged_at, unlogged = now, 0

    def stop(self) -> None:
        """Before the context is terminated (which waits for every socket to close)."""
        for task, monitor in self._monitors:
            task.cancel()
            monitor.close(linger=0)
        self._monitors.clear()
        self.auth.stop()
