"""AsyncEngine: the public in-process API. Owns the tokenizer, the scheduler, the engine core
(engine/runtime/core.py: the serving loop) and the stage processes; adds request streams,
detokenizing and recovery around them.

    async with AsyncEngine(config) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.text, end="")

Leaving the iterator early (break, or cancelling the task that reads it) aborts the request
and frees its KV blocks.

A stage that dies or hangs is replaced: the host holds every request's tokens, so the running
requests are preempted (their KV is recomputed) and carry on; clients see a pause, and greedy
or seeded output is unchanged. Past `max_stage_restarts` per window, or when a host task fails,
the engine is dead: every request fails with EngineDeadError naming the cause.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Hashable, Sequence
from types import TracebackType

import zmq

from ppserve.engine.client_share import ClientShares
from ppserve.engine.config import EngineConfig
from ppserve.engine.disagg.connector import open_connector
from ppserve.engine.disagg.rooms import Connector, RoomHost
from ppserve.engine.model.grammar_check import GrammarChecker
from ppserve.engine.model.tokenizer import Tokenizer
from ppserve.engine.outputs import EngineStats, RequestOutput
from ppserve.engine.request_stream import RequestStream
from ppserve.engine.runtime.core import EngineCore, Outputs
from ppserve.engine.runtime.executors import StagePoolExecutor
from ppserve.engine.runtime.ray_stages import NoRoomError, make_pool
from ppserve.engine.runtime.restart_budget import RestartBudget
from ppserve.engine.runtime.stage_pool import StageError, StagePool
from ppserve.engine.runtime.timeline import Timeline
from ppserve.scheduler.request import FinishReason, Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.scheduler.scheduler import Scheduler
from ppserve.transport.messages import Sampled, StageKernels, StepResult

log = logging.getLogger("ppserve.engine")


class EngineDeadError(RuntimeError):
    """The engine cannot serve: a stage failed past the restart budget, a host task failed, or
    the engine was closed."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (`max_waiting_requests`); try again later."""


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = Tokenizer(config.model)
        self.scheduler = Scheduler(config.scheduler_config())
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._pool: StagePool | None = None
        self._core: EngineCore | None = None
        self._core_task: asyncio.Task[None] | None = None
        self.error: Exception | None = None
        self.timeline = Timeline(config.pp_size)  # recent per-stage compute intervals
        self.stage_restarts = [0] * config.pp_size
        self._budget = RestartBudget(config.max_stage_restarts, config.stage_restart_window_s)
        self._recovery: asyncio.Task[None] | None = None
        self.unavailable: NoRoomError | None = None  # Ray has no room for a lost stage (yet): requests fail
        self.rooms: Connector | None = None  # disaggregation (engine/disagg/rooms.py)
        self._progress = asyncio.Event()  # set when requests finish (for `drain`)
        self._closed = False
        self._shares = ClientShares(config.max_requests_per_client)  # requests each client holds
        # Checks SamplingParams.grammar in a worker process (started at the first grammar).
        self.grammars = GrammarChecker(self.tokenizer.hf, config.model_config.vocab_size)

    # ---- lifetime -------------------------------------------------------------------------

    async def start(self) -> AsyncEngine:
        cfg = self.config
        if cfg.device == "cpu" and cfg.cpu_kernels and cfg.synthetic_latency is None:
            # Built once here, before the stages start (and before their start-up timeout runs):
            # each would otherwise compile it at once, at a low priority, on a machine they load.
            await asyncio.get_running_loop().run_in_executor(None, _build_cpu_kernels, cfg)
        self._pool = pool = make_pool(self.config, self._on_stage_failure)
        atexit.register(pool.kill_now)
        try:
            await pool.start()
        except BaseException:
            await self.close()
            raise
        for name, task in pool.tasks.items():
            self._supervise(task, name)
        for stage, samples in enumerate(pool.profiles):
            if samples:
                self.scheduler.set_profile(stage, samples)
        self._core = EngineCore(self.scheduler, StagePoolExecutor(pool), self, self.timeline)
        self._core_task = self._supervise(asyncio.create_task(self._core.run()), "engine core")
        try:
            self._start_rooms(pool)
        except zmq.ZMQError as e:
            await self.close()
            where = self.config.disagg_address(self.config.disagg_port)
            raise RuntimeError(f"cannot listen for disaggregation at {where}: {e}") from None
        return self

    def _start_rooms(self, pool: StagePool) -> None:
        cfg = self.config
        if cfg.disaggregation and (faults := cfg.disagg_faults) is not None and faults.active:
            log.warning("%s", faults.describe())  # loudly: its stages inject these faults
        host = RoomHost(
            cfg,
            self.scheduler.handover,
            send_to=lambda stage, msg: self.pool.send_to(stage, msg),
            kv_addresses=lambda: list(self.pool.kv_addresses),
            check_request=self.check_request,
            generate=self.generate,
            wake=self.wake,
        )
        self.rooms = open_connector(host)
        if self.rooms is None:
            return
        pool.on_kv_status = self.rooms.on_kv_status
        self._supervise(asyncio.create_task(self.rooms.serve()), f"{cfg.disaggregation} room server")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in (self._core_task, self._recovery) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.error is None:
            self.error = EngineDeadError("the engine is shut down")
        self._fail_streams(self.error)
        if self.rooms is not None:
            self.rooms.close()
        await self.grammars.close()
        self.tokenizer.close()  # a chat template still rendering ends now, with an error
        if self._pool is not None:
            await self._pool.close()
            atexit.unregister(self._pool.kill_now)

    async def drain(self, timeout_s: float) -> bool:
        """Wait (up to timeout_s) until every request has finished; True if they all did. New
        requests are still accepted meanwhile: a server refuses them itself while it drains."""
        deadline = time.monotonic() + timeout_s
        while self.scheduler.has_work and self.error is None:
            self._progress.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._progress.wait(), remaining)
            except TimeoutError:
                return False
        return self.error is None and not self.scheduler.has_work

    async def __aenter__(self) -> AsyncEngine:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def healthy(self) -> bool:
        """Started and not dead (it may be recovering: requests then wait)."""
        return self._core_task is not None and self.error is None

    @property
    def stage_nodes(self) -> tuple[tuple[str, str], ...]:
        """Under Ray, per stage: its node's Ray id and address (for /health and /metrics)."""
        return self._pool.stage_nodes() if self._pool is not None else ()

    @property
    def stage_kernels(self) -> list[StageKernels]:
        """Per stage: the CPU kernels it runs, its float linears' per row count (/debug/pipeline)."""
        return list(self._pool.kernels) if self._pool is not None else []

    @property
    def recovering(self) -> bool:
        return self._recovery is not None and self.error is None

    # ---- requests -------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prefill: str | None = None,
        hold_kv: bool = False,
        cache_salt: str | None = None,
        client: Hashable | None = None,
        pool: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs. Raises ValueError for bad input, EngineDeadError if the
        engine cannot serve (also mid-stream), EngineOverloadedError if the queue is full.

        Disaggregation (engine/disagg/rooms.py): on a decode engine, `prefill` (a prefill engine's
        bootstrap address) has the prompt prefilled there and its KV sent here, then decodes on
        (DisaggregationError if that fails); `hold_kv` keeps a finished request's KV for a
        transfer (the prefill engine's own use).

        `cache_salt` (1 to 256 characters): only requests with the same salt, or none, share
        cached prompt prefixes (a tenant's own); it changes no output.

        `client`: who sent it (an API key's tenant, a connection), which may hold at most
        `max_requests_per_client` requests at once (ClientLimitError past it). None: not counted.

        `pool`: an embedding (see `embed`) rather than generated tokens."""
        params = params or SamplingParams()
        if pool and (prefill is not None or hold_kv or params.prompt_logprobs is not None):
            raise ValueError("an embedding is computed here, with no prompt logprobs")
        grammar_cost = await self.check_grammar(params.grammar) if params.grammar else 0
        if isinstance(prompt, str):
            ids = await self.tokenizer.encode_async(prompt, self.config.max_model_len)
        else:
            ids = list(prompt)
        self._check_admission()
        self._shares.check(client)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        request = self._request(rid, ids, params, cache_salt)
        request.hold_kv, request.pool = hold_kv, pool
        request.grammar_cost = grammar_cost
        stream = RequestStream(request, self.tokenizer.detokenizer(ids))
        if prefill is None:
            self.scheduler.add(request)
        self._streams[rid] = stream
        self._shares.take(client)
        self.wake()
        try:
            if prefill is not None:
                await self._prefill_remotely(stream, prefill)
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            # Closed early or cancelled: end the request and give its KV blocks back.
            self._streams.pop(rid, None)
            self._shares.give(client)
            if not request.finished:
                self.abort(rid)

    async def embed(
        self,
        prompt: str | Sequence[int],
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        client: Hashable | None = None,
    ) -> RequestOutput:
        """The prompt's embedding (`RequestOutput.embedding`, None if the request was aborted):
        its last token's hidden state after the model's final norm, L2-normalized. It runs
        through the pipeline as any prefill does (chunked, prefix-cached), with nothing sampled.
        Raises as `generate` does."""
        async for out in self.generate(prompt, None, request_id, cache_salt=cache_salt, client=client, pool=True):
            if out.finished:
                return out
        raise AssertionError("a request's outputs end with a finished one")

    async def _prefill_remotely(self, stream: RequestStream, prefill: str) -> None:
        if self.rooms is None:
            raise ValueError("prefilling elsewhere needs an engine in disaggregation mode 'decode'")
        first = await self.rooms.prefill_remotely(stream.request, prefill)
        if first is None:
            return  # aborted meanwhile: the stream ends with what abort put in it
        self._push(stream, first)
        self._progress.set()
        self.wake()

    async def check_grammar(self, grammar: str) -> int:
        """The bytes `grammar` (SamplingParams.grammar) costs a last stage to keep compiled;
        ValueError naming llguidance's reason or the budget it is over, unless it compiles for this
        model's tokenizer. Compiled in a worker process, under a budget (engine/model/grammar_check.py)."""
        try:
            return await self.grammars.check(grammar)
        except RuntimeError as e:  # the worker cannot start: no grammar can be checked
            raise ValueError(f"grammars cannot be checked now: {e}") from None

    @property
    def pool(self) -> StagePool:
        assert self._pool is not None, "the engine is not started"
        return self._pool

    def wake(self) -> None:
        """The scheduler may have work (a request came or went, blocks were freed outside a step)."""
        if self._core is not None:
            self._core.wake()

    def check_request(
        self,
        token_ids: Sequence[int],
        params: SamplingParams | None = None,
        pending: int = 0,
        cache_salt: str | None = None,
        client: Hashable | None = None,
    ) -> None:
        """Raise what `generate` would raise for this request, without starting it: ValueError
        (naming the problem) for a prompt that cannot be served, EngineDeadError,
        EngineOverloadedError or ClientLimitError when the engine cannot take it now (`pending`:
        requests the caller has checked but not started yet, e.g. the other choices of one HTTP
        request)."""
        self._request("check", list(token_ids), params or SamplingParams(), cache_salt)
        self._check_admission(pending)
        self._shares.check(client, pending)

    def _check_admission(self, pending: int = 0) -> None:
        if not self.healthy:
            raise EngineDeadError(str(self.error) if self.error else "the engine is not started")
        if self.unavailable is not None:
            raise self.unavailable
        if len(self.scheduler.waiting) + pending >= self.config.max_waiting_requests:
            raise EngineOverloadedError(f"{len(self.scheduler.waiting)} requests are already waiting")

    def _request(
        self, request_id: str, ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> Request:
        vocab = self.config.model_config.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"token id {t!r} is outside the vocabulary (size {vocab})")
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:  # sorted by id
            raise ValueError(f"logit_bias token id {params.logit_bias[-1][0]} is outside the vocabulary (size {vocab})")
        if params.prompt_logprobs is not None and self.config.disaggregation:
            raise ValueError("prompt_logprobs are not supported with prefill/decode disaggregation")
        mc = self.config.model_config
        return Request(request_id, ids, params, mc.eos_token_ids, self.config.max_model_len, cache_salt)

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) is not None:
            self.wake()
            self._progress.set()
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.end()

    def stats(self, window_s: float = 10.0) -> EngineStats:
        s = self.scheduler
        free = s.allocator.num_free
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_blocks_used=s.allocator.num_blocks - free,
            kv_blocks_total=s.allocator.num_blocks,
            stage_busy=self.timeline.busy_fractions(time.time() - window_s, time.time()),
            prefill_chunks=dict(self.timeline.prefill_chunks),
            latency_model=(m.a, m.b, m.c) if (m := s.latency.model) is not None else None,
            preemptions=s.num_preemptions,
            stage_restarts=tuple(self.stage_restarts),
            recovering=self.recovering,
            prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits,
            prefix_cache_blocks=s.allocator.num_cached,
            prefix_cache_evictions=s.allocator.num_evictions,
            stage_tokens=tuple(self.timeline.stage_tokens),
            spec_drafts=s.spec.stats.drafts,
            spec_draft_tokens=s.spec.stats.draft_tokens,
            spec_accepted_tokens=s.spec.stats.accepted_tokens,
            stage_nodes=self.stage_nodes,
            moe=self._pool.expert_load.layers() if self._pool is not None else (),
        )

    # ---- results --------------------------------------------------------------------------

    def emit(self, outputs: Outputs, result: StepResult) -> None:
        """The core's output sink: each sampled token to its request's stream."""
        last = {request.request_id: i for i, (request, _) in enumerate(outputs)}  # a step may make several
        for i, (request, sample) in enumerate(outputs):
            if (stream := self._streams.get(request.request_id)) is None:
                continue
            if sample is None:  # an embedding, which ended its request
                stream.end()
            else:
                self._push(stream, sample, last[request.request_id] == i)

        self._progress.set()

    def _push(self, stream: RequestStream, sample: Sampled, last: bool = True) -> None:
        rid = stream.request.request_id
        stream.push(sample, lambda: self.scheduler.abort(rid, FinishReason.STOP), last)

    # ---- failures -------------------------------------------------------------------------

    def _supervise(self, task: asyncio.Task[None], name: str, forever: bool = True) -> asyncio.Task[None]:
        """A host task that must not fail silently: if it raises (or, when `forever`, ends at
        all), the error is logged with its traceback and the engine is dead."""

        def done(t: asyncio.Task[None]) -> None:
            if t.cancelled() or self._closed:
                return
            error = t.exception()
            if error is None and not forever:
                return
            error = error or RuntimeError("it stopped")
            log.error("the %s failed; the engine cannot serve", name, exc_info=error)
            self._die(EngineDeadError(f"internal error in the {name}: {type(error).__name__}: {error}"))

        task.add_done_callback(done)
        return task

    def _on_stage_failure(self, error: StageError) -> None:
        log.error("%s", error)
        if self._closed or self.error is not None or self._recovery is not None:
            return  # a recovery in progress watches the stages itself
        if self._core is None or error.fatal:
            self._die(EngineDeadError(str(error)))
            return
        self._recovery = self._supervise(asyncio.create_task(self._recover(error)), "stage recovery", forever=False)

    async def _recover(self, error: StageError) -> None:
        """Replace the failed stage while its requests wait, then carry on from their tokens."""
        assert self._pool is not None and self._core is not None
        self._core.pause()
        charge = True  # waiting for room anywhere in a Ray cluster costs no restart
        while True:
            cfg = self.config
            if error.stage is None or (charge and not self._budget.take(time.monotonic())):
                log.error(
                    "no stage restart left (at most %d per %.0f s); the engine is dead",
                    cfg.max_stage_restarts,
                    cfg.stage_restart_window_s,
                )
                self._die(EngineDeadError(str(error)))
                return
            preempted = self._core.reset_pipeline()
            log.warning("replacing stage %d; %d running request(s) will be recomputed", error.stage, preempted)
            try:
                replaced = await self._pool.replace(error.stage, self.scheduler.next_mb_id)
            except StageError as e:
                log.error("replacing stage %d failed: %s", error.stage, e)
                error, charge = e, not isinstance(e, NoRoomError)
                if isinstance(e, NoRoomError) and self.unavailable is None:
                    self.unavailable = e  # what waits fails now, naming what is missing
                    self.scheduler.fail_all()
                    self._fail_streams(e)
                continue
            if self.error is not None:
                return  # another host task failed meanwhile: the engine is dead already
            for i in replaced:
                self.stage_restarts[i] += 1
            break
        log.info("pipeline repaired (stage(s) %s replaced); serving again", ", ".join(map(str, replaced)))
        self._recovery = self.unavailable = None
        self._core.resume()

    def _die(self, error: EngineDeadError) -> None:
        """The engine cannot serve any more: fail everything now, and say so in `error`."""
        if self.error is None:
            self.error = error
        if self._core is not None:
            self._core.pause()
        self.scheduler.fail_all()
        self._fail_streams(self.error)
        self._progress.set()

    def _fail_streams(self, error: Exception) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(error)


def _build_cpu_kernels(config: EngineConfig) -> None:
    """The CPU kernel library of the stages on this machine, built into the cache if it is not there
    (engine/model/cpu_kernels.py); the stages then load it."""
    from ppserve.engine.model import cpu_kernels

    cpu_kernels.configure(config.cpu_kernels, config.cache_dir)
    cpu_kernels.load()
