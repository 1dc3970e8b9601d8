"""OpenAI-compatible endpoints: POST /v1/completions and POST /v1/chat/completions.

Both accept OpenAI's sampling fields (plus top_k, min_p, repetition_penalty, ignore_eos,
stop_token_ids), `n` choices, and `stream` as server-sent events in OpenAI's chunk format,
ending with `data: [DONE]`. Choice i of a seeded request uses seed + i (modulo 2**63, the seed's range), so
the choices differ.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import replace
from typing import Any, TypeVar

from aiohttp import web

from ppserve.engine.model.tokenizer import Tokenizer
from ppserve.engine.outputs import RequestOutput, TokenLogprob
from ppserve.scheduler.sampling_params import MAX_SEED, SamplingParams
from ppserve.server import tokens, tool_calls
from ppserve.server.errors import ApiError
from ppserve.server.limits import decode_request
from ppserve.server.protocol import DEFAULT_MAX_TOKENS, ChatRequest, CompletionRequest
from ppserve.server.state import STATE, TENANT, ServerState, client_of
from ppserve.server.streams import Collected, Stream, collect, merge, speculative_usage, sse_response

Body = TypeVar("Body", CompletionRequest, ChatRequest)


# Most logprobs one echo may return (prompt tokens x (logprobs + 1) x n): each is a few hundred
# bytes of JSON, and the host holds them all until the answer is written.
MAX_SCORED_ENTRIES = 1 << 20


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)


def _choices(
    request: web.Request, ids: list[int], params: SamplingParams, n: int, rid: str, first: int, salt: str | None
) -> list[Stream]:
    """n streams of one prompt; a seeded request gets seed + i for choice i, wrapped into the
    seed's range (so choice 0 keeps the seed as given, and the largest seed still works). Only
    choice 0 scores the prompt (prompt logprobs): the others share its scores, rather than each
    compute the whole prompt's logits again. `salt`: the engine's cache salt (ServerState.cache_salt)."""
    state = request.app[STATE]
    return [
        state.submit(
            ids,
            replace(
                params,
                seed=(params.seed + i) % (MAX_SEED + 1) if params.seed is not None else None,
                prompt_logprobs=params.prompt_logprobs if i == 0 else None,
            ),
            f"{rid}-{first + i}",
            pending=first + i,  # the choices before this one are checked but not queued yet
            cache_salt=salt,
            client=client_of(request),
        )
        for i in range(n)
    ]


def _header(state: ServerState, rid: str, kind: str) -> dict[str, Any]:
    """The fields every response and every stream chunk starts with."""
    return {"id": rid, "object": kind, "created": int(time.time()), "model": state.options.served_model_name}


def _usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    outs: Sequence[Collected | RequestOutput] = (),
    *,
    speculative: bool = False,
) -> dict[str, Any]:
    """OpenAI's usage object. A prompt with n choices counts once, so its cached tokens are
    those of its first choice (the others share the blocks that choice computes). Where steps
    carried drafts (`outs`: each choice's last output), OpenAI's prediction-token counts say how
    many were kept; with `speculative` (the request's `speculative_usage`), ppserve's own
    `speculative` object adds the mean acceptance length. It is asked for, not always given, so
    that a plain OpenAI client's usage keeps OpenAI's shape."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if (spec := speculative_usage(outs)) is not None:
        kept, rejected = spec["accepted_tokens"], spec["draft_tokens"] - spec["accepted_tokens"]
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": kept,
            "rejected_prediction_tokens": rejected,
        }
        if speculative:
            usage["speculative"] = spec
    return usage


# ---- /v1/completions ----------------------------------------------------------------------


async def _read(request: web.Request, kind: type[Body]) -> tuple[ServerState, Body, str | None]:
    """The request body, decoded and checked, with the server state and the engine's cache salt."""
    state = request.app[STATE]
    body = await decode_request(await request.read(), kind, state.options.limits)
    body.check()
    state.check_model(body.model)
    return state, body, state.cache_salt(request.get(TENANT), body.cache_salt)


async def completions(request: web.Request) -> web.StreamResponse:
    state, body, salt = await _read(request, CompletionRequest)
    if body.prompt_logprobs is not None and state.config.disaggregation:
        raise ApiError(
            400, "echo with logprobs (prompt logprobs) is not supported with prefill/decode disaggregation", "echo"
        )
    rid = f"cmpl-{uuid.uuid4().hex}"
    completion = _Completion(body, state.ready.tokenizer, _header(state, rid, "text_completion"))
    streams = await completion.submit(request, state, rid, salt)
    if not body.stream:
        return web.json_response(await completion.response(streams))
    return await sse_response(request, completion.events(streams))


class _Completion:
    """One /v1/completions request: its prompts' streams, and the answer made of them (whole, or
    as events). Each prompt has n choices; a choice's index is prompt * n + its number."""

    def __init__(self, body: CompletionRequest, tokenizer: Tokenizer, base: dict[str, Any]) -> None:
        self.body, self.tokenizer, self.base = body, tokenizer, base
        # max_tokens 0 (echo only) runs as 1, since a prompt's last step samples anyway, and the
        # token is dropped: the answer is the prompt, scored. Its n choices are the same answer, so
        # one stream per prompt makes all of them.
        self.scoring = body.max_tokens == 0
        self.copies = body.n if self.scoring else 1  # choices each stream answers
        self.echoes: list[str] = []  # per choice: the prompt text when echo is on
        self.prompt_ids: list[list[int]] = []  # per choice
        self.prompt_tokens = 0
        self.leader: list[int] = []  # per choice: the one that scored its prompt

    async def submit(self, request: web.Request, state: ServerState, rid: str, salt: str | None) -> list[Stream]:
        body, prompts = self.body, self.body.prompts()
        requested = 1 if self.scoring else body.max_tokens
        # Before tokenizing anything: a request the queue can never hold is refused outright.
        state.check_count(len(prompts) * body.n, "n" if body.n > 1 else "prompt")
        streams: list[Stream] = []
        for prompt in prompts:
            ids = await state.encode(prompt)
            if body.prompt_logprobs is not None and len(ids) * (body.prompt_logprobs + 1) * body.n > MAX_SCORED_ENTRIES:
                raise ApiError(
                    400,
                    f"echo with logprobs {body.prompt_logprobs} on a {len(ids)}-token prompt (n={body.n}) would "
                    f"return more than {MAX_SCORED_ENTRIES} logprobs; lower logprobs or n, or shorten the prompt",
                    "logprobs",
                )
            max_tokens = state.max_tokens(ids, requested, default=DEFAULT_MAX_TOKENS)
            params = body.sampling_params(max_tokens, body.logprobs, body.prompt_logprobs)
            await state.check_grammar(params, _constraint_field(body))
            streams += _choices(request, ids, params, body.n // self.copies, rid, len(streams), salt)
            text = ""  # echo only: decoding a long token-id prompt is not free
            if body.echo:
                text = prompt if isinstance(prompt, str) else await tokens.decode(self.tokenizer, ids)
            self.echoes += [text] * body.n
            self.prompt_ids += [ids] * body.n
            self.prompt_tokens += len(ids)
        self.leader = [i - i % body.n for i in range(len(self.echoes))]
        return streams

    async def echoed(self, i: int, prompt: list[TokenLogprob | None] | None) -> dict[str, Any] | None:
        """The prompt's part of choice i's logprobs (decoding a long prompt's tokens: off the loop)."""
        if prompt is None or self.body.logprobs is None:
            return None
        return await tokens.off_loop(len(prompt) > 256, _echo_logprobs, self.tokenizer, self.prompt_ids[i], prompt)

    def logprobs(self, generated: list[TokenLogprob], offset: int, prompt: dict[str, Any] | None) -> Any:
        if self.body.logprobs is None:
            return None
        out = _completion_logprobs(self.tokenizer, [] if self.scoring else generated, offset)
        return out if prompt is None else {k: prompt[k] + v for k, v in out.items()}

    async def response(self, streams: list[Stream]) -> dict[str, Any]:
        n, scoring, echoes = self.body.n, self.scoring, self.echoes
        results = [r for r in await collect(streams) for _ in range(self.copies)]  # per choice
        prompt_parts = [await self.echoed(i, results[self.leader[i]].prompt_logprobs) for i in range(len(results))]
        choices = [
            {
                "index": i,
                "text": echoes[i] + ("" if scoring else r.text),
                "logprobs": self.logprobs(r.logprobs, len(echoes[i]), prompt_parts[i]),
                "finish_reason": "length" if scoring else r.finish_reason,
            }
            for i, r in enumerate(results)
        ]
        cached = sum(r.cached_tokens for r in results[::n])
        completion_tokens = 0 if scoring else sum(r.completion_tokens for r in results)
        usage = _usage(
            self.prompt_tokens,
            completion_tokens,
            cached,
            results[:: self.copies],
            speculative=self.body.speculative_usage,
        )
        return {**self.base, "choices": choices, "usage": usage}

    async def events(self, streams: list[Stream]) -> AsyncGenerator[dict[str, Any], None]:
        body, scoring, echoes, leader, copies = self.body, self.scoring, self.echoes, self.leader, self.copies
        offsets = [len(e) for e in echoes]  # text_offset of each choice's next token
        completion_tokens = 0
        cached = [0] * len(echoes)
        last: dict[int, RequestOutput] = {}  # each choice's latest output (speculative counts)
        extra = {"usage": None} if body.include_usage else {}
        # Echoed prompt logprobs come with a prompt's first choice (its leader): the other choices'
        # first outputs wait for them, then go out with the same scores.
        scores: dict[int, list[TokenLogprob | None] | None] = {}
        held: dict[int, list[tuple[int, RequestOutput]]] = {}
        sharing = body.echo and body.prompt_logprobs is not None and not scoring

        async def chunk(i: int, out: RequestOutput, first: bool) -> dict[str, Any]:
            nonlocal completion_tokens
            new_text = "" if scoring else out.text
            text, echoes[i] = echoes[i] + new_text, ""
            prompt = await self.echoed(i, scores.get(leader[i]) if first else None)
            choice_logprobs = self.logprobs(out.logprobs or [], offsets[i], prompt)
            offsets[i] += len(new_text)
            completion_tokens += 0 if scoring else len(out.token_ids)
            cached[i] = out.cached_tokens
            last[i] = out
            finish = "length" if scoring and out.finished else out.finish_reason
            choice = {"index": i, "text": text, "logprobs": choice_logprobs, "finish_reason": finish}
            return {**self.base, "choices": [choice], **extra}

        started: set[int] = set()
        async with aclosing(merge(streams)) as outputs:
            async for s, out in outputs:
                for i in range(s * copies, (s + 1) * copies):
                    first = i not in started
                    started.add(i)
                    if i == leader[i] and first:
                        scores[i] = out.prompt_logprobs
                    elif sharing and first and leader[i] not in scores:
                        held.setdefault(leader[i], []).append((i, out))
                        continue
                    yield await chunk(i, out, first)
                    if i == leader[i] and first:
                        for j, waiting in held.pop(i, []):
                            yield await chunk(j, waiting, True)
        if body.include_usage:
            outs = [last[i] for i in range(0, len(echoes), copies) if i in last]
            usage = _usage(
                self.prompt_tokens, completion_tokens, sum(cached[:: body.n]), outs, speculative=body.speculative_usage
            )
            yield {**self.base, "choices": [], "usage": usage}


def _completion_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, top alternatives as {token: logprob}."""
    ids = {lp.token_id for lp in logprobs} | {t for lp in logprobs for t, _ in lp.top_logprobs}
    text = {t: tokenizer.decode([t], skip_special_tokens=False) for t in ids}  # each token decoded once
    tokens, offsets = [], []
    for lp in logprobs:
        tokens.append(text[lp.token_id])
        offsets.append(offset)
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{text[t]: v for t, v in lp.top_logprobs} for lp in logprobs],
        "text_offset": offsets,
    }


def _echo_logprobs(tokenizer: Tokenizer, ids: list[int], prompt: list[TokenLogprob | None]) -> dict[str, Any]:
    """The prompt's part of an echo with logprobs, as vLLM gives it: the first token has no
    logprob (null, and null top alternatives), and each top dict has the prompt's own token too."""
    scored = _completion_logprobs(
        tokenizer,
        [
            TokenLogprob(lp.token_id, lp.logprob, (*lp.top_logprobs, (lp.token_id, lp.logprob)))
            for lp in prompt[1:]
            if lp
        ],
        0,
    )
    first = tokenizer.decode(ids[:1], skip_special_tokens=False)
    return {
        "tokens": [first, *scored["tokens"]],
        "token_logprobs": [None, *scored["token_logprobs"]],
        "top_logprobs": [None, *scored["top_logprobs"]],
        "text_offset": [0, *(o + len(first) for o in scored["text_offset"])],
    }


# ---- /v1/chat/completions -----------------------------------------------------------------


async def start_chat(
    request: web.Request, body: ChatRequest, rid: str, salt: str | None
) -> tuple[list[int], list[Stream]]:
    """A checked chat request's prompt (the chat template's rendering, tools included) and its n
    streams: how /v1/chat/completions runs, and the Responses and Messages APIs through it."""
    state = request.app[STATE]
    tokenizer = state.ready.tokenizer
    state.check_count(body.n, "n")
    tools = body.tools if body.tool_mode else None  # tool_choice "none": the model is not told of them
    messages, template_tools = tool_calls.chat_prompt(body.chat_messages(), tools, tokenizer.hf.chat_template)
    ids = await tokens.encode_chat(
        tokenizer, messages, body.add_generation_prompt, state.config.max_model_len, template_tools
    )
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    field_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    params = body.sampling_params(state.max_tokens(ids, requested, field_name), body.num_logprobs)
    await state.check_grammar(params, _constraint_field(body))
    return ids, _choices(request, ids, params, body.n, rid, 0, salt)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state, body, salt = await _read(request, ChatRequest)
    tokenizer = state.ready.tokenizer
    mode = body.tool_mode
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    ids, streams = await start_chat(request, body, rid, salt)
    base = _header(state, rid, "chat.completion")

    def message(text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The reply's message and finish reason: tool calls where the reply is calls."""
        calls = tool_calls.parse_calls(text, body.tools) if body.tools and mode and finish == "stop" else None
        if calls is None:
            return {"role": "assistant", "content": text}, finish
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"

    if not body.stream:
        results = await collect(streams)
        choices = []
        for i, r in enumerate(results):
            msg, finish = message(r.text, r.finish_reason)
            logprobs = _chat_logprobs(tokenizer, r.logprobs) if body.logprobs else None
            choices.append({"index": i, "message": msg, "logprobs": logprobs, "finish_reason": finish})
        completion_tokens, cached = sum(r.completion_tokens for r in results), results[0].cached_tokens
        usage = _usage(len(ids), completion_tokens, cached, results, speculative=body.speculative_usage)
        return web.json_response({**base, "choices": choices, "usage": usage})

    base["object"] = "chat.completion.chunk"

    async def events() -> AsyncGenerator[dict[str, Any], None]:
        extra = {"usage": None} if body.include_usage else {}
        completion_tokens, cached = 0, 0
        last: dict[int, RequestOutput] = {}  # each choice's latest output (speculative counts)
        # With tools, a choice's text is held back while it may still turn out to be calls
        # (always, when decoding is constrained to calls): calls are sent whole, in one delta.
        held: list[str | None] = ["" if mode else None for _ in range(body.n)]
        for i in range(body.n):  # OpenAI opens each choice with the role
            yield {**base, "choices": [_chunk_choice(i, {"role": "assistant", "content": ""}, None, None)], **extra}
        async with aclosing(merge(streams)) as outputs:
            async for i, out in outputs:
                completion_tokens += len(out.token_ids)
                last[i] = out
                if i == 0:
                    cached = out.cached_tokens
                logprobs = _chat_logprobs(tokenizer, out.logprobs or []) if body.logprobs else None
                text, finish = out.text, out.finish_reason
                delta: dict[str, Any] = {"content": text} if text or not out.finished else {}
                if (so_far := held[i]) is not None:
                    so_far += text
                    if out.finished:
                        msg, finish = message(so_far, finish)
                        calls = msg.get("tool_calls")
                        delta = {"tool_calls": _call_deltas(calls)} if calls else {"content": so_far}
                        held[i] = None
                    elif mode == "auto" and not tool_calls.may_be_calls(so_far):
                        delta, held[i] = {"content": so_far}, None
                    else:
                        delta, held[i] = {}, so_far
                if not delta and not out.finished and logprobs is None:
                    continue
                choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                yield {**base, "choices": [choice], **extra}
        if body.include_usage:
            outs = list(last.values())
            usage = _usage(len(ids), completion_tokens, cached, outs, speculative=body.speculative_usage)
            yield {**base, "choices": [], "usage": usage}

    return await sse_response(request, events())


def _call_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls as stream deltas: OpenAI's clients join them by `index`."""
    return [{"index": k, **call} for k, call in enumerate(calls)]


def _constraint_field(body: CompletionRequest | ChatRequest) -> str:
    """The request field a grammar came from (errors name it)."""
    given = body.constraint()
    return given[0] if given else "structured_outputs"


def _chunk_choice(
    index: int, delta: dict[str, str], logprobs: dict[str, Any] | None, out: RequestOutput | None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": out.finish_reason if out else None}


def _chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top_logprobs]}
            for lp in logprobs
        ]
    }
