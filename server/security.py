"""Checks that keep web pages from driving the server through a visitor's browser.

A server without an API key on 127.0.0.1 is still reachable from any page the user opens: the
browser connects to loopback for the page. Three doors, three checks:

- Cross-origin websockets: browsers send `Origin` but apply no same-origin policy to `/ws`. The
  server accepts no Origin at all (not a browser), the page's own origin, or `--allowed-origins`.
- DNS rebinding: a page's own name is re-pointed at 127.0.0.1, so its requests are same-origin
  but carry its foreign `Host`. A server bound to loopback answers only loopback names.
- "Simple" cross-origin POSTs: a form or a `fetch` with `text/plain` goes out without a CORS
  preflight. JSON bodies must say `Content-Type: application/json`, which browsers only send
  cross-origin after a preflight, which this server never approves.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Middleware

from ppserve.server.errors import ApiError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts connections from this machine."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(authority: str) -> str:
    """The name part of a `Host` header or URL authority: no port, no brackets, lower case."""
    authority = authority.strip().lower()
    if authority.startswith("["):  # [::1]:8000
        return authority[1 : authority.find("]")] if "]" in authority else authority
    name, _, port = authority.rpartition(":")
    name = name if name and port.isdigit() and ":" not in name else authority
    return name.rstrip(".")  # "localhost." is localhost


def host_allowed(host_header: str | None, bound_host: str | None) -> bool:
    """A `Host` a loopback-bound server may answer: a loopback name or the bound address itself.
    Servers bound elsewhere (or whose address is unknown) are reached by names we cannot know."""
    if bound_host is None or not is_loopback(bound_host) or host_header is None:
        return True  # no Host header: HTTP/1.0 tools, never a browser
    name = host_name(host_header)
    return name in LOOPBACK_NAMES or name == host_name(bound_host)


def parse_origins(text: str) -> tuple[str, ...]:
    """`--allowed-origins`: comma-separated `scheme://host[:port]` entries, or `*`."""
    origins = tuple(o.strip().rstrip("/").lower() for o in text.split(",") if o.strip())
    for origin in origins:
        parts = urlsplit(origin)
        if origin != "*" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path):
            raise ValueError(f"--allowed-origins: expected origins like https://app.example.com or *, got {origin!r}")
    if not origins:
        raise ValueError("--allowed-origins: no origin given")
    return origins


def origin_allowed(origin: str | None, host_header: str | None, allowed: tuple[str, ...]) -> bool:
    if origin is None or "*" in allowed:
        return True  # no Origin: not a browser (curl, SDKs), which Origin checks cannot stop anyway
    origin = origin.strip().rstrip("/").lower()
    if origin in allowed:
        return True
    # Same origin: the page was served by this very host:port (browsers omit default ports in
    # both headers alike).
    netloc = urlsplit(origin).netloc  # "" for the opaque origin "null" (sandboxed pages, files)
    return bool(netloc) and host_header is not None and netloc == host_header.strip().lower()


def bearer_token(header: str) -> bytes:
    """The credentials of `Authorization: Bearer <token>` as bytes (b"" if another scheme).
    The scheme is case-insensitive (RFC 7235). Headers that are not UTF-8 reach us with
    surrogates in them; "surrogatepass" encodes any str, so they compare unequal, not crash."""
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return b""
    return token.strip().encode("utf-8", "surrogatepass")


def api_key(headers: Mapping[str, str]) -> bytes:
    """The API key a request carries: `Authorization: Bearer <key>`, or Anthropic's `x-api-key`
    header (what its clients send) when there is no bearer token."""
    return bearer_token(headers.get("Authorization", "")) or headers.get("x-api-key", "").strip().encode(
        "utf-8", "surrogatepass"
    )


def browser_checks(bound_host: str | None, allowed_origins: tuple[str, ...]) -> Middleware:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if not host_allowed(host, bound_host):
            raise ApiError(403, f"this server does not answer for host {host!r} (it listens on loopback only)")
        if request.match_info.http_exception is not None:
            return await handler(request)  # unknown path or method: its 404 / 405 says more than we would
        if request.path == "/ws" and not origin_allowed(request.headers.get("Origin"), host, allowed_origins):
            # Refused before the upgrade: the page never gets a socket.
            raise ApiError(403, "websocket connections from this origin are not allowed (see --allowed-origins)")
        if request.method == "POST" and request.content_type != "application/json":
            raise ApiError(415, f"send the body as Content-Type: application/json, not {request.content_type!r}")
        return await handler(request)

    return check
