"""A pipeline stage as its own process: the StageRunner core wrapped with transport.

Three tasks connected by small queues keep communication off the critical path:

    receive (plan k+1 and its input) -> compute (plan k, in a worker thread) -> send (plan k-1)

Plans execute strictly in the order received; that order is what makes chunked prefill safe
(chunk k+1 reads the KV that chunk k wrote on this stage). The last stage samples and sends a
StepResult to the host with every stage's compute interval. A heartbeat tells the host this
stage is alive (from the moment the process starts, model loading included); the stage exits
by itself when the host process goes away.

A separate reader takes messages off the plan socket, so that a `Reset` (another stage was
replaced) is seen even while the pipeline waits for activations that will never come: the
three tasks are then restarted empty, and the host is told with `ResetDone`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

import torch

from ppserve.engine.config import EngineConfig
from ppserve.engine.disagg.stage_kv import StageKv
from ppserve.engine.model.grammar_check import STAGE_STACK_BYTES
from ppserve.engine.runtime.cpu_affinity import pin_stage
from ppserve.engine.runtime.gpu_clock import GpuClock, Span
from ppserve.engine.runtime.latency_profile import profile_points, run_profile
from ppserve.engine.runtime.priority import lower_this_thread
from ppserve.engine.runtime.prompt_logprobs import last_stage_outputs, make_sampler, prompt_rows
from ppserve.engine.runtime.stage_process import keep_freed_memory, set_process_name, spawn
from ppserve.engine.runtime.synthetic import SyntheticRunner
from ppserve.transport.addresses import Addresses
from ppserve.transport.channels import open_channel
from ppserve.transport.cluster_key import CurveKeys, Guard
from ppserve.transport.control import PullSocket, PushSocket, context
from ppserve.transport.messages import (
    PROTOCOL_VERSION,
    EdgeHeader,
    Heartbeat,
    KvBootstrap,
    KvExpect,
    KvExport,
    KvForget,
    Pooled,
    PromptLogprobs,
    Reset,
    ResetDone,
    Sampled,
    Shutdown,
    StageFailed,
    StageReady,
    StepPlan,
    StepResult,
    Timing,
)
from ppserve.transport.tensor_channel import ChannelSpec, TensorChannel

if TYPE_CHECKING:
    from ppserve.engine.runtime.stage_runner import StageRunner

log = logging.getLogger("ppserve.stage")
HEARTBEAT_S = 0.2
EXPERT_REPORT_BEATS = 5  # a MoE model's expert loads go with every fifth heartbeat (once a second)
Received = tuple[StepPlan, "EdgeHeader | None", "torch.Tensor | None"]
Results = tuple[list[Sampled], list[PromptLogprobs], list[Pooled]]  # the last stage's outputs
Computed = tuple["torch.Tensor | Results", "Span"]  # a plan's output, and when it computed
Output = tuple[StepPlan, list[Timing], "asyncio.Future[Computed]"]
QUEUE_DEPTH = 2  # plans received before their turn, and plans handed to the compute thread (their outputs)


@dataclass(frozen=True)
class StageLaunch:
    """Everything a stage process needs; pickled to it at spawn."""

    config: EngineConfig
    stage: int
    addresses: Addresses
    inbound: ChannelSpec | None  # from stage - 1
    outbound: ChannelSpec | None  # to stage + 1
    dist_port: int  # torch.distributed store port (gloo / nccl channels), else 0
    threads: int
    parent_pid: int  # the stage exits when its parent is no longer this; 0: not a child of the host (Ray)
    first_mb: int = 0  # micro-batches before this one were voided (a replacement joins mid-run)
    key: bytes | None = field(default=None, repr=False)  # the cluster secret, across nodes
    dist_host: str = "127.0.0.1"  # where rank 0 runs the torch.distributed store (Ray: stage 0's node)
    node_addr: str = ""  # this stage's node address, where its sockets bind (Ray; a cluster's is in its config)


def _init_compute_thread(threads: int, gpu: int | None, nice: int) -> None:
    lower_this_thread(nice)  # before its OpenMP team starts, which inherits it (priority.py)
    torch.set_num_threads(threads)
    if gpu is not None:
        torch.cuda.set_device(gpu)


def spawn_stage(launch: StageLaunch) -> BaseProcess:
    """A stage's process, running `stage_main`."""
    return spawn(stage_main, launch, f"ppserve-stage-{launch.stage}")


def stage_main(launch: StageLaunch) -> None:
    """Process entry point (spawn)."""
    # Ctrl-C reaches the whole process group; the host decides when stages stop (and a stage
    # exits by itself if the host is gone), so a stage prints no KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(run_stage(launch))


def run_stage(launch: StageLaunch) -> int:
    """The stage, in this process's main thread, until it stops; its exit status."""
    set_process_name(f"ppserve-stage-{launch.stage}")
    keep_freed_memory()
    # The threads started from here on (compute, grammar) have stacks deep enough for any grammar
    # the host's grammar worker passed (engine/model/grammar_check.py): address space, not memory.
    threading.stack_size(STAGE_STACK_BYTES)
    pin_stage(launch.config, launch.stage, launch.threads)  # before torch starts its OpenMP team
    torch.set_num_threads(launch.threads)
    if launch.config.stage_gpus:  # before anything touches CUDA: this stage's GPU is "cuda" here
        torch.cuda.set_device(launch.config.stage_gpus[launch.stage])
    if launch.config.debug_loop_ms is not None:
        _watch_loop(launch.stage, launch.config.debug_loop_ms)  # on asyncio's loop: uvloop cannot be timed
    else:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
    if launch.config.across_hosts:  # refused peers are logged (transport/cluster_key.py)
        logging.basicConfig(level=logging.WARNING, format=f"ppserve-stage-{launch.stage}: %(message)s")
    return asyncio.run(_run(launch))


async def _run(launch: StageLaunch) -> int:
    return await StageWorker(launch).run()  # made in the loop: its sockets' guard needs one


class StageWorker:
    def __init__(self, launch: StageLaunch) -> None:
        self.launch = launch
        self.stage = launch.stage
        self.config = launch.config
        self.last = launch.stage == launch.config.pp_size - 1
        self.ctx = context()
        # The key guards the sockets that cross machines: in a cluster all of them; on one host
        # (ipc:// in a private directory) only a disaggregated pair's KV sockets.
        self.guard = Guard(self.ctx, CurveKeys.from_secret(launch.key), f"stage {self.stage}") if launch.key else None
        self.link_guard = self.guard if launch.config.across_hosts else None
        self.inbox = PushSocket(self.ctx, launch.addresses.host_inbox(), bind=False, guard=self.link_guard)
        self.plans = PullSocket(self.ctx, launch.addresses.plans(launch.stage), bind=False, guard=self.link_guard)
        # The stage's GPU, on CUDA. The current device is per thread: it is set in this thread (by
        # stage_main) and in the compute thread, so "cuda" always means this stage's GPU.
        self.gpu = launch.config.stage_gpus[launch.stage] if launch.config.stage_gpus else None
        # One compute thread; torch's thread count is set there too (OpenMP settings are per thread).
        self.compute_pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="compute",
            initializer=_init_compute_thread,
            initargs=(launch.threads, self.gpu, launch.config.compute_nice),
        )
        self._timer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="timer")  # CUDA events (see Span)
        # Activations' copies into and out of the tensor channels (shared memory, host frames):
        # off the event loop, and beside the compute thread, as they were when they ran on the loop.
        self._copies = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="copy",
            initializer=_init_compute_thread,
            initargs=(launch.threads, self.gpu, launch.config.compute_nice),
        )
        self._gpu_clock: GpuClock | None = None  # set at start-up on CUDA (synthetic stages: wall clock)
        self._dist = False  # joined a torch.distributed process group
        self.kv: StageKv | None = None  # disaggregation: this stage's KV sender or receiver
        self._computing: set[asyncio.Future[Computed]] = set()  # plans handed to the compute thread
        self.inbound: TensorChannel | None = None
        self.outbound: TensorChannel | None = None
        # Activations of micro-batches below this id are leftovers of plans voided by a reset:
        # skipped. Any other mismatch between a plan and its activations is an error.
        self.first_mb = launch.first_mb
        # The loaded runner's MoE load counts (its `expert_tokens`), for the heartbeat; none while it loads.
        self._expert_tokens: Callable[[], dict[int, list[int]]] = dict
        self._node_addr = launch.node_addr or (self.config.cluster.node_addr if self.config.cluster else "")

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._stopped: asyncio.Future[None] = loop.create_future()  # a result: drained; an error: failed
        self._pipeline: list[asyncio.Task[None]] = []
        tasks = [self._watch(asyncio.create_task(self._heartbeat()))]  # from the start: loading included
        try:
            try:
                await self._start()
            except Exception as e:
                await self._fail(f"failed to start: {type(e).__name__}: {e}")
                return 1
            self._plans: asyncio.Queue[StepPlan | None] = asyncio.Queue()
            self._pipeline = self._launch_pipeline()
            tasks.append(self._watch(asyncio.create_task(self._read_plans())))
            try:
                await self._stopped  # until the pipeline drains after Shutdown, or a task fails
                self._leave_process_group()
                return 0
            except Exception as e:
                await self._fail(f"{type(e).__name__}: {e}\n{''.join(traceback.format_exception(e, limit=5))}")
                return 1
        finally:
            for t in [*tasks, *self._pipeline]:
                t.cancel()
            self._close()

    def _watch(self, task: asyncio.Task[None]) -> asyncio.Task[None]:
        """The first task to fail stops the stage (with that error)."""

        def done(t: asyncio.Task[None]) -> None:
            if not t.cancelled() and (error := t.exception()) is not None and not self._stopped.done():
                self._stopped.set_exception(error)

        task.add_done_callback(done)
        return task

    def _launch_pipeline(self) -> list[asyncio.Task[None]]:
        received: asyncio.Queue[Received | None] = asyncio.Queue(QUEUE_DEPTH)
        outputs: asyncio.Queue[Output | None] = asyncio.Queue(QUEUE_DEPTH)
        send = self._watch(asyncio.create_task(self._send(outputs)))
        send.add_done_callback(self._drained)
        return [
            self._watch(asyncio.create_task(self._receive(received))),
            self._watch(asyncio.create_task(self._compute(received, outputs))),
            send,
        ]

    def _drained(self, send: asyncio.Task[None]) -> None:
        """The send task ends normally only after Shutdown has drained the pipeline."""
        if not send.cancelled() and send.exception() is None and not self._stopped.done():
            self._stopped.set_result(None)

    async def _read_plans(self) -> None:
        while True:
            msg = await self.plans.recv()
            if isinstance(msg, Reset):
                await self._reset(msg.epoch, msg.first_mb)
            elif isinstance(msg, Shutdown):
                await self._plans.put(None)
                return
            elif isinstance(msg, (KvBootstrap, KvExport, KvExpect, KvForget)):
                assert self.kv is not None, f"{type(msg).__name__} for a stage that is not disaggregated"
                self.kv.handle(msg)
            else:
                assert isinstance(msg, StepPlan), f"unexpected {type(msg).__name__} on the plan socket"
                await self._plans.put(msg)

    async def _reset(self, epoch: int, first_mb: int) -> None:
        """Void every plan received so far: stop the pipeline, let a computation in progress end
        (its output is dropped), forget queued plans, block tables and sampling state, start
        again empty (the host then sends every request's whole table again)."""
        for t in self._pipeline:
            t.cancel()
        for computed in list(self._computing):  # queued: a plan may still start (its output is dropped)
            computed.cancel()
        await asyncio.gather(*self._pipeline, return_exceptions=True)
        # The compute pool has one thread: once this has run, no old plan is computing, and the
        # tables it kept are gone before any new plan is applied.
        await asyncio.get_running_loop().run_in_executor(self.compute_pool, self.runner.clear_tables)
        while not self._plans.empty():
            self._plans.get_nowait()
        if self.last:
            self.sampler.clear()
        self.first_mb = first_mb
        self._pipeline = self._launch_pipeline()
        await self.inbox.send(ResetDone(self.stage, epoch))

    async def _start(self) -> None:
        launch, cluster = self.launch, self.config.cluster
        if (kind := self.config.process_group) is not None:  # every stage joins, whatever its own edges
            from ppserve.transport.dist_channel import init_process_group

            gpu = torch.device("cuda", self.gpu) if kind == "nccl" and self.gpu is not None else None
            pp = self.config.pp_size
            if self._node_addr:
                from ppserve.engine.cluster.config import interface_of

                # Connections between ranks go out on this node's address, not where the hostname points.
                if (iface := interface_of(self._node_addr)) is not None:
                    os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
                    os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
            if cluster is None:  # rank 0 runs the store
                init_process_group(kind, self.stage, pp, launch.dist_host, launch.dist_port, device_id=gpu)
            else:  # meet in the cluster's rendezvous store, run by node 0
                host, port = cluster.dist_init_host, cluster.dist_init_port
                init_process_group(kind, self.stage, pp, host, port, device_id=gpu, store_prefix="ppserve/pg/")
            self._dist = True
        # Load the slice in the compute thread so heartbeats flow during long loads.
        loop = asyncio.get_running_loop()
        self.runner = await loop.run_in_executor(self.compute_pool, _make_runner, self.config, self.stage)
        self._expert_tokens = self.runner.expert_tokens
        if self.gpu is not None and self.config.synthetic_latency is None:
            self._gpu_clock = await loop.run_in_executor(self.compute_pool, GpuClock)
        profile: list[tuple[int, int, float]] = []
        if self.config.dynamic_chunking:
            profile = await loop.run_in_executor(self.compute_pool, self._profile)
        if self.last:
            self.sampler = make_sampler(self.config)
        copies = self._copies
        if launch.inbound is not None:
            self.inbound = open_channel(self.ctx, launch.inbound, sender=False, guard=self.link_guard, executor=copies)
        if launch.outbound is not None:
            self.outbound = open_channel(self.ctx, launch.outbound, sender=True, guard=self.link_guard, executor=copies)
        # Every edge carries one tiny tensor now, so that connections (NCCL's communicators) exist
        # before serving: the first micro-batch never pays for them, nor waits on them.
        await asyncio.gather(*(ch.warm_up() for ch in (self.inbound, self.outbound) if ch is not None))
        if self.config.disaggregation:  # KV transfers run beside the pipeline (engine/disagg/)
            where = (self.ctx, self.config, self.stage, self._kv_cache, self.compute_pool, self.inbox)
            self.kv = StageKv(*where, self.guard, self._node_addr, self._watch)
        kv_address = self.kv.address if self.kv is not None else ""
        kernels = self.runner.kernels
        ready = (self.config.num_kv_blocks, os.getpid(), profile, kv_address, kernels)
        await self.inbox.send(StageReady(self.stage, PROTOCOL_VERSION, *ready))

    def _kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache  # type: ignore[union-attr]

    def _profile(self) -> list[tuple[int, int, float]]:
        """Compute thread: time prefills for the host's chunk-size model."""
        cfg = self.config
        blocks = min(cfg.num_kv_blocks, cfg.num_window_blocks or cfg.num_kv_blocks)  # its ids index either group
        points = profile_points(cfg.chunked_prefill_size, min(cfg.max_model_len, blocks * cfg.block_size))
        hidden = (cfg.model_config.hidden_size, cfg.torch_dtype) if self.stage > 0 else None
        return run_profile(self.runner.execute, points, cfg.block_size, hidden)

    async def _receive(self, received: asyncio.Queue[Received | None]) -> None:
        hidden_size = self.config.model_config.hidden_size
        device = torch.device(self.config.device)
        while True:
            msg = await self._plans.get()
            if msg is None:
                await received.put(None)
                return
            if self.last:  # the grammars' masks compute while the earlier stages do
                self.sampler.prepare(msg)
            header, hidden = None, None
            if self.inbound is not None:
                rows = sum(c.num_new for c in msg.chunks)
                hidden = torch.empty((rows, hidden_size), dtype=self.config.torch_dtype, device=device)
                header = await self.inbound.recv(hidden, skip_before=self.first_mb)
                if header.mb_id != msg.mb_id:
                    raise RuntimeError(
                        f"stage {self.stage}: activations of micro-batch {header.mb_id} for plan {msg.mb_id}"
                    )
            await received.put((msg, header, hidden))

    async def _compute(self, received: asyncio.Queue[Received | None], outputs: asyncio.Queue[Output | None]) -> None:
        """Each plan goes to the compute thread as soon as its inputs are here, queued behind the
        one computing: the thread goes from plan to plan without a trip through this loop in
        between (at PP=1, where the next plan is usually here before the last one ends, that
        trip was a measurable share of a decode step: docs/benchmarks.md#where-a-decode-step-goes).
        The send task awaits the outputs in order."""
        loop = asyncio.get_running_loop()
        while (item := await received.get()) is not None:
            plan, header, hidden = item
            computed = loop.run_in_executor(self.compute_pool, self._execute, plan, hidden)
            self._computing.add(computed)
            computed.add_done_callback(self._computed)
            await outputs.put((plan, header.timings if header else [], computed))
        await outputs.put(None)

    def _computed(self, computed: asyncio.Future[Computed]) -> None:
        """A plan's output is in, or it was cancelled. Its error is read here as well: the send
        task raises it, in order, but nobody awaits the outputs after a reset or a failed send,
        and asyncio would log each of those as never retrieved."""
        self._computing.discard(computed)
        if not computed.cancelled() and (error := computed.exception()) is not None:
            # The send task raises it if the plan is still wanted; a voided plan's error would
            # otherwise go unseen, and it may well come back.
            log.warning("stage %d: a plan failed: %r", self.stage, error)

    def _execute(self, plan: StepPlan, hidden: torch.Tensor | None) -> Computed:
        """Compute thread: this stage's layers; on the last stage, sampling too. On CUDA, with
        events around the layers' kernels (see Span)."""
        start, before = time.time(), self.runner.tokens_computed
        out, events = self._forward(plan, hidden)
        return out, Span(start, time.time(), events, self._gpu_clock, self.runner.tokens_computed - before)

    def _forward(
        self, plan: StepPlan, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor | Results, tuple[torch.cuda.Event, torch.cuda.Event] | None]:
        events = None
        if self._gpu_clock is not None:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        if not self.last:
            out = self.runner.execute_plan(plan, hidden)
            if events is not None:
                events[1].record()
            return out, events
        plan = self.sampler.follow(plan)  # the tokens of steps planned ahead: sampled by the plan before
        logits = self.runner.execute_plan(plan, hidden, prompt_rows=prompt_rows(plan))
        results = last_stage_outputs(self.sampler, plan, logits, self.runner.pooled)
        if events is not None:
            events[1].record()  # after sampling, which is part of this stage's time
        return results, events

    async def _send(self, outputs: asyncio.Queue[Output | None]) -> None:
        loop = asyncio.get_running_loop()
        while (item := await outputs.get()) is not None:
            plan, upstream, computed = item
            out, span = await computed
            if span.events is None:
                mine = span.timing(self.stage)
            else:  # waits for the kernels: a thread of its own, so compute runs on meanwhile
                mine = await loop.run_in_executor(self._timer, span.timing, self.stage)
            timings = [*upstream, mine]
            if isinstance(out, torch.Tensor):
                assert self.outbound is not None
                # On CUDA the copy waits for this plan's kernels only, not for the next plan's.
                ready = span.events[1] if span.events is not None else None
                await self.outbound.send(EdgeHeader(plan.mb_id, timings), out, ready)
            else:
                samples, prompt_logprobs, pooled = out
                await self.inbox.send(StepResult(plan.mb_id, samples, timings, prompt_logprobs, pooled))

    async def _heartbeat(self) -> None:
        beats = 0
        while True:
            if self.launch.parent_pid and os.getppid() != self.launch.parent_pid:
                # The host was killed and could not clean up: remove its socket files, then go.
                print(f"ppserve-stage-{self.stage}: host process is gone, exiting", file=sys.stderr)
                self.launch.addresses.cleanup()
                os._exit(1)
            beats += 1
            tokens = self._expert_tokens() if beats % EXPERT_REPORT_BEATS == 0 else {}
            await self.inbox.send(Heartbeat(self.stage, tokens, os.getpid()))
            await asyncio.sleep(HEARTBEAT_S)

    async def _fail(self, error: str) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.inbox.send(StageFailed(self.stage, error, os.getpid())), 1.0)
        print(f"ppserve-stage-{self.stage}: {error}", file=sys.stderr)

    def _leave_process_group(self) -> None:
        """After a clean drain (a failing stage just exits: the group cannot be left politely)."""
        if self._dist:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._dist = False

    def _close(self) -> None:
        for ch in (self.inbound, self.outbound):
            if ch is not None:
                ch.close()
        if self.kv is not None:
            self.kv.close()
        self.inbox.close()
        self.plans.close()
        self.compute_pool.shutdown(wait=False, cancel_futures=True)
        self._timer.shutdown(wait=False, cancel_futures=True)
        self._copies.shutdown(wait=False, cancel_futures=True)
        if self.guard is not None:
            self.guard.stop()
        self.ctx.term()


def _watch_loop(stage: int, bound_ms: float) -> None:
    """Debug: each finding is one line on stderr, which the tests read (a stage's stderr is its
    parent's); a line rather than a failure, so that recovery cannot hide it."""
    from ppserve.engine.runtime import loop_watch

    def report(line: str) -> None:
        print(f"ppserve-stage-{stage}: {line}", file=sys.stderr, flush=True)

    loop_watch.install(bound_ms, report)


def _make_runner(config: EngineConfig, stage: int) -> StageRunner | SyntheticRunner:
    if config.synthetic_latency is not None:
        return SyntheticRunner(config, stage)
    from ppserve.engine.runtime.memory_check import check_stage_memory
    from ppserve.engine.runtime.stage_runner import StageRunner

    check_stage_memory(config, stage)  # a stage too big for this node: one line now, not an OOM kill later
    return StageRunner(config, stage)
