"""The HTTP listening sockets, bound before anything else starts.

Loading the stages takes seconds to minutes; a port that is already in use should fail at
once, not after that. The sockets are bound here and handed to aiohttp (`web.SockSite`), so no
other process can take the port between the check and the serving.
"""

from __future__ import annotations

import socket


def listen(host: str, port: int, backlog: int = 128) -> list[socket.socket]:
    """Listening sockets for every address `host` resolves to (as aiohttp's TCPSite would bind);
    with port 0, the port picked for the first address is used for the rest."""
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
            sock = socket.socket(family, type_, proto)
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
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets
