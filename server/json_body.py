"""Request bodies, from JSON to the protocol's structs (server/protocol.py): decoded in time
linear in the body (every float through Python's `float()`), off the event loop when large, and
every error a 400 naming the field."""

from __future__ import annotations

import asyncio
import math
import re
from typing import Any, TypeVar

import msgspec

from ppserve.server.errors import ApiError
from ppserve.server.protocol import MAX_ID_CHARS, WsAuth, WsCancel, WsChat, WsGenerate, WsMessage

T = TypeVar("T")

_FIELD = re.compile(r" - at `\$\.?([A-Za-z_][\w.\[\]]*)`$")


# Bodies up to this size decode in well under a millisecond: on the event loop, no thread hop.
INLINE_BODY_BYTES = 64 * 2**10


class _BeyondFloat64(Exception):
    """A number that float64 cannot hold (1e999): raised by the float hook, named by `_out_of_range`."""


def _float(text: str) -> float:
    """Every JSON float literal goes through here rather than through msgspec's own parser. That
    one falls back to a slow big-decimal algorithm for exponents past its fast path's table (9e307
    costs orders of magnitude more than 1.5), in C, holding the GIL for the whole body: a body full
    of them froze the event loop even from a worker thread. Python's float() is fast for every
    literal, and a Python call per float lets the GIL change hands, so a large body decoded in a
    thread leaves the loop free. Linear in the body either way."""
    value = float(text)
    if math.isinf(value):
        raise _BeyondFloat64
    return value


def _float_or_inf(text: str) -> float:
    return float(text)  # a Python function, not `float` itself, for the GIL's sake (see `_float`)


_DECODER = msgspec.json.Decoder(float_hook=_float)
_INF_DECODER = msgspec.json.Decoder(float_hook=_float_or_inf)  # 1e999 -> inf, to find where it is


def decode(body: bytes | str, type_: type[T]) -> T:
    """Decode a JSON body into `type_`; errors name the field (400). A field that is null counts
    as absent (its default), as in OpenAI's API, where clients often send nulls: at the top level
    and in `sampling_params` (/generate, the websocket). Limits: `limits.decode_request`. Runs in
    the caller's thread: a server calls `decode_async`."""
    try:
        value = _DECODER.decode(body)
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if v is not None}
            if isinstance(value.get("sampling_params"), dict):
                value["sampling_params"] = {k: v for k, v in value["sampling_params"].items() if v is not None}
        return msgspec.convert(value, type=type_, strict=True)
    except _BeyondFloat64:
        raise _out_of_range(body) from None
    except msgspec.ValidationError as e:
        m = _FIELD.search(str(e))
        if m is None:
            raise ApiError(400, f"invalid request: {e}") from None
        # "Expected `int` <= 2147483647 - at `$.top_k`" -> "invalid top_k: Expected `int` <= 2147483647"
        raise ApiError(400, f"invalid {m.group(1)}: {str(e)[: m.start()]}", m.group(1)) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the JSON is nested too deeply") from None


async def decode_async(body: bytes | str, type_: type[T]) -> T:
    """`decode`, in a worker thread unless the body is small: decoding is linear in the body, and
    16 MiB of it would hold up every stream of the server (see `_float` for why a thread helps)."""
    if len(body) <= INLINE_BODY_BYTES:
        return decode(body, type_)
    return await asyncio.to_thread(decode, body, type_)


def _out_of_range(body: bytes | str) -> ApiError:
    """The 400 for a number beyond float64, naming its field (only on this error path)."""
    value: Any = _INF_DECODER.decode(body)
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:  # depth-first, iteratively (the JSON may be nested deeply)
        path, v = stack.pop()
        if isinstance(v, float) and math.isinf(v):
            field = path if len(path) <= MAX_ID_CHARS else path[:MAX_ID_CHARS] + "..."
            return ApiError(400, f"invalid {field}: a number beyond the range of a float64", field)
        if isinstance(v, dict):
            stack += [(f"{path}.{k}" if path else str(k), x) for k, x in reversed(v.items())]
        elif isinstance(v, list):
            stack += [(f"{path}[{i}]", x) for i, x in reversed(list(enumerate(v)))]
    return ApiError(400, "invalid request: a number is out of range")


def decode_ws(data: str) -> WsGenerate | WsChat | WsCancel | WsAuth:
    """A websocket message (`decode` of the tagged union, which mypy does not take for a type)."""
    message: WsGenerate | WsChat | WsCancel | WsAuth = decode(data, WsMessage)  # type: ignore[arg-type]
    return message


async def decode_ws_async(data: str) -> WsGenerate | WsChat | WsCancel | WsAuth:
    """`decode_ws`, off the event loop when the message is large (as `decode_async`)."""
    message: WsGenerate | WsChat | WsCancel | WsAuth = await decode_async(data, WsMessage)  # type: ignore[arg-type]
    return message


class _Peek(msgspec.Struct):
    id: str | None = None  # not Any: an id of any other type fails at once, unbuilt


def peek_id(data: str) -> str | None:
    """The id of a websocket message we could not decode, if it has a valid one (to tag the
    error; an overlong id is not echoed back). msgspec skips the other fields without building
    them, so this is cheap enough for the event loop at any message size."""
    try:
        rid = msgspec.json.decode(data, type=_Peek).id
    except (msgspec.DecodeError, RecursionError):  # ValidationError is a DecodeError
        return None
    return rid if isinstance(rid, str) and 1 <= len(rid) <= MAX_ID_CHARS else None
