"""Limits on the lists and strings a client sends, checked right after decoding.

The body size (16 MiB) bounds a request, but not what one can cost: 1M stop strings fit in it,
and every generated token was matched against each of them (one such request ran for many
seconds, and a few of them starved every other stream). So each list a request may send is
bounded, and so is each string that is kept for the whole request; going past a limit is a 400
naming the field and the limit, before any tokenizing or compute. The limits are flags of
`ppserve serve` (`RequestLimits`, held by ServerOptions), and the OpenAPI document shows them
(maxItems, maxLength).

Bounded elsewhere: ids and `user` (protocol.py, fixed lengths), `n` (MAX_N), prompts x n
(--max-waiting-requests), token-id prompts and text (the context length), `suffix` (taken only
when empty), `logit_bias` (SamplingParams), `tools` (tool_calls.py), and constraints' schemas,
regexes and grammars (engine/model/grammar.py). Value ranges are SamplingParams' own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, TypeVar

from ppserve.server.errors import ApiError
from ppserve.server.json_body import decode_async
from ppserve.server.protocol import ChatMessage, _Sampling

T = TypeVar("T")


@dataclass(frozen=True)
class RequestLimits:
    # OpenAI allows 4 stop strings, vLLM any number. 16 covers a chat template's several end
    # markers plus few-shot separators; each token's text is matched against every one of them
    # over a window of the longest one's length, so the cost per token is max_stop x max_stop_chars.
    max_stop: int = 16
    max_stop_chars: int = 512  # a stop string is a marker, not a document
    # Checked per token as a tuple membership test: a few hundred is free, a million is not.
    max_stop_token_ids: int = 256
    # Long agent conversations reach hundreds of turns; they must still fit the context.
    max_messages: int = 1024
    # Parts of one message: clients send a handful (text, images); each is a decoded dict.
    max_content_parts: int = 256

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{flag(f.name)} must be an integer >= 1, got {value!r}")


def flag(name: str) -> str:
    """The `ppserve serve` flag of a RequestLimits field."""
    return "--" + name.replace("_", "-")


async def decode_request(body: bytes | str, type_: type[T], limits: RequestLimits) -> T:
    """`decode_async` (protocol.py), then the limits: every request body goes through here."""
    request = await decode_async(body, type_)
    check_limits(request, limits)
    return request


def check_limits(request: object, limits: RequestLimits) -> None:
    """A 400 naming the first field of `request` that is past its limit."""
    if isinstance(request, _Sampling):
        _check_sampling(request, limits, "")
    sampling = getattr(request, "sampling_params", None)  # /generate and the websocket's messages
    if isinstance(sampling, _Sampling):
        _check_sampling(sampling, limits, "sampling_params.")
    messages = getattr(request, "messages", None)
    if isinstance(messages, list):
        _check_messages(messages, limits)


def _check_sampling(sampling: _Sampling, limits: RequestLimits, prefix: str) -> None:
    stop = [sampling.stop] if isinstance(sampling.stop, str) else (sampling.stop or [])
    _count(stop, limits, "max_stop", prefix + "stop", "stop strings")
    longest = max(stop, key=len, default="")
    if len(longest) > limits.max_stop_chars:
        raise ApiError(
            400,
            f"{prefix}stop: a stop string has {len(longest)} characters; the limit is {limits.max_stop_chars} "
            f"({flag('max_stop_chars')})",
            prefix + "stop",
        )
    _count(sampling.stop_token_ids, limits, "max_stop_token_ids", prefix + "stop_token_ids", "stop token ids")


def _check_messages(messages: list[ChatMessage], limits: RequestLimits) -> None:
    _count(messages, limits, "max_messages", "messages", "messages")
    for i, m in enumerate(messages):
        if isinstance(m.content, list) and len(m.content) > limits.max_content_parts:
            raise ApiError(
                400,
                f"messages[{i}].content has {len(m.content)} parts; the limit is {limits.max_content_parts} "
                f"({flag('max_content_parts')})",
                "messages",
            )


def _count(items: list[Any], limits: RequestLimits, limit_name: str, param: str, what: str) -> None:
    limit: int = getattr(limits, limit_name)
    if len(items) > limit:
        raise ApiError(400, f"{param}: {len(items)} {what}; the limit is {limit} ({flag(limit_name)})", param)
