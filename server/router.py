"""`ppserve router`: the OpenAI-compatible front of a disaggregated deployment.

    client --HTTP--> router --HTTP + X-PPServe-Prefill: <bootstrap>--> decode server --stream--> client
                                                                          |  RoomOpen, first token,
                                                                          |  KV stage to stage
                                                                      prefill server

Each request goes to the least loaded healthy decode server, with the bootstrap address of the
least loaded healthy prefill server in a header; the decode server opens the room there, and its
stream comes back through the router unchanged. Every second the router reads each server's
/health (which says its side and, for prefill, its bootstrap address); a server that fails it
leaves the rotation until it passes again. The router's own errors have the server's shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import socket
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from ppserve.server import playground
from ppserve.server.access_log import TrafficLogger
from ppserve.server.client_errors import CLIENT_GONE, quiet_client_errors
from ppserve.server.connections import CONNECTIONS, ConnectionGuard, GuardedSite, connection_limits, read_body
from ppserve.server.errors import ApiError, json_errors
from ppserve.server.state import PREFILL_HEADER, PREFILL_PROOF_HEADER, ServerOptions
from ppserve.transport.cluster_key import route_proof
from ppserve.transport.peers import check_address

log = logging.getLogger("ppserve.router")
CHECK_S = 1.0
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # between two reads of a decode server's answer (a non-streaming one comes at the end)
# Everything that computes goes to a decode server (an embedding is computed there whole).
ROUTED = ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses", "/v1/messages", "/v1/embeddings")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?(\s.*)$")


@dataclass
class Backend:
    url: str
    side: str  # "prefill" | "decode"
    healthy: bool = False
    bootstrap: str = ""  # prefill: where decode servers reach it
    inflight: int = 0
    routed: int = 0
    why: str = "not checked yet"


@dataclass
class Router:
    backends: list[Backend]
    key: bytes | None  # the cluster key: proves to decode servers that the router names the prefill server
    read_timeout_s: float = READ_TIMEOUT_S
    session: aiohttp.ClientSession | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def prefill_headers(self, prefill: Backend) -> dict[str, str]:
        """What tells a decode server where this request's prompt is prefilled."""
        headers = {PREFILL_HEADER: prefill.bootstrap}
        if self.key is not None:
            headers[PREFILL_PROOF_HEADER] = route_proof(self.key, prefill.bootstrap)
        return headers

    def pick(self, side: str) -> Backend:
        ready = [b for b in self.backends if b.side == side and b.healthy]
        if not ready:
            raise ApiError(503, f"no {side} server is healthy", headers={"Retry-After": "1"})
        return min(ready, key=lambda b: (b.inflight, b.routed))

    async def check(self, backend: Backend) -> None:
        assert self.session is not None
        try:
            async with self.session.get(backend.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                body = await resp.json(content_type=None)
            pd = body.get("disaggregation") or {}
            if resp.status != 200:
                raise ValueError(f"/health answered {resp.status}: {body.get('error') or body.get('status')}")
            if pd.get("mode") != backend.side:
                raise ValueError(f"it is not a {backend.side} server (--disaggregation-mode {backend.side})")
            if backend.side == "prefill":
                backend.bootstrap = check_address(pd.get("bootstrap"), "its bootstrap address")
            if not backend.healthy:
                log.info("%s server %s is in the rotation", backend.side, backend.url)
            backend.healthy, backend.why = True, ""
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as e:  # AddressError too
            if backend.healthy or backend.why == "not checked yet":
                log.warning("%s server %s leaves the rotation: %s", backend.side, backend.url, e or type(e).__name__)
            backend.healthy, backend.why = False, str(e) or type(e).__name__

    async def watch(self) -> None:
        while True:
            await asyncio.gather(*(self.check(b) for b in self.backends))
            await asyncio.sleep(CHECK_S)


ROUTER = web.AppKey("router", Router)


async def route(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER]
    decode, prefill = router.pick("decode"), router.pick("prefill")
    passed = ("Content-Type", "Authorization", "x-api-key", "Accept")
    headers = {k: v for k, v in request.headers.items() if k.lower() in {p.lower() for p in passed}}
    headers.update(router.prefill_headers(prefill))
    body = await request.read()
    assert router.session is not None
    decode.inflight += 1
    prefill.inflight += 1
    decode.routed += 1
    prefill.routed += 1
    out: web.StreamResponse | None = None
    try:
        async with router.session.post(decode.url + request.path, data=body, headers=headers) as upstream:
            out = web.StreamResponse(status=upstream.status, headers=_passed(upstream.headers))
            await out.prepare(request)
            async for data in upstream.content.iter_any():
                await out.write(data)
            await out.write_eof()
            return out
    except (aiohttp.ClientError, TimeoutError) as e:
        gap = f"sent nothing for {router.read_timeout_s:g} s" if isinstance(e, TimeoutError) else str(e)
        why = f"decode server {decode.url} failed: {gap or type(e).__name__}"
        if out is None:
            raise ApiError(503, why, headers={"Retry-After": "1"}) from None
        # The answer has begun: a stream ends with an error event and [DONE], as the server's own do.
        log.warning("%s %s: %s", request.method, request.path, why)
        if out.headers.get("Content-Type", "").startswith("text/event-stream"):
            with contextlib.suppress(*CLIENT_GONE):
                await out.write(b"data: " + json.dumps(ApiError(503, why).body()).encode() + b"\n\ndata: [DONE]\n\n")
        return out
    finally:
        decode.inflight -= 1
        prefill.inflight -= 1


def _passed(headers: Mapping[str, str]) -> dict[str, str]:
    keep = ("Content-Type", "Cache-Control", "Retry-After")
    return {k: v for k, v in headers.items() if k in keep}


async def websocket(request: web.Request) -> web.StreamResponse:
    """/ws, message for message, to a decode server (its first-message auth passes through)."""
    router = request.app[ROUTER]
    decode, prefill = router.pick("decode"), router.pick("prefill")
    assert router.session is not None
    headers = router.prefill_headers(prefill)
    if "Authorization" in request.headers:
        headers["Authorization"] = request.headers["Authorization"]
    try:
        upstream = await router.session.ws_connect(decode.url + "/ws", headers=headers)
    except aiohttp.ClientError as e:
        raise ApiError(503, f"decode server {decode.url} failed: {e}", headers={"Retry-After": "1"}) from None
    client = web.WebSocketResponse()
    await client.prepare(request)
    decode.inflight += 1
    try:
        pumps = [asyncio.create_task(_pump(client, upstream)), asyncio.create_task(_pump(upstream, client))]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
    finally:
        decode.inflight -= 1
        await upstream.close()
        await client.close(code=upstream.close_code or aiohttp.WSCloseCode.OK)
    return client


async def _pump(
    src: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
    dst: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
) -> None:
    async for msg in src:
        if msg.type == aiohttp.WSMsgType.TEXT:
            await dst.send_str(msg.data)
        elif msg.type == aiohttp.WSMsgType.BINARY:
            await dst.send_bytes(msg.data)


async def from_decode(request: web.Request) -> web.StreamResponse:
    """A GET answered by a decode server: /v1/models, and the playground's /debug/pipeline (the
    pipeline of the server that requests go to now)."""
    router = request.app[ROUTER]
    decode = router.pick("decode")
    assert router.session is not None
    auth = {"Authorization": request.headers["Authorization"]} if "Authorization" in request.headers else {}
    url = decode.url + request.path_qs
    try:
        async with router.session.get(url, headers=auth, timeout=aiohttp.ClientTimeout(total=10)) as upstream:
            return web.Response(body=await upstream.read(), status=upstream.status, content_type="application/json")
    except (aiohttp.ClientError, TimeoutError) as e:
        raise ApiError(503, f"decode server {decode.url} failed: {e or type(e).__name__}") from None


async def health(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    sides = {
        side: [
            {"url": b.url, "healthy": b.healthy, **({"error": b.why} if b.why else {})}
            for b in router.backends
            if b.side == side
        ]
        for side in ("prefill", "decode")
    }
    ok = all(any(b["healthy"] for b in servers) for servers in sides.values())
    return web.json_response({"status": "ok" if ok else "unhealthy", **sides}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    """Every healthy server's metrics with a `backend` label, after the router's own."""
    router = request.app[ROUTER]
    lines = ["# TYPE ppserve_router_backend_healthy gauge", "# TYPE ppserve_router_requests_total counter"]
    for b in router.backends:
        label = f'backend="{b.url}",side="{b.side}"'
        lines.append(f"ppserve_router_backend_healthy{{{label}}} {int(b.healthy)}")
        lines.append(f"ppserve_router_requests_total{{{label}}} {b.routed}")
    seen: set[str] = set()
    assert router.session is not None
    # The servers' /metrics need their API key (unless --metrics-public): the scraper's passes through.
    auth = {"Authorization": request.headers["Authorization"]} if "Authorization" in request.headers else {}
    for b in router.backends:
        if not b.healthy:
            continue
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            timeout = aiohttp.ClientTimeout(total=2)
            async with router.session.get(b.url + "/metrics", headers=auth, timeout=timeout) as resp:
                text = await resp.text() if resp.status == 200 else ""
            lines += _relabel(text, b.url, seen)
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def _relabel(text: str, url: str, seen: set[str]) -> list[str]:
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            if line not in seen:  # one HELP and TYPE per family
                seen.add(line)
                out.append(line)
            continue
        if m := _SAMPLE.match(line):
            name, labels, rest = m.group(1), m.group(2), m.group(3)
            inner = f"backend={json.dumps(url)}" + (f",{labels[1:-1]}" if labels and labels != "{}" else "")
            out.append(f"{name}{{{inner}}}{rest}")
    return out


def create_router(
    prefill: list[str], decode: list[str], key: bytes | None, read_timeout_s: float = READ_TIMEOUT_S
) -> web.Application:
    """`key`: the cluster key of the servers behind (None: they run with --insecure-cluster)."""
    backends = [Backend(u.rstrip("/"), "prefill") for u in prefill]
    backends += [Backend(u.rstrip("/"), "decode") for u in decode]
    # Clients meet the router first: it bounds their connections as a server does (its defaults),
    # and logs their mistakes (junk on the port, a client gone) as the servers do.
    quiet_client_errors()
    limits = ServerOptions()
    guard = ConnectionGuard(limits.read_timeout_s, limits.max_connections)
    app = web.Application(
        client_max_size=limits.max_body_bytes,
        # The router's own errors have the servers' shape.
        middlewares=[connection_limits(guard, limits.max_body_bytes), json_errors, read_body(limits.read_timeout_s)],
        handler_args={"keepalive_timeout": limits.keepalive_timeout_s},
    )
    app[CONNECTIONS] = guard
    app[ROUTER] = Router(backends, key, read_timeout_s)

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        router = app[ROUTER]
        # No total timeout (a stream may last hours), only one between two reads of a server.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=read_timeout_s)
        router.session = aiohttp.ClientSession(timeout=timeout)
        router.tasks.append(asyncio.create_task(router.watch()))
        yield
        for task in router.tasks:
            task.cancel()
        await asyncio.gather(*router.tasks, return_exceptions=True)
        await router.session.close()

    app.cleanup_ctx.append(lifetime)
    for path in ROUTED:
        app.router.add_post(path, route)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", from_decode)
    app.router.add_get("/ws", websocket)
    # The playground: the page itself, and what it polls from the decode server it would chat with.
    app.router.add_get("/", playground.playground)
    app.router.add_get("/debug/pipeline", from_decode)
    return app


async def serve_router(
    prefill: list[str], decode: list[str], sockets: list[socket.socket], key: bytes | None, read_timeout_s: float
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    app = create_router(prefill, decode, key, read_timeout_s)
    runner = web.AppRunner(app, handler_cancellation=True, access_log_class=TrafficLogger)
    await runner.setup()
    try:
        for sock in sockets:
            await GuardedSite(runner, sock).start()
        for h, p, *_ in runner.addresses:
            url = f"http://[{h}]:{p}" if ":" in h else f"http://{h}:{p}"
            print(f"ppserve: routing to {len(prefill)} prefill and {len(decode)} decode server(s) at {url}", flush=True)
        await stop.wait()
        print("ppserve: shutting down", flush=True)
    finally:
        await runner.cleanup()
