"""Sampling on the last stage: logit bias, grammars, penalties, temperature, top-k / top-p /
min-p, seeds, logprobs.

Order, per row: the logit bias, then the grammar's mask (tokens it forbids get -inf), then
(vLLM's order) the repetition penalty (over the prompt's and the generated tokens), then
presence/frequency penalties (over the generated tokens only), then greedy
argmax or temperature -> top-k -> top-p (on the top-k-renormalised distribution) -> min-p -> draw.
Logprobs are of the raw model distribution (before bias, mask, penalties and temperature).

A request with a grammar has a matcher here (engine/model/grammar.py) that consumes each token it
samples. Its next mask is computed on a thread of its own as soon as the plan arrives
(`prepare`), while earlier stages, or this stage's own layers, compute the micro-batch; sampling
only waits for it. A re-announced request's matcher consumes the tokens generated before, so a
replaced last stage constrains exactly as the old one would have.

A sampled token is drawn by inverse transform: one uniform number per row and step, the first
token whose cumulative probability exceeds it, found block by block (`inverse_transform`; no
noise over the whole vocabulary, where an exponential drawn for every token of every row was a
cost of its own). A seeded request draws its number from a generator seeded with (seed, step), so
its output depends on its seed, its step and its logits only: never on what else is in the batch,
and never on the sampler's history (a replaced last stage carries on exactly).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import torch

from ppserve.engine.model import cpu_kernels
from ppserve.engine.model.grammar import UNKNOWN_COST, first_line
from ppserve.engine.model.grammar_thread import start_grammar_thread, wait_for
from ppserve.engine.model.sampling_ops import SamplerParams, candidates, inverse_transform, unpack_mask
from ppserve.scheduler.sampling_params import GREEDY_BELOW
from ppserve.transport.messages import SeqChunk, StepPlan

if TYPE_CHECKING:
    import llguidance

    from ppserve.engine.model.grammar import Grammars

log = logging.getLogger(__name__)

MAX_FORCED = 32  # forced tokens a sample carries at most (the host drafts fewer)


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: float | None = None  # of the chosen token, when logprobs were asked for
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first
    error: str = ""  # non-empty: the request's grammar stopped, and `token_id` means nothing
    forced: tuple[int, ...] = ()  # what the request's grammar forces next (`verify`, with jump_forward)


class _RequestState:
    def __init__(
        self,
        params: SamplerParams,
        vocab_size: int,
        device: torch.device,
        output_token_ids: Sequence[int] = (),
        prompt_token_ids: Sequence[int] = (),
        matcher: llguidance.LLMatcher | None = None,
    ) -> None:
        self.params = params
        self.step = len(output_token_ids)  # tokens sampled so far
        self.last_token = output_token_ids[-1] if output_token_ids else -1  # what `follow` puts in
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (token ids [n] long, biases [n] float32)
        if params.logit_bias:
            kept = [(t, b) for t, b in params.logit_bias if t < vocab_size]  # the host checked; never index out
            self.bias = (
                torch.tensor([t for t, _ in kept], dtype=torch.long, device=device),
                torch.tensor([b for _, b in kept], dtype=torch.float32, device=device),
            )
        self.matcher = matcher  # at the grammar's start: consumes the tokens generated before
        # Why the grammar stopped (its engine hit a limit, or a dead end): the request ends with
        # this error at its next sample, rather than with text that breaks the constraint.
        self.error = ""
        if matcher is not None and output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
            self.error = f"the output no longer fits its grammar: {first_line(matcher.get_error())}"
        self.counts = None  # counts: [vocab] float32, of generated tokens
        if params.presence_penalty or params.frequency_penalty:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            if output_token_ids:
                ids = torch.tensor(list(output_token_ids), dtype=torch.long, device=device)
                self.counts.index_add_(0, ids, torch.ones(len(ids), dtype=torch.float32, device=device))
        self.seen = None  # seen: [vocab] bool, the prompt's and the generated tokens
        if params.repetition_penalty != 1:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            seen = [*prompt_token_ids, *output_token_ids]
            if seen:
                self.seen[torch.tensor(seen, dtype=torch.long, device=device)] = True
        self.generator: torch.Generator | None = None
        if params.seed is not None and params.temperature >= GREEDY_BELOW:
            self.generator = torch.Generator(device=device)

    def noise_generator(self, shared: torch.Generator) -> torch.Generator:
        """The generator for this step's draw: reseeded from (seed, step) for a seeded request."""
        if self.generator is None:
            return shared
        assert self.params.seed is not None
        self.generator.manual_seed(_step_seed(self.params.seed, self.step))
        return self.generator


def _uniform(generator: torch.Generator) -> float:
    """One draw from [0, 1), in float64."""
    return float(torch.rand((), dtype=torch.float64, generator=generator, device=generator.device))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token, as torch.argmax: by the CPU kernel where it runs, whose vectorized
    passes beat torch's reduction, which tracks an index with every compare
    (docs/benchmarks.md#against-vllm-and-llamacpp)."""
    if logits.dtype == torch.float32 and logits.stride(-1) == 1 and cpu_kernels.available(logits.device, logits.dtype):
        return cpu_kernels.argmax(logits)
    return logits.argmax(dim=-1)


def _step_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit seed for (seed, step) (splitmix64's finaliser), so that neighbouring
    seeds and steps give unrelated noise."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


# A mask `prepare` started: (the request's state then, or for a first mask its grammar; the
# state's step then; the future; the mask's row in the future's result, -1 for a first mask).
_Prepared = tuple["_RequestState | str", int, Future[torch.Tensor], int]


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        grammars: Callable[[], Grammars] | None = None,
        jump_forward: bool = False,
    ) -> None:
        """`grammars`: makes the model's Grammars (loading its tokenizer) when the first request
        with a grammar comes; None: such requests are refused. `jump_forward`: `verify` says what
        each grammar forces next, for the host to draft."""
        self.vocab_size = vocab_size
        self.jump_forward = jump_forward
        self.device = device
        self._requests: dict[str, _RequestState] = {}
        self._shared_generator = torch.Generator(device=device)  # for requests without a seed
        self._shared_generator.seed()
        self._make_grammars = grammars
        # Scratch tensors kept between steps: [rows, vocab] temporaries allocated afresh each step
        # cost more in page faults than the arithmetic on them.
        self._scratch: dict[str, torch.Tensor] = {}
        self._grammars: Grammars | None = None
        self._making = threading.Lock()
        self._starting = threading.Lock()
        self._thread: ThreadPoolExecutor | None = None  # grammar work: compiling, masks
        # Masks started by `prepare`: request id -> (its state and step then, the future's row).
        self._prepared: dict[str, _Prepared] = {}

    @property
    def grammars(self) -> Grammars:
        """The model's Grammars, made at first use (loading the tokenizer: about a second)."""
        with self._making:  # the grammar thread and the compute thread may both ask first
            if self._grammars is None:
                if self._make_grammars is None:
                    raise ValueError("this engine has no tokenizer for grammars")
                self._grammars = self._make_grammars()
        return self._grammars

    def _grammar_thread(self) -> ThreadPoolExecutor:
        with self._starting:  # `prepare` (the stage's loop) and `add_request` (its compute thread)
            if self._thread is None:
                self._thread = start_grammar_thread()
        return self._thread

    def _first_mask(self, grammar: str, cost: int) -> torch.Tensor:
        return self.grammars.first_mask(grammar, cost)

    def _masks(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        return self.grammars.masks(matchers)

    def prepare(self, plan: StepPlan) -> None:
        """Start the grammar masks of `plan`'s sampled rows on the grammar thread, so that they are
        ready when its logits are (call it as the plan arrives, before its forward). It never
        waits: everything, even making the Grammars, happens on that thread. Rows whose mask is
        not started here are masked when sampled."""
        starts = {n.request_id: (n.params.grammar, n.grammar_cost) for n in plan.new_requests if n.params.grammar}
        if not starts and self._thread is None:
            return  # no request has had a grammar yet: nothing to look up
        thread = self._grammar_thread()
        rows: list[tuple[str, _RequestState]] = []
        for rid in (c.request_id for c in plan.chunks if c.sample):
            if rid in starts:  # announced in this plan: its first mask is its grammar's, cached
                grammar, cost = starts[rid]
                self._prepared[rid] = (grammar, 0, thread.submit(self._first_mask, grammar, cost), -1)
            elif (state := self._requests.get(rid)) is not None and state.matcher is not None:
                rows.append((rid, state))
        for grammar, cost in set(starts.values()):  # compile early, whether or not this plan samples it
            thread.submit(self._first_mask, grammar, cost)
        if rows:
            future = thread.submit(self._masks, [state.matcher for _, state in rows])  # type: ignore[misc]
            for i, (rid, state) in enumerate(rows):
                self._prepared[rid] = (state, state.step, future, i)

    def follow(self, plan: StepPlan) -> StepPlan:
        """`plan` with each `follows` chunk's placeholder replaced by the token its request sampled
        last, in an earlier plan (decoding ahead at PP=1, where this stage also embeds: see
        scheduler/scheduler.py). Call it once the plans before have sampled, before the forward."""
        if not any(c.follows for c in plan.chunks):
            return plan
        chunks = [
            msgspec.structs.replace(c, token_ids=[self._requests[c.request_id].last_token]) if c.follows else c
            for c in plan.chunks
        ]
        return msgspec.structs.replace(plan, chunks=chunks)

    def add_request(
        self,
        request_id: str,
        params: SamplerParams,
        output_token_ids: Sequence[int] = (),
        prompt_token_ids: Sequence[int] = (),
        grammar_cost: int = 0,
    ) -> None:
        """`output_token_ids`: tokens the request generated before (when it is re-announced);
        `prompt_token_ids`: its prompt, needed only with a repetition penalty; `grammar_cost`:
        the bytes its compiled grammar takes (0: not known)."""
        matcher, error = None, ""
        if params.grammar:
            try:
                matcher = self.grammars.matcher(params.grammar, grammar_cost or UNKNOWN_COST)
            except ValueError as e:  # the host checked it; a limit met only here ends the request
                error = f"the grammar could not be compiled: {e}"
            self._grammar_thread()  # from now on, `prepare` starts this request's masks
        state = _RequestState(params, self.vocab_size, self.device, output_token_ids, prompt_token_ids, matcher)
        state.error = state.error or error
        self._requests[request_id] = state

    def clear(self) -> None:
        """Forget every request (the pipeline was reset; they are announced again)."""
        self._requests.clear()
        self._prepared.clear()

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._prepared.pop(request_id, None)

    def prompt_logprobs(self, request_id: str) -> int:
        """How many top logprobs each of the request's prompt tokens gets (0: its own only)."""
        return self._requests[request_id].params.prompt_logprobs or 0

    @torch.inference_mode()  # the logits are the forward's inference tensors, changed in place here
    def sample(self, request_ids: Sequence[str], logits: torch.Tensor) -> list[Sample]:
        """logits: [len(request_ids), vocab] float32, the step's own: a row with a logit bias or a
        grammar is changed in place (copying every row would cost more than masking it)."""
        states = [self._requests[r] for r in request_ids]
        want_logprobs = [s.params.logprobs is not None for s in states]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        logits = self._constrain(request_ids, states, logits)
        logits = apply_penalties(logits, states)
        greedy = [i for i, s in enumerate(states) if s.params.temperature < GREEDY_BELOW]
        if len(greedy) == len(states):  # the common all-greedy batch: no row gather
            token_ids = _argmax(logits)
        else:
            token_ids = torch.empty(len(states), dtype=torch.long, device=logits.device)
            if greedy:
                token_ids[greedy] = _argmax(logits[greedy])
        drawn = [i for i, s in enumerate(states) if s.params.temperature >= GREEDY_BELOW]
        if drawn:
            token_ids[drawn] = torch.tensor(self._draw(logits, drawn, [states[i] for i in drawn]), device=logits.device)

        chosen = token_ids.tolist()
        out: list[Sample] = []
        for i, (state, token) in enumerate(zip(states, chosen, strict=True)):
            state.step += 1
            state.last_token = token
            if state.error:
                out.append(Sample(token, error=state.error))
                continue
            if state.matcher is not None and not state.matcher.consume_token(token):
                state.error = f"the output no longer fits its grammar: {first_line(state.matcher.get_error())}"
            if state.counts is not None:
                state.counts[token] += 1
            if state.seen is not None:
                state.seen[token] = True
            if raw_logprobs is None or state.params.logprobs is None:
                out.append(Sample(token))
                continue
            row = raw_logprobs[i]
            top: tuple[tuple[int, float], ...] = ()
            if state.params.logprobs > 0:
                values, ids = row.topk(state.params.logprobs)
                top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
            out.append(Sample(token, float(row[token]), top))
        return out

    def verify(self, chunks: Sequence[SeqChunk], logits: torch.Tensor) -> list[list[Sample]]:
        """The samples of a plan's sampling chunks, each chunk's in order. logits: [rows, vocab]
        float32, 1 + `drafts` rows per chunk, in chunk order (StageRunner.execute's).

        Row j of a chunk is sampled exactly as a one-token step would sample it (its own logits,
        bitwise those of decoding one token at a time; the request's state after the tokens
        before it: penalties, grammar, seeded noise at its step), and the chunk goes on to row
        j + 1 only while the token sampled equals draft j + 1. Greedy, that is the longest
        matching prefix plus the next argmax. Sampling, it is the rejection rule for a
        deterministic draft: the draft is kept with probability p(draft), and on rejection the
        token is drawn from p without the draft, renormalised: so every token has the model's
        distribution, and a seeded request even the same tokens as without drafts."""
        first = list(itertools.accumulate((1 + c.drafts for c in chunks), initial=0))
        out: list[list[Sample]] = [[] for _ in chunks]
        live, j = list(range(len(chunks))), 0
        while live:
            rows = [first[i] + j for i in live]
            batch = logits if rows == list(range(logits.shape[0])) else logits[rows]
            nxt = []
            for i, sample in zip(live, self.sample([chunks[i].request_id for i in live], batch), strict=True):
                out[i].append(sample)
                c = chunks[i]
                if not sample.error and j < c.drafts and sample.token_id == c.token_ids[j + 1]:
                    nxt.append(i)
            live, j = nxt, j + 1
        if self.jump_forward:
            for c, samples in zip(chunks, out, strict=True):
                state = self._requests[c.request_id]
                if state.matcher is not None and not state.error and not samples[-1].error:
                    forced = tuple(state.matcher.compute_ff_tokens()[:MAX_FORCED])
                    if forced:
                        samples[-1] = dataclasses.replace(samples[-1], forced=forced)
        return out

    def _buffer(self, name: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """Scratch tensor `name` of `shape`, kept (and grown) between steps."""
        size = shape[0] * shape[1]
        buffer = self._scratch.get(name)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype:
            buffer = self._scratch[name] = torch.empty(size, dtype=dtype, device=self.device)
        return buffer[:size].view(shape)

    def _draw(self, logits: torch.Tensor, rows: list[int], states: list[_RequestState]) -> list[int]:
        """A token for each of `rows` (sampled, not greedy), by inverse transform: one uniform u per
        row, the first token whose cumulative probability exceeds u. Rows with neither top-k nor
        top-p are drawn together; the others look only at their candidates (`candidates`)."""
        temperatures = torch.tensor([s.params.temperature for s in states], dtype=logits.dtype, device=logits.device)
        scaled = logits if len(rows) == logits.shape[0] else logits[rows]  # (no gather when every row draws)
        probs = self._buffer("probs", tuple(scaled.shape), scaled.dtype)  # type: ignore[arg-type]
        torch.div(scaled, temperatures[:, None], out=probs)
        torch.softmax(probs, -1, out=probs)  # [rows, vocab]
        # A seeded request's u comes from (seed, step), the others' from the shared generator.
        u = [_uniform(s.noise_generator(self._shared_generator)) for s in states]
        out = [0] * len(rows)
        plain = [j for j, s in enumerate(states) if not s.params.top_k and s.params.top_p >= 1.0]
        if plain:
            p = probs if len(plain) == len(rows) else probs[plain]
            min_p = torch.tensor([states[j].params.min_p for j in plain], dtype=p.dtype, device=p.device)[:, None]
            if bool((min_p > 0).any()):
                p = p.masked_fill(p < min_p * p.max(dim=-1, keepdim=True).values, 0.0)
            for j, token in zip(plain, inverse_transform(p, [u[j] for j in plain]), strict=True):
                out[j] = token
        picked = set(plain)
        for j, state in enumerate(states):
            if j not in picked:
                values, order = candidates(probs[j], state.params)
                out[j] = int(order[inverse_transform(values[None], [u[j]])[0]])
        return out

    def _constrain(
        self, request_ids: Sequence[str], states: Sequence[_RequestState], logits: torch.Tensor
    ) -> torch.Tensor:
        """logits, in place, with each row's bias added and what its grammar forbids set to -inf."""
        biased = [i for i, s in enumerate(states) if s.bias is not None]
        constrained = [i for i, s in enumerate(states) if s.matcher is not None]
        for i in biased:
            ids, values = states[i].bias  # type: ignore[misc]
            logits[i].index_add_(0, ids, values)
        if constrained:
            masks = self._step_masks(request_ids, states, constrained)  # [rows, words]
            # A grammar in an error state allows nothing (its engine hit a limit, or a dead end):
            # the request ends with that error. Its row samples EOS, a token that is then dropped.
            empty = (masks == 0).all(dim=1)
            for j, i in enumerate(constrained):
                matcher = states[i].matcher
                assert matcher is not None
                if matcher.is_error() or bool(empty[j]):
                    reason = first_line(matcher.get_error()) or "no token may come next"
                    states[i].error = states[i].error or f"the grammar stopped: {reason}"
            if empty.any():
                eos = self.grammars.eos_token_id
                masks[empty, eos // 32] = 1 << (eos % 32) if eos % 32 < 31 else -(1 << 31)
            rows = torch.tensor(constrained, dtype=torch.long)
            if cpu_kernels.available(logits.device, torch.float32):
                cpu_kernels.apply_token_bitmask(logits, masks, rows)
            else:
                allowed = unpack_mask(masks, self.vocab_size).to(logits.device)  # [rows, vocab] bool
                rows = rows.to(logits.device)
                logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        return logits

    def _step_masks(self, request_ids: Sequence[str], states: Sequence[_RequestState], rows: list[int]) -> torch.Tensor:
        """The next-token bitmasks [len(rows), words] int32 of these rows. In the common decode step
        `prepare` started every one of them in one batch, in this order: that batch is the answer
        as it is (gathering 32 rows one by one costs a few hundred microseconds a step)."""
        prepared = [self._prepared.pop(request_ids[i], None) for i in rows]
        batch = prepared[0][2] if prepared[0] is not None else None
        if batch is not None and all(
            p is not None and p[2] is batch and p[3] == j and p[0] is states[i] and p[1] == states[i].step
            for j, (i, p) in enumerate(zip(rows, prepared, strict=True))
        ):
            if not wait_for(batch):
                return self.grammars.masks([states[i].matcher for i in rows])  # type: ignore[misc]
            masks = batch.result()
            if masks.shape[0] == len(rows):
                return masks
        return torch.stack([self._mask(p, states[i]) for i, p in zip(rows, prepared, strict=True)])

    def _mask(self, prepared: _Prepared | None, state: _RequestState) -> torch.Tensor:
        """A request's next-token bitmask [words] int32: the one `prepare` started if it still
        belongs to this state at this step, else computed now."""
        if prepared is not None:
            owner, step, future, row = prepared
            if row < 0:
                if state.step == 0 and owner == state.params.grammar:  # the grammar's first mask:
                    # cached since `add_request` compiled the grammar, whether or not `future` ran
                    return future.result() if future.done() else self.grammars.first_mask(owner)
            elif owner is state and step == state.step and wait_for(future):
                return future.result()[row]
        assert state.matcher is not None
        return self.grammars.masks([state.matcher])[0]


def apply_penalties(logits: torch.Tensor, states: Sequence[_RequestState]) -> torch.Tensor:
    """Per row: a seen token's logit divided by the repetition penalty if positive, multiplied
    if not; then logit -= frequency * count + presence * (count > 0), counts of generated tokens."""
    rows = [i for i, s in enumerate(states) if s.counts is not None or s.seen is not None]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        state = states[i]
        p = state.params
        if state.seen is not None:
            row = logits[i]
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            logits[i] = torch.where(state.seen, penalized, row)
        if state.counts is not None:
            logits[i] -= p.frequency_penalty * state.counts + p.presence_penalty * (state.counts > 0).float()
    return logits
