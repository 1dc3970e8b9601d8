"""From engine streams to HTTP responses: collect one, merge several, write server-sent events."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from ppserve.engine.async_engine import EngineDeadError, EngineOverloadedError
from ppserve.engine.client_share import ClientLimitError
from ppserve.engine.disagg.rooms import DisaggregationError
from ppserve.engine.outputs import RequestOutput, TokenLogprob
from ppserve.engine.runtime.stage_pool import StageError
from ppserve.server.client_errors import CLIENT_GONE
from ppserve.server.errors import ApiError
from ppserve.server.protocol import RETRY_AFTER_S

log = logging.getLogger("ppserve.server")
_json = msgspec.json.Encoder()  # several times faster than json.dumps, for one event per token

Stream = AsyncGenerator[RequestOutput, None]


@dataclass
class Collected:
    """A whole request's outputs, joined."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked for (in the first output)
    embedding: list[float] | None = None  # an embedding request's, at its end
    draft_tokens: int = 0  # speculative decoding: draft tokens verified, kept, and the steps with drafts
    accepted_tokens: int = 0
    spec_steps: int = 0

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        self.finish_reason = out.finish_reason
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.embedding = out.embedding
        self.draft_tokens, self.accepted_tokens, self.spec_steps = out.draft_tokens, out.accepted_tokens, out.spec_steps


def speculative_usage(outs: Sequence[Collected | RequestOutput]) -> dict[str, Any] | None:
    """What speculative decoding did for these requests (their last outputs), for a usage object:
    None where none of their steps carried drafts."""
    drafted, kept, steps = (sum(getattr(o, f) for o in outs) for f in ("draft_tokens", "accepted_tokens", "spec_steps"))
    if not steps:
        return None
    return {"draft_tokens": drafted, "accepted_tokens": kept, "mean_acceptance_length": (kept + steps) / steps}


async def collect(streams: Sequence[Stream]) -> list[Collected]:
    """Run streams to the end, concurrently; an engine failure is a 503."""
    results = [Collected() for _ in streams]
    async with aclosing(merge(streams)) as outputs:
        async for i, out in outputs:
            results[i].add(out)
    return results


async def merge(streams: Sequence[Stream]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave several streams' outputs as they come, tagged with the stream's index.
    Leaving early (or failing) closes every stream, which aborts their requests."""
    if len(streams) == 1:  # the common case: no pump task, no queue, one hand-off less per token
        try:
            async with aclosing(streams[0]) as stream:
                async for out in stream:
                    yield 0, out
                    _check_failed(out)
        except Exception as e:
            raise as_api_error(e) from None
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: Stream) -> None:
        try:
            async with aclosing(stream):
                async for out in stream:
                    await queue.put((i, out))
            await queue.put((i, None))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise as_api_error(item)
            else:
                yield i, item
                _check_failed(item)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _check_failed(out: RequestOutput) -> None:
    """A request that ended with finish_reason "error" (its grammar stopped) fails the response:
    a 400 naming the reason, or in a stream, after the chunk that says "error", an error event."""
    if out.finish_reason == "error":
        raise ApiError(400, f"the output could not be completed: {out.error}")


def as_api_error(e: BaseException) -> BaseException:
    """What the engine raises for a request (before or while it runs), as the answer to the client."""
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(e, (EngineDeadError, StageError)):
        return ApiError(503, f"the engine cannot serve: {e}", headers=retry)
    if isinstance(e, ClientLimitError):
        return ApiError(429, f"too many requests: {e}", headers=retry)
    if isinstance(e, EngineOverloadedError):
        return ApiError(503, f"the server is busy: {e}", headers=retry)
    if isinstance(e, DisaggregationError):  # a room failed: its message names the side, stage and state
        return ApiError(503, f"disaggregated prefill failed: {e}", headers=retry)
    if isinstance(e, ValueError):
        return ApiError(400, str(e))
    return e


async def sse_response(
    request: web.Request,
    events: AsyncGenerator[dict[str, Any], None],
    error_event: Callable[[ApiError], dict[str, Any]] | None = None,
) -> web.StreamResponse:
    """Send `events` as server-sent events (`data: <json>`), then `data: [DONE]`. Once the 200 has
    gone out an error can only be one more event; closing `events` (always, even when the client
    is gone) aborts whatever requests it was streaming.

    `error_event`: typed events instead (the Responses and Messages APIs'): each is sent as
    `event: <its type>` and `data: <json>`, an error as `error_event(error)`, and no `[DONE]`."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    error: ApiError | None = None
    try:
        async with aclosing(events):
            async for event in events:
                await response.write(_sse(event, error_event is not None))
    except ApiError as e:
        error = e
    except CLIENT_GONE:
        # The client is gone (closing `events` above aborted its requests): nobody to tell, and
        # not a server error. Return the response as it is; aiohttp expects nothing more.
        log.info("client went away during the stream of %s", request.path)
        return response
    except Exception:
        log.exception("error while streaming %s", request.path)
        error = ApiError(500, "internal server error")
    try:
        if error is not None:
            await response.write(_sse(error_event(error), True) if error_event else _sse(error.body(), False))
        if error_event is None:
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except CLIENT_GONE:
        log.info("client went away at the end of the stream of %s", request.path)
    return response


def _sse(event: dict[str, Any], named: bool) -> bytes:
    head = b"event: " + event["type"].encode() + b"\n" if named else b""
    return head + b"data: " + _json.encode(event) + b"\n\n"
