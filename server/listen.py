"""The HTTP server's sockets, bound before anything else starts.

Loading the stages takes seconds to minutes; a port that is already in use should fail at
once, not after that. The sockets are bound here and handed to aiohttp (`web.SockSite`), which
starts listening on them once the engine is up: until then a client is refused at once rather
than left waiting in a backlog. (Two servers that start at the same moment on one port can
both bind it, as neither listens yet; the second then fails when it starts to listen.)
"""

from __future__ import annotations

import errno
import socket

PORT_0_ATTEMPTS = 5


def bind_http(host: str, port: int) -> list[socket.socket]:
    """Bound sockets for every address `host` resolves to that this machine supports (as
    aiohttp's TCPSite would bind); with port 0, one port picked for all of them."""
    for attempt in range(PORT_0_ATTEMPTS):
        try:
            return _bind_all(host, port)
        except OSError as e:
            # Port 0: the port picked for the first address may be taken on another; pick again.
            if port != 0 or e.errno != errno.EADDRINUSE or attempt == PORT_0_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _bind_all(host: str, port: int) -> list[socket.socket]:
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {host!r}: {e.strerror}") from None
    sockets: list[socket.socket] = []
    seen: set[tuple[int, str]] = set()
    try:
        for family, type_, proto, _, sockaddr in infos:
            addr = (str(sockaddr[0]), int(sockaddr[1]), *sockaddr[2:])  # IPv6 adds flow info and scope
            if (family, addr[0]) in seen:
                continue
            seen.add((family, addr[0]))
            try:
                sock = socket.socket(family, type_, proto)
            except OSError:  # a family this kernel lacks (IPv6 turned off): skipped, as asyncio does
                continue
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restarts need not wait out TIME_WAIT
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # "::" next to "0.0.0.0"
            if sockets[0] is not sock:
                addr = (addr[0], sockets[0].getsockname()[1], *addr[2:])
            try:
                sock.bind(addr)
            except OSError as e:
                raise OSError(e.errno, f"cannot listen on {addr[0]} port {addr[1]}: {e.strerror}") from None
            sock.setblocking(False)
        if not sockets:
            raise OSError(f"cannot listen on {host!r}: no address of a kind this machine supports")
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets
