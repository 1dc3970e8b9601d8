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
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Hashable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from ppserve.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError, EngineStats
from ppserve.engine.client_share import ClientLimitError
from ppserve.engine.config import EngineConfig
from ppserve.engine.outputs import RequestOutput
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.server import tokens
from ppserve.server.client_errors import CLIENT_GONE, quiet_client_errors
from ppserve.server.connections import CONNECTIONS, ConnectionGuard, connection_limits, read_body
from ppserve.server.limits import RequestLimits
from ppserve.server.metrics import ServerMetrics
from ppserve.server.protocol import RETRY_AFTER_S, ApiError
from ppserve.server.security import api_key, bearer_token, browser_checks
from ppserve.server.streams import as_api_error
from ppserve.server.tenants import PrefixCacheScope, Tenant, Tenants
from ppserve.transport.cluster_key import route_proof_matches
from ppserve.transport.peers import AddressError, check_address

log = logging.getLogger("ppserve.server")
# No API key needed: probes, docs, and the playground page (it holds no secrets; what it fetches
# needs the key). /metrics needs it unless `metrics_public`: its counters tell how busy the server
# is and how often prompts share a cached prefix.
OPEN_PATHS = frozenset({"/health", "/version", "/openapi.json", "/"})


@dataclass(frozen=True)
class ServerOptions:
    served_model_name: str = "ppserve"
    api_key: str | None = None
    api_keys: tuple[str, ...] = ()  # more keys, one per tenant (server/tenants.py), besides api_key
    # Who shares cached prompt prefixes: requests of one API key ("api-key"), or everyone ("shared");
    # a request's `cache_salt` separates further either way.
    prefix_cache_scope: PrefixCacheScope = "api-key"
    admin_key: str | None = None  # for /flush_cache of every tenant's cached prefixes
    max_body_bytes: int = 16 * 2**20
    shutdown_timeout_s: float = 10.0  # on shutdown, requests in flight may finish for this long
    # The address the server listens on: bound to loopback, it answers only loopback Host names
    # (DNS rebinding). None: not known here, Host is not checked.
    host: str | None = None
    allowed_origins: tuple[str, ...] = ()  # websocket Origins besides the server's own; "*": all
    playground: bool = True  # serve the playground page at /
    limits: RequestLimits = field(default_factory=RequestLimits)  # on the lists and strings of requests
    metrics_public: bool = False  # /metrics without the API key (scrapers that cannot send one)
    # Client connections (see connections.py). Keep-alive: longer than common clients keep an idle
    # connection pooled (httpx 5 s, aiohttp 15 s), so they drop it first and never send a request
    # on a connection the server is closing; behind a load balancer, set it above the balancer's.
    keepalive_timeout_s: float = 30.0
    read_timeout_s: float = 30.0  # a request's headers, and then its body, must arrive within this
    max_connections: int = 4096  # open at once; past it, 503 (but /health) and close

    @property
    def keys(self) -> tuple[str, ...]:
        """Every API key the server accepts (none: it accepts any request)."""
        return tuple(dict.fromkeys(k for k in (self.api_key, *self.api_keys) if k))

    def __post_init__(self) -> None:
        for name, flag in (("keepalive_timeout_s", "--keepalive-timeout"), ("read_timeout_s", "--read-timeout")):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} ({flag}) must be > 0 seconds, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections (--max-connections) must be >= 1, got {self.max_connections}")


@dataclass
class ServerState:
    config: EngineConfig
    options: ServerOptions
    engine: AsyncEngine | None = None
    shutting_down: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    websockets: weakref.WeakSet[web.WebSocketResponse] = field(default_factory=weakref.WeakSet)
    metrics: ServerMetrics = field(init=False)
    tenants: Tenants = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.stats)
        self.tenants = Tenants(self.options.keys, self.options.prefix_cache_scope, self.config.socket_key)

    def stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    def key_matches(self, given: bytes) -> bool:
        """Whether `given` is one of the API keys (always, if the server has none); constant-time,
        on bytes (Tenants.match)."""
        return self.tenants.match(given) is not None

    def cache_salt(self, tenant: Tenant | None, salt: str | None) -> str | None:
        """The cache salt the engine gets for a request of `tenant` (None: the request was let in
        without a key, which only a server without keys does) with the client's own `salt`."""
        if tenant is None:
            if self.tenants.keyed:  # never reached through the auth middleware; fail closed
                raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")
            return salt
        return self.tenants.cache_salt(tenant, salt)

    def health(self) -> tuple[Literal["ok", "recovering", "unhealthy"], str | None]:
        """The status word of /health, and why it is unhealthy."""
        engine = self.engine
        if engine is not None and engine.unavailable is not None and engine.error is None:
            return "unhealthy", str(engine.unavailable)  # no room for a stage: the engine keeps trying
        if engine is not None and engine.recovering and not self.shutting_down:
            return "recovering", None
        if engine is not None and engine.healthy and not self.shutting_down:
            return "ok", None
        return "unhealthy", "shutting down" if self.shutting_down else str(engine.error if engine else "starting")

    @property
    def ready(self) -> AsyncEngine:
        """The engine, if it can take requests (else a 503)."""
        if self.shutting_down or self.engine is None:
            raise ApiError(503, "the server is shutting down", headers={"Retry-After": str(RETRY_AFTER_S)})
        return self.engine

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.options.served_model_name:
            raise ApiError(400, f"model {model!r} is not served here; use {self.options.served_model_name!r}", "model")

    async def encode(self, prompt: str | Sequence[int], field_name: str = "prompt") -> list[int]:
        """Token ids of a prompt; text that cannot fit the context is a 400 naming `field_name`,
        before any tokenizing, and long text is tokenized off the event loop."""
        if not isinstance(prompt, str):
            return list(prompt)
        return await tokens.encode(self.ready.tokenizer, prompt, self.config.max_model_len, field_name)

    def check_count(self, count: int, field_name: str) -> None:
        """A request of `count` streams (prompts x n) that the waiting queue could never hold is
        a 400 now, not a 503 that invites the client to retry it forever."""
        limit = self.config.max_waiting_requests
        if count > limit:
            raise ApiError(
                400,
                f"this request needs {count} completions (prompts x n), more than the server can ever queue "
                f"({limit}, --max-waiting-requests)",
                field_name,
            )

    def max_tokens(
        self, ids: Sequence[int], requested: int | None, field_name: str = "max_tokens", default: int | None = None
    ) -> int:
        """`requested`; if None, the model's generation_config.json `max_new_tokens`, else the
        endpoint's `default`, else all the context that is left (a default never exceeds what is
        left). A request that cannot fit is a 400."""
        limit = self.config.max_model_len
        room = limit - len(ids)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context length is {limit}", "prompt")
        if requested is None:
            fallback = self.config.model_config.max_new_tokens or default
            return room if fallback is None else min(room, fallback)
        if requested > room:
            raise ApiError(
                400,
                f"{field_name} is {requested} but the prompt has {len(ids)} tokens and this model's "
                f"context length is {limit}, which leaves {room}",
                field_name,
            )
        return requested

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        pending: int = 0,
        cache_salt: str | None = None,
        client: Hashable | None = None,
        pool: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Check the request now (so errors come before any response is sent), then stream it
        (`pool`: an embedding, AsyncEngine.embed's).
        `pending`: streams of the same HTTP request submitted before this one (not queued yet).
        `cache_salt`: the engine's (`cache_salt` above), not the client's. `client`: `client_of`
        the HTTP request, whose share of the queue it counts against."""
        engine = self.ready
        try:
            engine.check_request(prompt_ids, params, pending, cache_salt, client)
        except ValueError as e:  # the prompt cannot be served (length, token ids)
            message = str(e) if "prompt" in str(e) else f"invalid prompt: {e}"
            raise ApiError(400, message, "prompt") from None
        except (EngineOverloadedError, EngineDeadError, ClientLimitError) as e:
            raise as_api_error(e) from None
        prefill = None if pool else PREFILL_AT.get()  # an embedding is computed here, never prefilled elsewhere
        stream = engine.generate(
            prompt_ids, params, request_id, prefill=prefill, cache_salt=cache_salt, client=client, pool=pool
        )
        return self.metrics.track(stream)

    async def check_grammar(self, params: SamplingParams, field_name: str = "structured_outputs") -> None:
        """A 400 naming `field_name` (where the constraint came from) and llguidance's reason
        unless the request's grammar compiles: before anything is queued or sent."""
        if params.grammar:
            try:
                await self.ready.check_grammar(params.grammar)
            except ValueError as e:
                raise ApiError(400, f"{field_name}: {e}", field_name) from None

    def stage_nodes(self) -> dict[str, list[dict[str, str | int]]]:
        """Under Ray, for /health: `stages`, each stage's Ray node id and address."""
        if self.engine is None or not (nodes := self.engine.stage_nodes):
            return {}
        return {"stages": [{"stage": i, "node_id": n, "address": a} for i, (n, a) in enumerate(nodes)]}

    def disaggregation(self) -> dict[str, str] | None:
        """This server's side of a disaggregated pair, for /health (a router reads it)."""
        engine, mode = self.engine, self.config.disaggregation
        if not mode or engine is None or engine.rooms is None:
            return None
        return {"mode": mode, "bootstrap": engine.rooms.address}


STATE = web.AppKey("state", ServerState)

# The tenant whose key a request carried (set by the auth middleware on every keyed path).
TENANT = web.RequestKey("tenant", Tenant)
ADMIN = web.RequestKey("admin", bool)  # whether the request carried the admin key (on ADMIN_PATHS)
ADMIN_PATHS = frozenset({"/flush_cache"})
# Disaggregation: a router names the prefill server of a request sent to a decode server here.
PREFILL_HEADER = "X-PPServe-Prefill"
PREFILL_PROOF_HEADER = "X-PPServe-Prefill-Proof"  # transport/cluster_key.py's route_proof
PREFILL_AT: ContextVar[str | None] = ContextVar("prefill_at", default=None)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def client_of(request: web.Request) -> Hashable:
    """Who an HTTP request comes from, for its share of the queue (`client_key`)."""
    return client_key(request.app[STATE].options, request.get(TENANT), request.transport)


def client_key(options: ServerOptions, tenant: Tenant | None, connection: object) -> Hashable:
    """Who a request comes from, for its share of the queue (`max_requests_per_client`): the
    tenant of its API key on a server with several keys, else its connection (a websocket, or an
    HTTP connection for the requests it carries). One key is often shared by every user of a
    deployment behind a gateway: it names no one client."""
    if tenant is not None and tenant.tag and len(options.keys) > 1:
        return tenant.tag
    return ("connection", id(connection))


def create_app(config: EngineConfig, options: ServerOptions | None = None) -> web.Application:
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
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as OpenAI's JSON error shape (the router's too)."""
    try:
        return await handler(request)
    except ApiError as e:
        return web.json_response(e.body(), status=e.status, headers=e.headers)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None  # 405 says what is allowed
        return web.json_response(ApiError(e.status, e.reason).body(), status=e.status, headers=headers)
    except CLIENT_GONE:
        # The client went away mid-request: nobody to answer, and not our error. (499: "client
        # closed request", for the access log; aiohttp cannot send it.)
        log.info("client went away during %s %s", request.method, request.path)
        return web.Response(status=499)
    except Exception:
        log.exception("error handling %s %s", request.method, request.path)
        return web.json_response(ApiError(500, "internal server error").body(), status=500)


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
    from ppserve.server.cli import version as installed

    return web.json_response({"version": installed()})


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
