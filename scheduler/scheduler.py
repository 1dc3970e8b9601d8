"""The central scheduler: pure and synchronous. `schedule() -> StepPlan | None`, `update(result)`.

Progress of a request is `num_computed_tokens` catching up with `num_tokens`; there is no
prefill or decode mode. A plan takes, for each chosen request, the next tokens it has not yet
scheduled (at most `chunked_prefill_size`), and samples when those reach the end of the sequence.

Pipelining rules:
- At most `depth = pp_size + async_depth` plans are in flight, plus one when decoding runs ahead
  (used only while some request can go on with a plan of its own in flight: `_spare_useful`).
- A request whose sampling chunk is in flight waits for that token (its next step depends on
  it), but for decoding ahead (below): one sampling plan in flight, two at PP=1. Prefill chunks
  do not sample, so consecutive chunks of one prompt go into consecutive plans and fill every stage at once.
- Decoding ahead (`decode_ahead`, PP=1 only): there the one stage both samples a token and embeds
  the next, so a request's next decode step is planned while the token it reads is still being
  sampled (a `follows` chunk: the stage puts its own token in). The stage starts that step as
  soon as the previous one ends, and the host's turnaround (result, update, plan) overlaps the
  compute instead of stalling it (docs/benchmarks.md#where-a-decode-step-goes). A step
  planned ahead past a request's end (EOS, a stop string) is computed and its token dropped, so
  it takes only empty blocks: it never preempts or evicts for a token that may be dropped. Not
  for requests with a grammar (the stage starts their masks before the plan's token is known)
  or whose KV is held for a transfer; never past max_tokens or the context length.
- Each plan takes at most ceil(active / pp_size) requests, so that decoding requests spread over
  pp_size micro-batches and every stage has one to work on.

KV blocks: allocated as chunks are scheduled; when they run out, cached blocks are evicted, and
then the most recently admitted request with nothing in flight is preempted (its blocks freed,
recomputed later from its tokens). A finished or aborted request frees its blocks only once no
plan in flight still writes them. A model with sliding-window layers keeps their KV in a group of
its own, whose blocks are freed as they slide out of the window (kv_groups.py, window_kv.py).

Prefix caching (prefix_cache.py): a request starts from its longest cached prefix of full
blocks, and skips ahead whenever another request has since filled the blocks it would compute
next; the blocks a plan fills become findable as it is built.

Block tables: stages keep each request's table, and a plan carries only what changed (the blocks
gained since the request's previous chunk; `num_blocks_sent` counts what the stages hold), or the
whole table marked `new_table` when they hold none; `released`, `preempted` and `truncated` say
which tables they drop or shorten. Prompt logprobs: see Request.prompt_targets.

Speculative decoding (speculation.py): a request's decode step may carry drafts after its token,
as many as pay (none while KV is short: drafts take only empty blocks, and never past max_tokens or
the context). It waits for its token rather than decode ahead to draft. When the step comes back,
its counts roll back over the drafts that were rejected and the blocks taken only for them go back
(Speculator.settle); blocks the kept drafts completed become findable in the prefix cache then.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from ppserve.scheduler.chunk_predictor import ChunkSizePredictor
from ppserve.scheduler.handover import KvHandover
from ppserve.scheduler.kv_groups import CachedPrefix, KvGroups
from ppserve.scheduler.latency_tracker import LatencyTracker
from ppserve.scheduler.prefix_cache import PrefixCache
from ppserve.scheduler.request import FinishReason, Request
from ppserve.scheduler.speculation import Speculator
from ppserve.transport.messages import NewRequest, PromptTargets, Sampled, SeqChunk, StepPlan, StepResult

PROMPT_SCORE_CHUNK = 256  # most prompt tokens of a request scored per micro-batch (bounds the logits)


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's settings. Their defaults are the production defaults: EngineConfig takes
    its own defaults for these fields from here (engine/config.py), so a default is declared once
    and the pure-scheduler tests run what production runs."""

    num_blocks: int
    block_size: int
    pp_size: int
    # Plans in flight beyond one per stage. 0: a spare plan would hide the host's turnaround, but
    # decodes would then split into pp_size + 1 smaller micro-batches; on CPUs the smaller GEMMs
    # cost more than the turnaround (docs/benchmarks.md#where-a-decode-step-goes).
    async_depth: int = 0
    decode_ahead: bool = True  # at PP=1: plan a request's next decode step before its token is back
    max_running_requests: int = 256
    max_batched_tokens: int = 2048  # new tokens per micro-batch
    chunked_prefill_size: int = 512  # new tokens of one request per micro-batch (the first chunk, if dynamic)
    dynamic_chunking: bool = False  # later chunks of a prompt shrink so that every chunk takes equal time
    chunk_smooth: float = 0.75  # 0: fixed chunks; 1: follow the latency model strictly
    enable_prefix_caching: bool = True  # shared prompt prefixes are computed once (block_allocator.py)
    kv_window: int | None = None  # sliding-window layers' KV group (window_kv.py): its window; None: none
    num_window_blocks: int = 0  # ... and its pool
    speculative: str = "ngram"  # drafts without a model: off | ngram | suffix (drafter.py), k adaptive
    num_speculative_tokens: int = 8  # drafts per request and step at most


@dataclass
class _InFlight:
    items: list[tuple[Request, int]]  # (request, tokens in this plan)
    prefill: tuple[int, int] | None  # (prefix, tokens) when the plan is one prefill chunk: a latency sample
    decode_rows: int  # the plan's rows when it is decode steps only (a step-cost sample), else 0


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.ahead = config.decode_ahead and config.pp_size == 1  # the stage that samples also embeds
        self.depth = config.pp_size + config.async_depth + self.ahead
        self.kv = KvGroups(config)
        self.allocator = self.kv.full  # the full-attention layers' blocks (block_table's)
        self.cache = PrefixCache(self.allocator, self.kv.window)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.inflight: dict[int, _InFlight] = {}
        # Disaggregation: requests whose KV is held for export or still on its way here.
        self.handover = KvHandover(self.kv, self.requests, self.running, self._free)
        self._next_mb = 0
        self._kv_stalled = False  # the last pass over the running requests left one without KV blocks
        self._released: list[str] = []  # announced requests the stages may forget
        self._preempted: list[str] = []  # requests whose block tables the stages must drop
        self.num_preemptions = 0
        self.chunker = ChunkSizePredictor(
            config.chunked_prefill_size, config.chunk_smooth if config.dynamic_chunking else 0.0, config.block_size
        )
        self.latency = LatencyTracker(config.pp_size, config.chunked_prefill_size)
        self.spec = Speculator(config.speculative, config.num_speculative_tokens)
        self._truncated: list[tuple[str, int]] = []  # tables the stages shorten (rejected drafts' blocks)

    # ---- requests in ----------------------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        max_tokens = self.kv.max_tokens
        if len(request.prompt_token_ids) >= max_tokens:
            raise ValueError(f"prompt of {len(request.prompt_token_ids)} tokens cannot fit the KV cache ({max_tokens})")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """End a request early (client gone, or a stop string matched on the host)."""
        r = self.requests.get(request_id)
        if r is None or r.finished:
            return None
        if r in self.waiting:
            self.waiting.remove(r)
        r.finish_reason = reason
        if self.handover.forget(r):  # its KV never arrived: its blocks are freed already
            return r
        self._finish(r)
        return r

    @property
    def next_mb_id(self) -> int:
        """The id the next plan will get (ids only grow, also across pipeline resets)."""
        return self._next_mb

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def prefix_queries(self) -> int:
        """Tokens of admitted requests looked up in the prefix cache."""
        return self.cache.queries

    @property
    def prefix_hits(self) -> int:
        """... and found there."""
        return self.cache.hits

    # ---- planning -------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        if len(self.inflight) >= self.depth or (len(self.inflight) == self.depth - 1 and not self._spare_useful()):
            return None
        cfg = self.config
        admissible = min(len(self.waiting), cfg.max_running_requests - len(self.running))
        cap = max(1, math.ceil((len(self.running) + admissible) / cfg.pp_size))
        budget = cfg.max_batched_tokens
        items: list[tuple[Request, int]] = []
        # Speculation's view of the plan: its rows and the tokens they should make (speculation.py).
        rows = tokens = float(min(cap, len(self.running)))

        stalled = False  # a request found no KV blocks in this pass
        for r in list(self.running):
            if len(items) >= cap or budget == 0:
                stalled |= self._kv_stalled  # the rest went unseen: as the pass before found them
                break
            if not r.block_table:
                continue  # preempted just now (a running request always holds blocks)
            if r.samples_in_flight:
                # While a request waits for KV blocks nobody runs ahead, so that the others come
                # to rest (nothing in flight) and the most recent of them can be preempted. A
                # step ahead (whose token EOS may drop) takes only empty blocks: it never
                # preempts or evicts; without one it rests, and its next step is an ordinary one.
                if stalled or self._kv_stalled or not self._may_go_ahead(r) or self._needs_blocks(r, 1):
                    continue
                n = 1  # the step that reads the token in flight
            elif r.num_scheduled_tokens >= r.num_tokens:
                continue
            else:
                self.cache.skip_cached(r)
                n = min(self._chunk_size(r), budget)
            drafts: list[int] = []
            if n == 1 and not r.samples_in_flight and not stalled and not self._kv_stalled:
                drafts, gain = self.spec.drafts(r, self._draft_limit(r, budget), rows, tokens)
                rows, tokens = rows + len(drafts), tokens + gain
            if self._reserve(r, n + len(drafts)):
                r.drafts = drafts
                budget -= self._take(r, n + len(drafts), items)
            else:
                stalled = True
        self._kv_stalled = stalled

        while self.waiting and len(self.running) < cfg.max_running_requests and budget > 0 and len(items) < cap:
            r = self.waiting[0]  # new or preempted: nothing computed, no blocks
            hit = self.cache.cached_prefix(r)
            start = len(hit.blocks) * cfg.block_size
            n = min(self._chunk_size(r, start), budget)
            if not self.kv.admissible(hit, start + n):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.running.append(r)
            self._admit(r, hit)
            self._reserve(r, n)
            budget -= self._take(r, n, items)

        if not items:
            return None
        return self._emit(items)

    def _spare_useful(self) -> bool:
        """Whether to use the last plan slot, which PP=1 keeps for steps planned ahead: only for a
        request that goes on while a plan of its own is in flight (a step ahead, or a prompt's next
        chunk). Used for requests at rest alone (a grammar's, a prefill held for a transfer, any
        during a KV stall), it would split their decodes into two half batches that alternate,
        the split that `async_depth` 0 avoids. (Beside a request that goes ahead, one that cannot
        still joins every other plan: its token is in flight in the others.)"""
        if not self.ahead:
            return True  # no slot kept: the last one is like any other
        if not any(r.inflight_plans for r in self.running):
            return True  # only ended requests' steps are in flight: there is no batch to split
        for r in self.running:
            if not r.inflight_plans:
                continue
            if r.samples_in_flight:
                if not self._kv_stalled and self._may_go_ahead(r) and not self._needs_blocks(r, 1):
                    return True
            elif r.num_scheduled_tokens < r.num_tokens:
                return True
        return False

    def _needs_blocks(self, r: Request, n: int) -> bool:
        """Whether r's next n tokens need more blocks than are empty (without evicting)."""
        return self.kv.needs_more_than_empty(r, r.num_scheduled_tokens + n)

    def _may_go_ahead(self, r: Request) -> bool:
        """Whether r's next decode step may be planned now, before the token it reads (sampled by
        the plan in flight) is back; the stage fills that token in (see `decode_ahead`). Not for
        a request that would rather draft (drafts follow that token)."""
        p = r.params
        return (
            self.ahead
            and r.samples_in_flight == 1
            and r.num_scheduled_tokens == r.num_tokens  # the plan in flight samples token num_tokens
            and p.grammar is None
            and not r.hold_kv
            and len(r.output_token_ids) + 1 < p.max_tokens  # the token in flight does not end it
            and r.num_tokens + 1 < r.max_model_len
            and not self.spec.wants(r, len(self.running))
        )

    def _draft_limit(self, r: Request, budget: int) -> int:
        """Drafts r's next decode step may carry: within what it may still generate, the plan's
        token budget, and the KV blocks that are empty (drafts never evict or preempt anyone)."""
        if r.pool or r.hold_kv:
            return 0
        limit = min(budget - 1, r.params.max_tokens - len(r.output_token_ids) - 1, r.max_model_len - r.num_tokens - 1)
        while limit > 0 and self._needs_blocks(r, 1 + limit):
            limit -= 1
        return limit

    def _chunk_size(self, r: Request, start: int | None = None) -> int:
        """Tokens r would take next (from `start`, by default what it has scheduled): a decode
        step, or a prefill chunk (sized by the predictor: fixed, or shrinking with the prefix so
        that every chunk takes the same time)."""
        start = r.num_scheduled_tokens if start is None else start
        remaining = r.num_tokens - start
        if remaining <= 1:
            return remaining
        if r.params.prompt_logprobs is not None and start < len(r.prompt_token_ids):
            # Each row of a scored chunk brings a [vocab] row of float32 logits to the last stage.
            return min(self.chunker.next_chunk(start, remaining), PROMPT_SCORE_CHUNK)
        return self.chunker.next_chunk(start, remaining)

    def _take(self, r: Request, n: int, items: list[tuple[Request, int]]) -> int:
        """Put n tokens of r in the plan being built; it counts as in flight from now on (so it is
        never preempted while the plan is assembled), and the blocks it fills become findable."""
        r.inflight_plans += 1
        items.append((r, n))
        self.cache.filled(r, n)
        return n

    def _admit(self, r: Request, hit: CachedPrefix) -> None:
        """r starts running from its cached prefix (shared blocks, computed already)."""
        self.kv.admit(r, hit)
        cached = len(hit.blocks) * self.config.block_size
        r.num_computed_tokens = r.num_scheduled_tokens = cached
        self.cache.admitted(r, cached)

    def flush_cache(self, salt_prefix: str | None = None) -> int:
        """Forget every cached prefix, or those of requests whose cache salt starts with
        `salt_prefix` (a tenant's); requests running keep their blocks. Returns how many unused
        cached blocks became free."""
        return self.kv.flush(salt_prefix)

    def _reserve(self, r: Request, n: int) -> bool:
        """Make sure r's blocks cover n more tokens, preempting others if needed."""
        self.kv.slide(r)  # first: what slid out of its window may serve its next chunk
        need = self.allocator.blocks_for(r.num_scheduled_tokens + n) - len(r.block_table)
        while not self.kv.has_free(need):
            victim = next((v for v in reversed(self.running) if v.inflight_plans == 0 and v.block_table), None)
            if victim is None or victim is r:
                return False
            self._preempt(victim)
        self.kv.grow(r, r.num_scheduled_tokens + n)
        return True

    def _preempt(self, r: Request) -> None:
        """Recompute later: drop r's KV; its tokens so far become the prompt of a fresh prefill."""
        self.num_preemptions += 1
        r.drafts = []
        self.kv.free(r)
        if r.num_blocks_sent:  # the stages hold a table of blocks that are free now
            self._preempted.append(r.request_id)
            r.num_blocks_sent = 0
        r.num_computed_tokens = r.num_scheduled_tokens = 0
        self.running.remove(r)
        self.waiting.appendleft(r)

    def _emit(self, items: list[tuple[Request, int]]) -> StepPlan:
        chunks: list[SeqChunk] = []
        new: list[NewRequest] = []
        targets: list[PromptTargets] = []
        pooled: list[int] = []
        for r, n in items:
            start, drafts = r.num_scheduled_tokens, r.drafts
            follows = start == r.num_tokens  # planned ahead: its token is being sampled
            sample = follows or start + n - len(drafts) == r.num_tokens
            if r.pool and sample:  # an embedding: the prompt's last row is pooled, not sampled
                pooled.append(len(chunks))
                sample = False
            if r.params.prompt_logprobs is not None and (t := r.prompt_targets(len(chunks), start, n)):
                targets.append(t)
            # Only the blocks the stages do not hold yet: a plan grows with new tokens, not context.
            fresh, new_blocks = r.num_blocks_sent == 0, r.block_table[r.num_blocks_sent :]
            window_blocks = r.window_table[r.num_blocks_sent :]  # as many; FREED (-1) where a block slid out
            r.num_blocks_sent = len(r.block_table)
            tokens = [-1] if follows else r.token_slice(start, start + n - len(drafts)) + drafts
            chunks.append(
                SeqChunk(r.request_id, tokens, start, new_blocks, sample, fresh, follows, window_blocks, len(drafts))
            )
            r.num_scheduled_tokens += n
            r.samples_in_flight += sample
            if not r.announced:
                r.announced = True
                prompt = list(r.prompt_token_ids) if r.params.repetition_penalty != 1 else []
                new.append(NewRequest(r.request_id, r.params.wire(), list(r.output_token_ids), prompt, r.grammar_cost))
        mb_id = self._next_mb
        self._next_mb += 1
        single = len(chunks) == 1 and chunks[0].is_prefill
        decode_rows = 0 if any(c.is_prefill for c in chunks) else sum(c.num_new for c in chunks)
        self.inflight[mb_id] = _InFlight(items, (chunks[0].start, chunks[0].num_new) if single else None, decode_rows)
        plan = StepPlan(mb_id, chunks, new, self._released, targets, self._preempted, pooled, self._truncated)
        self._released, self._preempted, self._truncated = [], [], []
        return plan

    # ---- results in -----------------------------------------------------------------------

    def update(self, result: StepResult) -> list[tuple[Request, Sampled | None]]:
        """Apply a finished micro-batch; returns each live request's new token (finished ones
        included), or None for an embedding request that it ended.
        A result for a micro-batch that is not in flight (voided by `reset_pipeline` or `fail_all`)
        is dropped."""
        record = self.inflight.pop(result.mb_id, None)
        if record is None:
            return []
        if record.prefill is not None and self.config.dynamic_chunking:
            for t in result.timings:
                if self.latency.observe(t.stage, *record.prefill, t.end - t.start):
                    self.chunker.set_model(self.latency.model)
        if record.decode_rows and result.timings:
            self.spec.observe_step(record.decode_rows, max(t.end - t.start for t in result.timings))
        for r, n in record.items:
            r.inflight_plans -= 1
            if not r.finished:
                r.num_computed_tokens += n
        for p in result.prompt_logprobs:  # before the samples: they may finish the request
            if (req := self.requests.get(p.request_id)) is not None and not req.finished:
                req.add_prompt_scores(p.start, p.logprobs, p.top_logprobs)
        out: list[tuple[Request, Sampled | None]] = []
        made: dict[str, int] = {}  # tokens each request's step made (more than one where drafts were kept)
        for v in result.pooled:  # embeddings: each ends its request, with nothing sampled
            if (req := self.requests.get(v.request_id)) is not None and not req.finished:
                req.embedding, req.finish_reason = v.vector, FinishReason.STOP
                self._finish(req)
                out.append((req, None))
        for s in result.samples:
            req = self.requests.get(s.request_id)
            if req is None or req.finished:
                continue  # aborted while in flight (or it ended before a step planned ahead): dropped
            if s.request_id not in made:  # a step's first token (a chunk with drafts makes several)
                req.samples_in_flight -= 1
            made[s.request_id] = made.get(s.request_id, 0) + 1
            req.forced = s.forced
            if s.error:  # no token: the request ends with the last stage's error
                req.finish_reason, req.error = FinishReason.ERROR, s.error
                self._finish(req)
            elif req.append_token(s.token_id) is not None:
                self._finish(req)
            elif req.samples_in_flight:
                self.cache.filled_ahead(req)
            out.append((req, s))
        for r, _ in record.items:
            if r.drafts and self.spec.settle(r, made.get(r.request_id, 0), self.kv, self.cache):
                self._truncated.append((r.request_id, len(r.block_table)))
            if r.finished and r.inflight_plans == 0:
                self._free(r)
        return out

    def _finish(self, r: Request) -> None:
        self.spec.finished(r)
        if r in self.running:
            self.running.remove(r)
        if r.inflight_plans == 0:
            self._free(r)

    def _free(self, r: Request) -> None:
        if not self.handover.keeps(r):  # else its KV is still to be sent: the blocks stay
            self.kv.free(r)
            r.num_blocks_sent = 0
        if self.requests.pop(r.request_id, None) is not None and r.announced:
            self._released.append(r.request_id)

    def set_profile(self, stage: int, samples: list[tuple[int, int, float]]) -> None:
        """A stage's start-up latency profile: (prefix, tokens, seconds) per timed prefill."""
        self.chunker.set_model(self.latency.set_profile(stage, samples))

    def reset_pipeline(self) -> int:
        """The stages lost their state (one was replaced): every plan in flight is void. Each running
        request is preempted (its KV is recomputed from its tokens, the generated ones included) and
        every live request is announced again and sends its whole block table again; nothing a
        client has seen is lost. Returns how many requests were preempted."""
        self.inflight.clear()
        self._kv_stalled = False
        for r in list(self.requests.values()):
            r.inflight_plans = 0
            r.samples_in_flight = 0
            r.announced = False
            r.num_blocks_sent = 0  # surviving stages drop every table; a replaced one has none
            if r.finished:  # ended while a plan still wrote its blocks: nothing writes them now
                self._free(r)
        preempted = list(self.running)
        for r in reversed(preempted):  # keep their order at the head of the queue
            self._preempt(r)
        self._released, self._preempted, self._truncated = [], [], []  # the stages forget every request anyway
        self.kv.flush()  # a replaced stage has none of the cached KV
        return len(preempted)

    def fail_all(self, reason: FinishReason = FinishReason.ABORT) -> list[Request]:
        """Everything waiting, running, held or receiving ends (a stage died); returns them."""
        # Those that ended with a plan still in flight are freed too: nothing writes their blocks now.
        lingering = [r for r in self.requests.values() if r.finished]
        ended = list(self.waiting) + list(self.running) + self.handover.fail_all()
        for r in [*ended, *lingering]:
            r.hold_kv = False
        for r in ended:
            r.finish_reason = reason
        self.waiting.clear()
        self.running.clear()
        self.inflight.clear()
        self._kv_stalled = False
        for r in [*ended, *lingering]:
            r.inflight_plans = 0
            self._free(r)
        self.kv.flush()
        return ended
