"""What every handler shares: the server's options, its state (the engine, metrics, tenants) and
the request keys the middlewares set. Handlers reach it as `request.app[STATE]`; the routes live in
app.py (health, models, admin) and one module per API."""

from __future__ import annotations

import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Hashable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Literal

from aiohttp import web

from ppserve.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError, EngineStats
from ppserve.engine.client_share import ClientLimitError
from ppserve.engine.config import EngineConfig
from ppserve.engine.outputs import RequestOutput
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.server import tokens
from ppserve.server.errors import ApiError
from ppserve.server.limits import RequestLimits
from ppserve.server.metrics import ServerMetrics
from ppserve.server.protocol import RETRY_AFTER_S
from ppserve.server.streams import as_api_error
from ppserve.server.tenants import PrefixCacheScope, Tenant, Tenants


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
