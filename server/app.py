"""The aiohttp application: routes, authentication, errors, and the engine's lifetime.

    app = create_app(EngineConfig.create(...), ServerOptions(api_key="..."))
    web.run_app(app, handler_cancellation=True)     # or `ppserve serve`

(handler_cancellation: a client that disconnects cancels its handler, which aborts its request.)

The engine starts with the app (`cleanup_ctx`) and stops with it. Handlers live in
`openai_api.py` (OpenAI-compatible), `native_api.py` (/generate, /ws) and `playground.py` (the
page at / and the /debug/pipeline it polls); what they share (turning a request into an engine
stream, with metrics) is `ServerState.submit`.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from aiohttp import web

from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.config import EngineConfig
from ppserve.server import (
    anthropic_api,
    embeddings_api,
    native_api,
    openai_api,
    openai_responses,
    openapi,
    playground,
    tokenizer_api,
)
from ppserve.server.client_errors import quiet_client_errors
from ppserve.server.connections import CONNECTIONS, ConnectionGuard, connection_limits, read_body
from ppserve.server.errors import ApiError, json_errors
from ppserve.server.protocol import RETRY_AFTER_S
from ppserve.server.security import api_key, bearer_token, browser_checks
from ppserve.server.state import (
    ADMIN,
    ADMIN_PATHS,
    PREFILL_AT,
    PREFILL_HEADER,
    PREFILL_PROOF_HEADER,
    STATE,
    TENANT,
    Handler,
    ServerOptions,
    ServerState,
)
from ppserve.server.version import installed_version
from ppserve.transport.cluster_key import route_proof_matches
from ppserve.transport.peers import AddressError, check_address

log = logging.getLogger("ppserve.server")
# No API key needed: probes, docs, and the playground page (it holds no secrets; what it fetches
# needs the key). /metrics needs it unless `metrics_public`: its counters tell how busy the server
# is and how often prompts share a cached prefix.
OPEN_PATHS = frozenset({"/health", "/version", "/openapi.json", "/"})


def create_app(config: EngineConfig, options: ServerOptions | None = None) -> web.Application:
    options = options or ServerOptions()
    quiet_client_errors()
    checks = browser_checks(options.host, options.allowed_origins)
    guard = ConnectionGuard(options.read_timeout_s, options.max_connections)
    app = web.Application(
        client_max_size=options.max_body_bytes,
        # Refusals that must close the connection come first; the body is read only once the
        # request passed the checks and auth.
        middlewares=[
            connection_limits(guard, options.max_body_bytes),
            json_errors,
            checks,
            _auth,
            read_body(options.read_timeout_s),
        ],
        handler_args={"keepalive_timeout": options.keepalive_timeout_s},
    )
    app[STATE] = ServerState(config, options)
    app[CONNECTIONS] = guard
    app.cleanup_ctx.append(_engine_lifetime)
    app.on_shutdown.append(shut_down)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)  # names such as org/model have a slash
    app.router.add_get("/version", version)
    app.router.add_get("/debug/timeline", timeline)
    app.router.add_post("/flush_cache", flush_cache)
    openai_api.add_routes(app)
    native_api.add_routes(app)
    tokenizer_api.add_routes(app)
    embeddings_api.add_routes(app)
    openai_responses.add_routes(app)
    anthropic_api.add_routes(app)
    openapi.add_routes(app)
    playground.add_routes(app, page=options.playground)
    return app


async def _engine_lifetime(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    engine = AsyncEngine(state.config)
    await engine.start()
    state.engine = engine
    try:
        yield
    finally:
        await engine.close()


async def shut_down(app: web.Application) -> None:
    """Refuse new requests, let those in flight finish within the drain window, then stop the
    engine (streams still open end with an error). Call it while the server still listens, so
    that /health says 503 meanwhile (`ppserve serve` does); aiohttp's own shutdown calls it too,
    but only after it stopped listening (for `web.run_app`). Once is enough."""
    state = app[STATE]
    if state.shutting_down:
        return
    state.shutting_down = True
    if state.engine is not None:
        if not await state.engine.drain(state.options.shutdown_timeout_s):
            log.info("shutdown: requests still running after %.0f s are ended", state.options.shutdown_timeout_s)
        await state.engine.close()
    for ws in list(state.websockets):
        await ws.close(code=1001, message=b"server shutting down")


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    open_path = request.path in OPEN_PATHS or (request.path == "/metrics" and state.options.metrics_public)
    admin = state.options.admin_key
    if request.path in ADMIN_PATHS and admin is not None:
        given = bearer_token(request.headers.get("Authorization", ""))
        request[ADMIN] = hmac.compare_digest(given, admin.encode("utf-8", "surrogatepass"))
    if not (open_path or request.get(ADMIN) or _browser_websocket(request)):
        tenant = state.tenants.match(api_key(request.headers))
        if tenant is None:
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')")
        request[TENANT] = tenant
    prefill = request.headers.get(PREFILL_HEADER)
    if prefill is None:
        return await handler(request)
    token = PREFILL_AT.set(_prefill_server(request.app[STATE].config, prefill, request.headers))
    try:
        return await handler(request)
    finally:
        PREFILL_AT.reset(token)


def _prefill_server(config: EngineConfig, prefill: str, headers: Mapping[str, str]) -> str:
    """The prefill server a router names for this request. This server will connect there, so
    it takes the address only with the router's proof of the cluster key (a client's header
    alone makes it connect nowhere), and only once it parses as a peer's address."""
    if config.disaggregation != "decode":
        raise ApiError(400, f"{PREFILL_HEADER} is for decode servers (--disaggregation-mode decode)")
    key = config.socket_key
    if key is not None and not route_proof_matches(key, headers.get(PREFILL_PROOF_HEADER, ""), prefill):
        raise ApiError(403, f"{PREFILL_HEADER} needs {PREFILL_PROOF_HEADER} from a router that holds the cluster key")
    try:
        return check_address(prefill, PREFILL_HEADER)
    except AddressError as e:
        raise ApiError(400, f"{e}: it must be a prefill server's bootstrap address, tcp://HOST:PORT") from None


def _browser_websocket(request: web.Request) -> bool:
    """A websocket upgrade without an Authorization header, as a browser makes it (it cannot set
    headers on one): let in, it sends the key as its first message (see native_api.py). A
    header that is there but wrong is a 401 as anywhere else."""
    return (
        request.path == "/ws"
        and "Authorization" not in request.headers
        and request.headers.get("Upgrade", "").lower() == "websocket"
    )


async def health(request: web.Request) -> web.Response:
    status, error = request.app[STATE].health()
    if status == "recovering":
        # A failed stage is being replaced: requests wait rather than fail, but a load balancer
        # should send new ones elsewhere for now.
        return web.json_response({"status": status}, status=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    stages = request.app[STATE].stage_nodes()
    if status == "ok":
        pd = request.app[STATE].disaggregation()
        return web.json_response({"status": status, **({"disaggregation": pd} if pd else {}), **stages})
    return web.json_response({"status": status, "error": error, **stages}, status=503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_card(request.app[STATE])]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: the served model's card, or 404 for another name."""
    state = request.app[STATE]
    name = request.match_info["model"]
    if name != state.options.served_model_name:
        raise ApiError(404, f"model {name!r} is not served here; use {state.options.served_model_name!r}", "model")
    return web.json_response(_card(state))


async def version(request: web.Request) -> web.Response:
    """GET /version: the server's version (no API key needed, as /health)."""
    return web.json_response({"version": installed_version()})


def _card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.options.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "ppserve",
        "max_model_len": state.config.max_model_len,
        "synthetic": state.config.synthetic_latency is not None,  # stages that only model timing
    }


async def flush_cache(request: web.Request) -> web.Response:
    """Forget cached prompt prefixes (requests running keep their KV): every tenant's with the
    admin key (`--admin-key`), a tenant's own with its API key. Emptying others' caches slows their
    next requests, so nothing else may."""
    state = request.app[STATE]
    if request.get(ADMIN):
        return web.json_response({"freed_blocks": state.ready.scheduler.flush_cache(), "scope": "all"})
    tenant = request.get(TENANT)
    if tenant is None or not tenant.tag or state.tenants.scope == "shared":
        raise ApiError(
            403,
            "/flush_cache empties every client's cached prefixes only with the admin key (start the server with "
            "--admin-key); with a tenant's API key (--api-key, under --prefix-cache-scope api-key), its own",
        )
    freed = state.ready.scheduler.flush_cache(state.tenants.salt_prefix(tenant))
    return web.json_response({"freed_blocks": freed, "scope": "tenant"})


async def timeline(request: web.Request) -> web.Response:
    """Recent per-stage compute intervals as Chrome trace JSON (open it in Perfetto)."""
    state = request.app[STATE]
    engine = state.ready
    label = "ppserve (synthetic stages)" if state.config.synthetic_latency else "ppserve"
    return web.json_response(engine.timeline.chrome_trace(label))
