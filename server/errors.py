"""The error a handler answers to its client: an HTTP status, a clipped message and the request
field at fault, in OpenAI's JSON shape. Its own module, so that every request schema can raise it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ppserve.server.client_errors import CLIENT_GONE

log = logging.getLogger("ppserve.server")

MAX_MESSAGE_CHARS = 400  # of an error message: those that quote the input quote a bounded part of it


def clip_message(message: str) -> str:
    """`message`, or its head and tail when longer than MAX_MESSAGE_CHARS: an error that quotes
    a client's input (a 64 KiB grammar, a huge id) must not send it all back, nor log it."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    head, tail = MAX_MESSAGE_CHARS * 2 // 3, MAX_MESSAGE_CHARS // 4
    return f"{message[:head]} ... [{len(message) - head - tail} characters left out] ... {message[-tail:]}"


class ApiError(Exception):
    """An error answered to the client: status, message (clipped), and the request field at fault."""

    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        message = clip_message(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return {
            400: "invalid_request_error",
            401: "authentication_error",
            403: "permission_error",
            404: "not_found_error",
            408: "invalid_request_error",
            413: "invalid_request_error",
            415: "invalid_request_error",
            429: "rate_limit_error",
            503: "service_unavailable",
        }.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


@web.middleware
async def json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
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
