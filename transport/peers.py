"""Talking to peers on other hosts: the addresses they announce, and the sockets we open to them.

A peer (the other side of a disaggregated pair, a node of a cluster) names addresses for us to
connect to: where its KV receivers listen, where its room replies go. Nothing it sends is used
as an address before `check_address` has parsed it. The sockets to peers (`PeerLinks`) are
bounded three ways, so that no peer, live or gone, can make us hold memory or descriptors:

- in number: past `max_links`, the least recently used idle one is closed (or, when all are
  busy, the least recently used: its waiting send fails);
- in queue: a message goes out only to a connected peer (ZMQ_IMMEDIATE), at most `hwm` wait
  per socket, and a send that no peer takes within `send_timeout_s` fails (it is never queued
  for a peer that may never come, and never reported as delivered);
- in order: messages to one peer leave in the order they were sent.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from ppserve.transport.control import PushSocket
from ppserve.transport.messages import Msg

if TYPE_CHECKING:
    from ppserve.transport.cluster_key import Guard

MAX_ADDRESS_CHARS = 300
MAX_IPC_PATH = 100  # sun_path holds 108 bytes
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")  # RFC 1123


class AddressError(ValueError):
    """An address a peer announced that we will not connect to."""


def check_address(address: object, what: str = "address") -> str:
    """`address` if it is `tcp://HOST:PORT` (HOST an IP literal, `[v6]`, or a DNS name; PORT in
    1..65535) or `ipc:///absolute/path`; else an AddressError that says why."""
    if not isinstance(address, str) or not 0 < len(address) <= MAX_ADDRESS_CHARS:
        raise AddressError(f"{what} must be a string of at most {MAX_ADDRESS_CHARS} characters")
    if address.startswith("ipc://"):
        path = address[len("ipc://") :]
        if not path.startswith("/") or len(path.encode()) > MAX_IPC_PATH or "\x00" in path:
            raise AddressError(f"{what} {address!r}: an ipc address needs an absolute path under {MAX_IPC_PATH} bytes")
        return address
    if not address.startswith("tcp://"):
        raise AddressError(f"{what} {address!r} is not tcp://HOST:PORT or ipc:///PATH")
    host, sep, port = address[len("tcp://") :].rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise AddressError(f"{what} {address!r} needs a port in 1..65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise AddressError(f"{what} {address!r}: {host} is not an IPv6 address") from None
    elif not _is_ipv4(host) and not _HOSTNAME.match(host):
        raise AddressError(f"{what} {address!r}: {host!r} is not a host name or IP address")
    if host in ("*", "0.0.0.0", "[::]"):
        raise AddressError(f"{what} {address!r} is a wildcard, not a peer")
    return address


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


class PeerLinks:
    """PUSH sockets to peers by address (checked), opened on first use, bounded as above."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        guard: Guard | None,
        *,
        max_links: int = 64,
        hwm: int = 64,
        send_timeout_s: float = 10.0,
    ) -> None:
        self.ctx, self.guard = ctx, guard
        self.max_links, self.hwm, self.send_timeout_s = max_links, hwm, send_timeout_s
        self.socks: OrderedDict[str, _Link] = OrderedDict()  # least recently used first

    def _link(self, address: str) -> _Link:
        if (link := self.socks.get(address)) is not None:
            self.socks.move_to_end(address)
            return link
        check_address(address)
        if len(self.socks) >= self.max_links:
            # The least recently used idle link goes; with none idle, the least recently used
            # (a peer that takes nothing keeps its link busy, and must not keep out the others).
            old = next((a for a, link in self.socks.items() if not link.lock.locked()), next(iter(self.socks)))
            self.socks.pop(old).close()
        try:  # queued only for a connected peer (that proved the key), and boundedly
            push = PushSocket(self.ctx, address, bind=False, guard=self.guard, hwm=self.hwm, immediate=True)
        except zmq.ZMQError as e:
            raise AddressError(f"cannot connect to {address!r}: {e}") from None
        link = self.socks[address] = _Link(push)
        return link

    async def send(self, address: str, msg: Msg) -> None:
        """Hand `msg` to the peer at `address`. Raises AddressError for an address we do not
        connect to (or whose link was closed to make room), TimeoutError when no peer takes it
        within the send timeout."""
        link = self._link(address)
        async with link.lock:  # one sender at a time per peer: messages leave in order
            if not link.closed:
                try:
                    await asyncio.wait_for(link.push.send(msg), self.send_timeout_s)
                    return
                except (asyncio.CancelledError, zmq.ZMQError):  # pyzmq's ways to end a send on a closed socket
                    task = asyncio.current_task()
                    if not link.closed or (task is not None and task.cancelling()):
                        raise  # not the link's doing (this task was cancelled, or the send failed)
        raise AddressError(f"the link to {address} was closed to make room for other peers")

    def busy(self, address: str) -> bool:
        """Whether a send to `address` is waiting (a peer that is slow, or gone)."""
        link = self.socks.get(address)
        return link is not None and link.lock.locked()

    def close(self) -> None:
        for link in self.socks.values():
            link.close(linger_ms=200)  # what a peer already took may still go out, briefly
        self.socks.clear()


class _Link:
    """One PUSH socket to a peer, and the lock that keeps its sends in order."""

    def __init__(self, push: PushSocket) -> None:
        self.push, self.lock, self.closed = push, asyncio.Lock(), False

    def close(self, linger_ms: int = 0) -> None:
        """A send waiting on it is cancelled by pyzmq; `PeerLinks.send` turns that into a failure."""
        self.closed = True
        self.push.close(linger_ms)


class LogLimiter:
    """At most one log line per `every_s` for a kind of event a peer can repeat at will; the
    next line says how many were not logged."""

    def __init__(self, log: logging.Logger, every_s: float = 10.0) -> None:
        self.log, self.every_s = log, every_s
        self.logged_at, self.unlogged = -every_s, 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self.logged_at < self.every_s:
            self.unlogged += 1
            return
        more = f" ({self.unlogged} more like it since the last report)" if self.unlogged else ""
        self.log.warning(msg + more, *args)
        self.logged_at, self.unlogged = now, 0
