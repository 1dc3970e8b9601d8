"""Client connections: how many may be open, and how long one may take to send a request.

Each connection costs a file descriptor; a server that keeps every connection a client opens
runs out of them, and then cannot even answer /health. Three bounds, all in `ServerOptions`:

- Idle keep-alive connections close after `keepalive_timeout_s` (aiohttp's own timer, set
  through the app's `handler_args`, so `web.run_app(create_app(...))` has it too).
- A connection must send a request's headers within `read_timeout_s`: counted from its opening,
  or from the first byte of a later request on it (so a request dribbled a byte at a time ends
  too). A request's body must arrive within the same time (`read_body`, an app middleware: 408).
  A handler that is running is never cut, however long it stays silent (a long completion, a
  stream that waits for its first token, a websocket).
- Past `max_connections` open at once, a connection is still accepted, but every request on it
  except /health gets a 503 and the connection closes: probes keep working, the rest is told to
  come back, and the count falls again.

The read timeout and the limit need per-connection state that aiohttp does not keep (its
keep-alive timer counts from the last response, not from a request's first byte).
`ConnectionGuard` wraps each of aiohttp's `RequestHandler`s in a thin protocol that counts it
and arms its timer; `GuardedSite` is a `web.SockSite` whose connections go through that wrapper
(with `web.run_app`, only the keep-alive timer and the body's timeout apply).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestHandler

from ppserve.server.errors import ApiError
from ppserve.server.protocol import RETRY_AFTER_S

log = logging.getLogger("ppserve.server")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LOG_EVERY_S = 10.0  # connections refused past the limit are logged at most this often, counted
# Past the limit a connection must send its request quickly: a probe does at once, and each
# such connection still holds a file descriptor.
OVER_LIMIT_READ_S = 2.0
OPEN_PAST_LIMIT = frozenset({"/health"})
# Connections the kernel completes before the server accepts them (aiohttp's default is 128):
# past it, a burst of clients waits out SYN retransmits (1 s, then 3 s, ...). Capped by somaxconn.
BACKLOG = 1024
FD_RESERVE = 256  # descriptors besides client connections: listening, stage and engine sockets, files
# A handler waiting for the next request holds a pending `_waiter` (aiohttp's own keep-alive
# timer tests the same); `_request_count` counts the requests parsed on the connection. Both
# are checked here and in the tests, so an aiohttp that renames them fails CI rather than
# silently dropping the header timeout (its keep-alive timer would still bound idle connections).
CAN_TELL_IDLE = hasattr(RequestHandler, "_waiter") and hasattr(RequestHandler, "_request_count")


def _waiting_for_request(handler: RequestHandler) -> bool:
    waiter = handler._waiter
    return waiter is not None and not waiter.done()


class ConnectionGuard:
    """The open connections of one app, and the limits they live under."""

    def __init__(self, read_timeout_s: float, max_connections: int) -> None:
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self.open: dict[RequestHandler, _Connection] = {}
        self._refused = 0  # past the limit since the last log line
        self._next_log = 0.0
        if not CAN_TELL_IDLE:
            log.warning("this aiohttp version hides its handlers' state: no header read timeout")

    def protocol_factory(self, make_handler: Callable[[], RequestHandler]) -> Callable[[], asyncio.Protocol]:
        return lambda: _Connection(self, make_handler())

    def past_limit(self, handler: RequestHandler) -> bool:
        conn = self.open.get(handler)
        return conn is not None and conn.past_limit

    def _admit(self, conn: _Connection) -> bool:
        """Count a new connection in; False if it is one too many (logged, rate-limited)."""
        past = len(self.open) >= self.max_connections
        self.open[conn.handler] = conn
        if past:
            self._refused += 1
            now = time.monotonic()
            if now >= self._next_log:
                log.warning(
                    "%d connection(s) past the limit of %d open connections (--max-connections) since the last "
                    "report: answering 503 except /health",
                    self._refused,
                    self.max_connections,
                )
                self._refused, self._next_log = 0, now + LOG_EVERY_S
        return not past


class _Connection(asyncio.Protocol):
    """aiohttp's handler for one connection, plus the timer that ends a request that never
    arrives. Every protocol event is passed on unchanged."""

    def __init__(self, guard: ConnectionGuard, handler: RequestHandler) -> None:
        self.guard = guard
        self.handler = handler
        self.past_limit = False
        self._timer: asyncio.TimerHandle | None = None
        self._requests_at_arming = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.past_limit = not self.guard._admit(self)
        self.handler.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        handler = self.handler
        # Bytes while the handler waits, and no timer for this request yet: a request starts.
        # (Bytes while a handler runs are its body, bounded by `read_body`, or a pipelined
        # request, bounded by the keep-alive timer once the handler is done.)
        if (
            CAN_TELL_IDLE
            and _waiting_for_request(handler)
            and (self._timer is None or handler._request_count != self._requests_at_arming)
        ):
            self._arm()
        handler.data_received(data)

    def eof_received(self) -> None:
        # None: the transport closes its end too, as with aiohttp's handler alone.
        self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.open.pop(self.handler, None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.handler.connection_lost(exc)

    def _arm(self) -> None:
        timeout = self.guard.read_timeout_s
        if not CAN_TELL_IDLE or timeout <= 0:
            return
        if self.past_limit:
            timeout = min(timeout, OVER_LIMIT_READ_S)
        if self._timer is not None:
            self._timer.cancel()
        self._requests_at_arming = self.handler._request_count
        self._timer = asyncio.get_running_loop().call_later(timeout, self._expire)

    def _expire(self) -> None:
        self._timer = None
        handler = self.handler
        # No whole request since the timer started, and none running: close. (Once a request
        # arrived its handler is in charge; an idle keep-alive connection is aiohttp's to end.)
        if handler._request_count == self._requests_at_arming and _waiting_for_request(handler):
            handler.force_close()


class GuardedSite(web.SockSite):
    """`web.SockSite` whose connections pass through the app's `ConnectionGuard`:

    runner = web.AppRunner(app); await runner.setup(); await GuardedSite(runner, sock).start()
    """

    def __init__(self, runner: web.AppRunner, sock: socket.socket, *, backlog: int = BACKLOG) -> None:
        super().__init__(runner, sock, backlog=backlog)
        self._guard = runner.app[CONNECTIONS]

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner, as SockSite.start does
        server = self._runner.server
        assert server is not None, "start the runner (runner.setup()) first"
        loop = asyncio.get_running_loop()
        factory = self._guard.protocol_factory(server)
        self._server = await loop.create_server(factory, sock=self._sock, backlog=self._backlog)


CONNECTIONS = web.AppKey("connections", ConnectionGuard)


def _closing(error: ApiError) -> web.Response:
    """An error answer after which the connection closes (its body, if any, is never read)."""
    response = web.json_response(error.body(), status=error.status, headers=error.headers)
    response.force_close()
    return response


def connection_limits(guard: ConnectionGuard, max_body_bytes: int) -> Middleware:
    """The outermost middleware: refuses a connection past the limit, and a declared body over
    `max_body_bytes` before any of it is read."""

    @web.middleware
    async def limits(request: web.Request, handler: Handler) -> web.StreamResponse:
        past = guard.past_limit(request.protocol)
        if past and request.path not in OPEN_PAST_LIMIT:
            message = f"the server has too many open connections ({guard.max_connections}); retry later"
            return _closing(ApiError(503, message, headers={"Retry-After": str(RETRY_AFTER_S)}))
        length = request.content_length
        if length is not None and length > max_body_bytes:
            return _closing(ApiError(413, f"the body is {length} bytes; the limit is {max_body_bytes}"))
        response = await handler(request)
        if past:
            response.force_close()
        return response

    return limits


def read_body(timeout_s: float) -> Middleware:
    """Reads a request's body within `timeout_s` (408 otherwise), after the checks that refuse
    it unread (auth). Handlers' own `request.read()` / `json()` then return the cached body."""

    @web.middleware
    async def read(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.body_exists and timeout_s > 0:
            try:
                await asyncio.wait_for(request.read(), timeout_s)
            except TimeoutError:
                return _closing(ApiError(408, f"the request body did not arrive within {timeout_s:g} s"))
        return await handler(request)

    return read


def raise_fd_limit(max_connections: int) -> None:
    """Each connection is a file descriptor: raise the soft limit to the hard one (free, and many
    systems start at 1024), and warn if `max_connections` cannot fit under it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 2**20
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft != resource.RLIM_INFINITY and max_connections + FD_RESERVE > soft:
        log.warning(
            "--max-connections %d is close to the open-file limit (%d): the server may run out of descriptors "
            "before it refuses connections; lower it, or raise the limit (ulimit -n)",
            max_connections,
            soft,
        )
