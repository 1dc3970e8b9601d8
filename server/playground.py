"""The playground: a page at GET / to chat with the model and watch the pipeline work, and
GET /debug/pipeline, the one endpoint it polls.

The page (playground.html, shipped inside the package) is one file with no external resources,
served under a Content-Security-Policy that lets it run only its own inline script and style
and talk only to this server. It needs no API key to load: it holds no secrets, and everything it fetches asks
for the key (the websocket in its first message, as browsers cannot set headers on one).

/debug/pipeline answers, in one poll, what the page draws: health, queue, KV cache, each stage's
busy share, and the stages' compute intervals that ended after `since`. An interval reaches the
server with its micro-batch's result, after it ended, so a client cannot ask "since my last
poll"; but each stage's intervals arrive in the order they ran (see `Timeline.recent`), so a
client that keeps the newest `end` it has per stage, asks with the smallest of those, and drops
what is not newer than its stage's, misses nothing and draws nothing twice.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import math
import re
import time
from importlib import resources

import msgspec
from aiohttp import web

from ppserve.server.errors import ApiError
from ppserve.server.state import STATE

WINDOW_S = 10.0  # the span of `stage_busy`, and of the page's lanes
MAX_INTERVALS = 2000  # per answer, the newest (a poll every 250 ms asks for far fewer)
# Only the page's own script and style, named by their hashes (so that no markup that ever got
# in could run a script of its own); connections to this server only (the websocket included:
# 'self' covers ws: and wss: to the same host); no plugins, frames, forms or base URL.
CSP = (
    "default-src 'none'; script-src {script}; style-src {style}; connect-src 'self'; img-src data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def add_routes(app: web.Application, page: bool = True) -> None:
    if page:
        app.router.add_get("/", playground)
    app.router.add_get("/debug/pipeline", pipeline)


@functools.cache
def _page() -> tuple[bytes, dict[str, str]]:
    """The page and its headers, its policy made from the hashes of its inline blocks."""
    html = resources.files("ppserve.server").joinpath("playground.html").read_text(encoding="utf-8")
    policy = CSP.format(**{tag: _hashes(html, tag) for tag in ("script", "style")})
    headers = {
        "Content-Security-Policy": policy,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",  # a new version of the server serves its new page
    }
    return html.encode("utf-8"), headers


def _hashes(html: str, tag: str) -> str:
    """CSP sources for the inline `<tag>` blocks of `html` (the page writes them bare)."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
    digests = (base64.b64encode(hashlib.sha256(b.encode("utf-8")).digest()).decode() for b in blocks)
    return " ".join(f"'sha256-{d}'" for d in digests) or "'none'"


async def playground(request: web.Request) -> web.Response:
    body, headers = _page()
    return web.Response(body=body, content_type="text/html", charset="utf-8", headers=headers)


async def pipeline(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.ready
    since = _since(request.query.get("since"))
    status, error = state.health()
    now = time.time()
    stats = engine.stats(WINDOW_S)
    view = {
        "time": now,  # the page's clock: the right edge of its window, whatever the browser's clock says
        "model": state.options.served_model_name,
        "pp_size": state.config.pp_size,
        "chat_template": engine.tokenizer.has_chat_template,  # without one, the page sends plain text
        "status": status,
        "error": error,
        "running": stats.running,
        "waiting": stats.waiting,
        "kv_blocks_used": stats.kv_blocks_used,
        "kv_blocks_total": stats.kv_blocks_total,
        "stage_busy": stats.stage_busy,
        "intervals": engine.timeline.recent(since, MAX_INTERVALS),  # dataclasses: msgspec writes their fields
        "kernels": engine.stage_kernels,
    }
    return web.Response(body=msgspec.json.encode(view), content_type="application/json")


def _since(text: str | None) -> float:
    """The `since` parameter: a JSON number of seconds (no NaN, no infinity); absent, all."""
    if text is None:
        return -math.inf
    try:
        value = msgspec.json.decode(text, type=float)
    except msgspec.MsgspecError:
        value = math.nan
    if not math.isfinite(value):
        raise ApiError(400, f"since must be a time in seconds since the epoch, got {text!r}", "since")
    return value
