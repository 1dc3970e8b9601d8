"""Prompt text to token ids (and back) without stalling the event loop.

Tokenizing is linear in the text, and a 16 MiB body holds a lot of text: done on the event loop,
one such request freezes every stream of the server for seconds. So a text that cannot fit the
context is refused from its length alone, before any tokenizing, and what is left is tokenized
on the loop when it is small (a thread hop would cost more than the work) and in a worker
thread when it is large (the tokenizer releases the GIL there): `Tokenizer.encode_async`. The
decoding of long token lists gets the same treatment here; the chat template, the model's own
code, always renders in its worker process under a budget. Every refusal becomes a 400 naming
the request field at fault.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ppserve.engine.model.chat_template import TemplateBudgetError
from ppserve.engine.model.tokenizer import Tokenizer
from ppserve.server.errors import ApiError

T = TypeVar("T")
INLINE_TOKENS = 4096  # token lists up to this long decode as fast as INLINE_CHARS characters encode


async def off_loop(large: bool, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, in a worker thread if the input is `large`, else right here."""
    if not large:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))


async def encode(
    tokenizer: Tokenizer, text: str, max_model_len: int, field: str, add_special_tokens: bool = True
) -> list[int]:
    try:
        return await tokenizer.encode_async(text, max_model_len, add_special_tokens, what=field)
    except ValueError as e:  # it cannot fit the context
        raise ApiError(400, str(e), field) from None


async def encode_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    max_model_len: int,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The chat template's token ids for `messages` (and `tools`, for a template that renders
    them). The template may drop or rewrite parts of the messages, so the length check applies
    to the rendered text, not to the messages. The template renders in its worker process
    (never on the loop, whatever its size: it is the model's code and may run long), within a
    budget: a template past it is the model's fault, a 500 that says so."""
    try:
        text = await tokenizer.render_chat_async(messages, add_generation_prompt, tools)
    except ValueError as e:  # no chat template
        raise ApiError(400, str(e), "messages") from None
    except TemplateBudgetError as e:
        raise ApiError(500, f"the model's chat template failed: {e}") from None
    except Exception as e:  # a template can fail in many ways (jinja errors on unexpected roles...)
        raise ApiError(400, f"the chat template failed on these messages: {e}", "messages") from None
    # The template writes its own special tokens (BOS included), so don't add them twice.
    return await encode(tokenizer, text, max_model_len, "messages", add_special_tokens=False)


async def decode(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    return await off_loop(len(token_ids) > INLINE_TOKENS, tokenizer.decode, token_ids)
