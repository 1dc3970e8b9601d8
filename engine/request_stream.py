"""One request's way out of the engine: its sampled tokens detokenized, its text cut at stop
strings, and each piece put in the queue that `AsyncEngine.generate` reads as a RequestOutput."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from ppserve.engine.model.tokenizer import IncrementalDetokenizer
from ppserve.engine.outputs import RequestOutput, TokenLogprob, prompt_logprobs
from ppserve.scheduler.request import Request
from ppserve.transport.messages import Sampled

log = logging.getLogger("ppserve.engine")


@dataclass
class RequestStream:
    request: Request
    detok: IncrementalDetokenizer
    queue: asyncio.Queue[RequestOutput | Exception] = field(default_factory=asyncio.Queue)
    text: str = ""  # all text so far (stop strings are matched here)
    emitted: int = 0  # characters of `text` already yielded
    sent_tokens: int = 0
    pending: list[Sampled] = field(default_factory=list)  # tokens not yet yielded
    first: bool = True  # no output yielded yet (the first carries the prompt logprobs)
    stopped: bool = False  # a stop string was found: tokens after it (from the same step) are dropped

    def push(self, sample: Sampled, stop: Callable[[], object], last: bool = True) -> None:
        """A sampled token (or the last stage's error): the text it adds goes out, but for a tail
        that may still grow into a stop string. `stop` ends the request when one is found. `last`:
        no more tokens of this request come with this step (one with drafts makes several)."""
        r, params = self.request, self.request.params
        if self.stopped:
            return
        if sample.error:  # no token came: the request ended with this error
            log.warning("request %s failed: %s", r.request_id, sample.error)
            self.text += self.detok.flush()
            self._send(len(self.text))
            return
        self.text += self.detok.push([sample.token_id])
        if r.finished and last:
            self.text += self.detok.flush()
        self.pending.append(sample)
        end = len(self.text)
        if params.stop:
            # Stop strings: cut the text at the first match; until the request ends, hold back
            # a tail that could still grow into one.
            longest = max(len(s) for s in params.stop)
            search_from = max(0, self.emitted - longest + 1)
            hits = [i for s in params.stop if (i := self.text.find(s, search_from)) >= 0]
            if hits:
                end, self.stopped = min(hits), True
                stop()
            elif not (r.finished and last):
                end = max(self.emitted, end - longest + 1)
        if end == self.emitted and not self.stopped and not (r.finished and last) and params.stop:
            return  # all held back; the tokens go out with the next output
        self._send(end, r.finished and (last or self.stopped))

    def end(self) -> None:
        """The request ended without a token (aborted, or an embedding): its last output."""
        self.queue.put_nowait(self.output("", []))

    def _send(self, end: int, final: bool = True) -> None:
        text, self.emitted = self.text[self.emitted : end], end
        samples, self.pending = self.pending, []
        self.queue.put_nowait(self.output(text, samples, final))

    def output(self, text: str, samples: list[Sampled], final: bool = True) -> RequestOutput:
        """What goes out; `final`: the request's last output (else more of its tokens follow,
        even if it has finished: a step with drafts brings several)."""
        r = self.request
        logprobs = None
        if r.params.logprobs is not None:
            logprobs = [
                TokenLogprob(s.token_id, s.logprob or 0.0, tuple((t, lp) for t, lp in s.top_logprobs)) for s in samples
            ]
        self.sent_tokens += len(samples)
        prompt = None
        if r.params.prompt_logprobs is not None and self.first:
            prompt = prompt_logprobs(r.prompt_token_ids, r.prompt_scores)
        self.first = False
        return RequestOutput(
            request_id=r.request_id,
            text=text,
            token_ids=[s.token_id for s in samples],
            finished=r.finished and final,
            finish_reason=r.finish_reason.value if r.finish_reason and final else None,
            prompt_tokens=len(r.prompt_token_ids),
            completion_tokens=self.sent_tokens,
            cached_tokens=r.num_cached_tokens or 0,
            logprobs=logprobs,
            prompt_logprobs=prompt,
            error=r.error,
            embedding=r.embedding,
            draft_tokens=r.num_draft_tokens,
            accepted_tokens=r.num_accepted_tokens,
            spec_steps=r.num_spec_steps,
        )
