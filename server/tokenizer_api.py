"""The tokenizer over HTTP, with vLLM's paths and field names (lm-evaluation-harness's
`tokenizer_backend=remote` calls them): GET /tokenizer_info, POST /tokenize, POST /detokenize.

/tokenize takes a `prompt` (text) or chat `messages` (rendered by the model's chat template, as
/v1/chat/completions renders them) and answers `{tokens, count, max_model_len}`; /detokenize takes
`tokens` and answers `{prompt}`. Both are bounded as every input is: the body's size, the text's
length against the context (server/tokens.py), token ids in the vocabulary.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from ppserve.server import tokens
from ppserve.server.errors import ApiError
from ppserve.server.limits import decode_request
from ppserve.server.protocol import DetokenizeRequest, TokenizeRequest, chat_dicts
from ppserve.server.responses import Detokenized, Tokenized, TokenizerInfo
from ppserve.server.state import STATE


def add_routes(app: web.Application) -> None:
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)


async def tokenizer_info(request: web.Request) -> web.Response:
    """What a remote tokenizer needs to stand in for the model's: its special tokens, the chat
    template and the context length."""
    state = request.app[STATE]
    tokenizer = state.ready.tokenizer
    hf, limit = tokenizer.hf, state.config.max_model_len
    info = TokenizerInfo(
        tokenizer_class=type(hf).__name__,
        bos_token=hf.bos_token,
        eos_token=hf.eos_token,
        pad_token=hf.pad_token,
        unk_token=hf.unk_token,
        bos_token_id=hf.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        chat_template=hf.chat_template if isinstance(hf.chat_template, str) else None,
        model_max_length=limit,
        max_model_len=limit,
        vocab_size=state.config.model_config.vocab_size,
    )
    return _json(info)


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await decode_request(await request.read(), TokenizeRequest, state.options.limits)
    body.check()
    state.check_model(body.model)
    tokenizer, limit = state.ready.tokenizer, state.config.max_model_len
    if body.messages is not None:
        ids = await tokens.encode_chat(tokenizer, chat_dicts(body.messages), body.add_generation_prompt, limit)
    else:
        assert body.prompt is not None
        ids = await tokens.encode(tokenizer, body.prompt, limit, "prompt", body.add_special_tokens)
    return _json(Tokenized(ids, len(ids), limit))


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await decode_request(await request.read(), DetokenizeRequest, state.options.limits)
    state.check_model(body.model)
    vocab = state.config.model_config.vocab_size
    if bad := [t for t in body.tokens if t >= vocab]:
        raise ApiError(400, f"tokens must be ids below the vocabulary's {vocab}; got {bad[:5]}", "tokens")
    # Special tokens kept, as vLLM's answer keeps them: detokenize(tokenize(text)) is the text.
    tokenizer = state.ready.tokenizer
    text = await tokens.off_loop(len(body.tokens) > tokens.INLINE_TOKENS, tokenizer.decode, body.tokens, False)
    return _json(Detokenized(text))


def _json(answer: msgspec.Struct) -> web.Response:
    return web.Response(body=msgspec.json.encode(answer), content_type="application/json")
