"""POST /v1/embeddings: OpenAI's embeddings, from the served causal LM.

Pooling: the last token's hidden state after the model's final norm (transformers'
`last_hidden_state[:, -1]`), L2-normalized. Last-token pooling is what decoder-only embedding
models use (a causal model's last position is the only one that has seen the whole input), and it
costs nothing beyond the prefill: the last stage takes that one row instead of sampling from it
(AsyncEngine.embed). Inputs run through the pipeline as prompts do, chunked and prefix-cached.

`input` takes OpenAI's four forms (a string, strings, token ids, lists of token ids);
`encoding_format` "float" or "base64" (little-endian float32, as OpenAI's client decodes it);
`dimensions` only as the model's hidden size, since a causal LM's vector cannot be shortened.
"""

from __future__ import annotations

import base64
import struct
import uuid
from typing import Any

import msgspec
from aiohttp import web

from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.server.errors import ApiError
from ppserve.server.limits import decode_request
from ppserve.server.protocol import EmbeddingRequest, prompt_list
from ppserve.server.state import STATE, TENANT, client_of
from ppserve.server.streams import collect

_PARAMS = SamplingParams(max_tokens=1)  # nothing is sampled; the scheduler needs params anyway


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await decode_request(await request.read(), EmbeddingRequest, state.options.limits)
    state.check_model(body.model)
    hidden = state.config.model_config.hidden_size
    if body.dimensions is not None and body.dimensions != hidden:
        raise ApiError(
            400, f"dimensions must be the model's {hidden} (its vectors cannot be shortened), got {body.dimensions}",
            "dimensions",
        )  # fmt: skip
    inputs = prompt_list(body.input, "input")
    vocab = state.config.model_config.vocab_size
    if bad := [max(ids) for ids in inputs if isinstance(ids, list) and max(ids) >= vocab]:
        raise ApiError(400, f"input token ids must be below the vocabulary's {vocab}; got {bad[0]}", "input")
    state.check_count(len(inputs), "input")
    salt = state.cache_salt(request.get(TENANT), body.cache_salt)
    rid = f"embd-{uuid.uuid4().hex}"
    streams = []
    for i, text in enumerate(inputs):
        ids = await state.encode(text, "input")
        client = client_of(request)
        streams.append(state.submit(ids, _PARAMS, f"{rid}-{i}", pending=i, cache_salt=salt, client=client, pool=True))
    results = await collect(streams)
    data: list[dict[str, Any]] = []
    for i, r in enumerate(results):
        if r.embedding is None:  # aborted (the server is stopping)
            raise ApiError(503, f"input {i} was not embedded: {r.finish_reason}")
        data.append({"object": "embedding", "index": i, "embedding": _encoded(r.embedding, body.encoding_format)})
    tokens = sum(r.prompt_tokens for r in results)
    answer = {
        "object": "list",
        "data": data,
        "model": state.options.served_model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }  # responses.EmbeddingList
    return web.Response(body=msgspec.json.encode(answer), content_type="application/json")


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
