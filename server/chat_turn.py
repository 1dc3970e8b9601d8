"""One assistant turn, for the APIs that answer with exactly one (OpenAI's Responses API, Anthropic's
Messages API).

Each translates its request into a ChatRequest, which runs as /v1/chat/completions runs one
choice (`openai_api.start_chat`: the chat template, tools, structured output, sampling, limits),
so every API serves the same model the same way. The turn comes back as text or as tool calls:
whole (`Turn.reply`) or as it is generated (`Turn.deltas`). With tools, text is held back while
it may still turn out to be calls, as chat streaming holds it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ppserve.engine.model.tokenizer import Tokenizer
from ppserve.server import tokens, tool_calls
from ppserve.server.limits import check_limits
from ppserve.server.openai_api import start_chat
from ppserve.server.protocol import ChatRequest
from ppserve.server.state import STATE, TENANT
from ppserve.server.streams import Stream, merge


@dataclass
class Reply:
    text: str  # "" when the turn is calls
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's tool_calls entries
    finish: str = "stop"  # "stop", "length", "tool_calls" or "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    stop_sequence: str | None = None  # the stop string that ended the text, when one did


@dataclass
class Turn:
    body: ChatRequest
    stream: Stream
    tokenizer: Tokenizer
    prompt_tokens: int

    @classmethod
    async def start(cls, request: web.Request, body: ChatRequest, rid: str) -> Turn:
        """Check `body` as a chat request is checked (ApiError naming the chat field otherwise) and start it."""
        state = request.app[STATE]
        body.check()
        check_limits(body, state.options.limits)
        state.check_model(body.model)
        salt = state.cache_salt(request.get(TENANT), body.cache_salt)
        ids, streams = await start_chat(request, body, rid, salt)
        return cls(body, streams[0], state.ready.tokenizer, len(ids))

    async def reply(self) -> Reply:
        async with aclosing(self.deltas()) as items:
            async for item in items:
                if isinstance(item, Reply):
                    return item
        raise AssertionError("a turn ends with its reply")

    async def deltas(self) -> AsyncGenerator[str | Reply, None]:
        """The text as it comes (never empty pieces), then the Reply, whose `text` is all of it."""
        mode, tools = self.body.tool_mode, self.body.tools
        held: str | None = "" if mode else None  # text not sent yet, while it may be calls
        text, token_ids = "", []
        last = None
        async with aclosing(merge([self.stream])) as outputs:
            async for _, out in outputs:
                last = out
                text += out.text
                token_ids += out.token_ids
                if held is None:
                    if out.text:
                        yield out.text
                    continue
                held += out.text
                if mode == "auto" and not tool_calls.may_be_calls(held):
                    yield held
                    held = None
        assert last is not None, "a stream ends with a finished output"
        usage = (last.prompt_tokens, last.completion_tokens, last.cached_tokens)
        finish = last.finish_reason or "abort"
        calls = tool_calls.parse_calls(text, tools) if tools and mode and finish == "stop" else None
        if calls:
            yield Reply("", calls, "tool_calls", *usage)
            return
        if held:
            yield held
        yield Reply(text, [], finish, *usage, await self._stop_sequence(text, token_ids, finish))

    async def _stop_sequence(self, text: str, token_ids: list[int], finish: str) -> str | None:
        """The stop string that ended the text: the text is cut before the first one that appears,
        so it is the one that appears first in the whole output's decoding (None: EOS ended it)."""
        stops = self.body.stop
        if finish != "stop" or not stops:
            return None
        full = await tokens.decode(self.tokenizer, token_ids)
        found = [(i, s) for s in ([stops] if isinstance(stops, str) else stops) if (i := full.find(s)) >= 0]
        return min(found)[1] if found else None
