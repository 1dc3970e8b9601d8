"""The host's side of the stages: start the processes, send plans, read what comes back, tell a
dead or hung stage from a slow one, and replace a failed stage with a fresh process.

Liveness: a stage whose process has exited is caught within `MONITOR_S`. A stage that is alive
but silent (no heartbeat, no result) for `stage_timeout_s` is declared hung and killed. Before
blaming a stage, the monitor checks its own lateness: if the host itself was paused or blocked
(a stopped process, a swapped-out machine), every stage gets a fresh grace period instead.

Replacement (`replace`): the failed stage's process is killed, the surviving stages are told to
void what they hold (`Reset`, answered by `ResetDone`), and a fresh process loads the same
layers and opens the same channels. With torch.distributed channels (gloo, nccl) a process
group cannot take in a new member, so every stage is replaced.

Across nodes (`config.cluster`), node 0's pool first admits the other nodes (engine/cluster/rendezvous.py),
then spawns only its own stages; the others are `RemoteStage`s, started and stopped by their
node's agent and watched through its heartbeats (engine/cluster/remote_nodes.py). There a failure is
fatal: the engine fails its requests and the cluster is restarted as a whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from ppserve.engine.cluster.remote_nodes import NODE_TIMEOUT_S, RemoteNodes, RemoteStage
from ppserve.engine.config import EngineConfig
from ppserve.engine.runtime.expert_load import ExpertLoad
from ppserve.engine.runtime.stage_process import channel_specs
from ppserve.engine.runtime.stage_worker import StageLaunch, spawn_stage
from ppserve.transport.addresses import Addresses, free_ports, tcp_address
from ppserve.transport.cluster_key import CurveKeys, Guard
from ppserve.transport.control import PullSocket, PushSocket, context
from ppserve.transport.messages import (
    PROTOCOL_VERSION,
    Heartbeat,
    KvStatus,
    Layout,
    Msg,
    NodeHeartbeat,
    NodeStageExited,
    Reset,
    ResetDone,
    Shutdown,
    StageFailed,
    StageKernels,
    StageReady,
    StepResult,
    encode,
)
from ppserve.transport.tensor_channel import ChannelSpec

if TYPE_CHECKING:
    from ppserve.engine.cluster.rendezvous import HostRendezvous

_sched_yield = getattr(os, "sched_yield", lambda: None)  # Linux and the BSDs; a no-op elsewhere
log = logging.getLogger("ppserve.engine")
MONITOR_S = 0.1
HOST_STALL_S = 0.5  # a monitor tick this late means the host itself was not running
Handshake = StageReady | ResetDone | StageFailed


class StageError(RuntimeError):
    """A stage failed to start, crashed, or stopped answering (`stage`: which, when known;
    `fatal`: it cannot be replaced, as on another node)."""

    def __init__(self, message: str, stage: int | None = None, fatal: bool = False) -> None:
        super().__init__(message)
        self.stage = stage
        self.fatal = fatal


class StagePool:
    def __init__(
        self,
        config: EngineConfig,
        on_failure: Callable[[StageError], None],
    ) -> None:
        self.config = config
        # The last stage's results, in plan order (None: a wake-up, see executors.py).
        self.results: asyncio.Queue[StepResult | None] = asyncio.Queue()
        # Called once per failed stage process while serving; during start-up or a replacement,
        # failures are raised by `start` / `replace` instead.
        self.on_failure = on_failure
        cluster = config.cluster
        self.local = cluster.local_stages if cluster else list(range(config.pp_size))
        self.ctx = context()
        key = config.socket_key if config.across_hosts else None  # (a disaggregated pair's is not for these)
        self.keys = CurveKeys.from_secret(key) if key else None
        self.guard = Guard(self.ctx, self.keys, "host") if self.keys else None
        if not config.across_hosts:
            self.addresses = Addresses.ipc(config.pp_size)
            inbox, plans = self.addresses.host_inbox(), [self.addresses.plans(i) for i in range(config.pp_size)]
        else:  # ports picked by the OS; the stages learn them from the layout
            inbox = tcp_address(cluster.node_addr if cluster else config.ray.host_addr, "*")  # type: ignore[union-attr]
            plans = [inbox] * config.pp_size
        self.inbox = PullSocket(self.ctx, inbox, bind=True, guard=self.guard)
        self.plan_socks = [PushSocket(self.ctx, a, bind=True, guard=self.guard) for a in plans]
        if config.across_hosts:  # the edges are known once the stages are placed
            self.addresses = Addresses(self.inbox.address, tuple(s.address for s in self.plan_socks), ())
        if cluster is not None:
            # This node's stages bind their inbound edges on its address, at ports picked now.
            ports = free_ports(config.pp_size, cluster.node_addr)
            local_edges = [tcp_address(cluster.node_addr, port) for port in ports]
            self.addresses = Addresses(
                self.inbox.address, tuple(s.address for s in self.plan_socks), tuple(local_edges[1:])
            )
        self.procs: list[BaseProcess | RemoteStage] = []
        self.nodes: RemoteNodes | None = None
        self.last_seen: list[float] = [time.monotonic()] * config.pp_size
        self.profiles: list[list[tuple[int, int, float]]] = [[] for _ in range(config.pp_size)]
        self.kv_addresses: list[str] = [""] * config.pp_size  # decode side of disaggregation: KV receivers
        self.kernels: list[StageKernels] = [StageKernels() for _ in range(config.pp_size)]  # as each last said
        moe = config.model_config.moe
        experts = {} if moe is None else {i: moe.num_experts for i, sparse in enumerate(moe.sparse_layers) if sparse}
        self.expert_load = ExpertLoad(experts, config.layer_ranges)  # from the heartbeats
        self.on_kv_status: Callable[[KvStatus], None] | None = None  # disaggregation: the engine's
        self.epoch = 0  # resets sent so far
        # Long-lived tasks, by name (the engine supervises them).
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._specs: list[ChannelSpec] = []
        self._dist_port = 0
        self._handshakes: asyncio.Queue[Handshake] = asyncio.Queue()
        self._handshaking = False  # start-up or replacement: `_handshake` watches the stages itself
        # Processes whose failure was reported (or that we killed), as (node, pid): pids repeat across nodes.
        self._reported: set[tuple[int, int]] = set()
        self._deferred: tuple[StageError, float] | None = None  # a cluster's failure, until its deadline
        self.rendezvous: HostRendezvous | None = None

    def stage_nodes(self) -> tuple[tuple[str, str], ...]:
        """Under Ray, per stage: its node's Ray id and address (else nothing: the layout is fixed)."""
        return ()

    @property
    def replaces_all(self) -> bool:
        """Whether a failed stage is replaced together with every other (a process group cannot
        take in a new member)."""
        return self.config.process_group is not None

    def _launch(self, stage: int, first_mb: int) -> StageLaunch:
        return StageLaunch(
            config=self.config,
            stage=stage,
            addresses=self.addresses,
            inbound=self._specs[stage - 1] if stage > 0 else None,
            outbound=self._specs[stage] if stage < self.config.pp_size - 1 else None,
            dist_port=self._dist_port,
            threads=self.config.threads_per_stage,
            parent_pid=os.getpid(),
            first_mb=first_mb,
            key=self.config.socket_key,
        )

    def _start_stage(self, launch: StageLaunch) -> BaseProcess | RemoteStage:
        return spawn_stage(launch)

    def _spawn(self, stage: int, first_mb: int = 0) -> None:
        proc = self._start_stage(self._launch(stage, first_mb))
        self._reported.discard(self._id(stage, proc.pid))  # a pid the OS reused from a process reported before
        if stage < len(self.procs):
            self.procs[stage] = proc
        else:
            self.procs.append(proc)
        self.last_seen[stage] = time.monotonic()

    # ---- start-up and replacement ---------------------------------------------------------

    async def start(self) -> None:
        """Spawn every stage and wait until all are ready; a stage's own error if one fails.
        In a cluster, first admit the other nodes (RendezvousError if one is refused or missing)."""
        self.tasks = {"result reader": asyncio.create_task(self._read())}
        if self.config.cluster is not None:
            await self._admit_nodes()
        await self._renew()
        self._specs = channel_specs(self.config, self.addresses, self.local)
        for i in range(self.config.pp_size):
            if i in self.local:
                self._spawn(i)
            else:
                assert self.nodes is not None
                node = self.config.cluster.stage_nodes[i]  # type: ignore[union-attr]
                self.procs.append(RemoteStage(i, node, self.nodes.joins[node].addr))
        self.tasks["stage monitor"] = asyncio.create_task(self._monitor())
        await self._handshake(set(range(self.config.pp_size)), set())

    async def _admit_nodes(self) -> None:
        from ppserve.engine.cluster.fingerprint import checkpoint_fingerprint
        from ppserve.engine.cluster.rendezvous import HostRendezvous

        cluster = self.config.cluster
        assert cluster is not None
        try:
            rendezvous = self.rendezvous = HostRendezvous(cluster, self.config.stage_start_timeout_s)
        except OSError as e:
            raise StageError(f"cannot listen on --dist-init-addr {cluster.dist_init_addr}: {e.strerror or e}") from None
        fingerprint = checkpoint_fingerprint(self.config.model)
        joins = await rendezvous.admit(fingerprint, self.config.cluster_settings())
        edges = list(self.addresses.edge_addrs)
        for stage in range(1, self.config.pp_size):
            node = cluster.stage_nodes[stage]
            if node != 0:
                edges[stage - 1] = joins[node].edges[stage]
        controls = [""] + [joins[n].control for n in range(1, cluster.nnodes)]
        layout = Layout(self.addresses.host_inbox(), list(self.addresses.plan_addrs), edges, controls)
        self.addresses = Addresses.from_layout(layout)
        self.nodes = RemoteNodes(self.ctx, joins, self.keys)
        rendezvous.publish(layout)

    async def replace(self, stage: int, first_mb: int) -> list[int]:
        """Replace a failed stage (or every stage, with a process group) and reset the others;
        returns the stages that were replaced. `first_mb`: the id of the first plan after the
        reset (older ones are void). Raises StageError if that fails."""
        every = set(range(self.config.pp_size))
        fresh = every if self.replaces_all else {stage}
        for i in sorted(fresh):
            await self._kill(i)
        self.epoch += 1
        survivors = every - fresh
        for i in sorted(survivors):
            self.plan_socks[i].send_nowait(Reset(self.epoch, first_mb))
        await self._renew()
        if fresh == every:  # new edges throughout (the shm rings too: no survivor holds one)
            self._specs = channel_specs(self.config, self.addresses, self.local)
        for i in sorted(fresh):
            self._spawn(i, first_mb)
        await self._handshake(set(fresh), survivors)
        return sorted(fresh)

    async def _renew(self) -> None:
        """Before (re)starting stages: a fresh process group's store port (the old store may
        still linger). Under Ray, placing them (engine/runtime/ray_stages.py)."""
        if self.config.process_group is not None and self.config.cluster is None:
            self._dist_port = free_ports(1)[0]

    async def _kill(self, stage: int) -> None:
        self.plan_socks[stage].discard_pending()  # plans that never reached the old process
        proc = self.procs[stage]
        if proc.pid is not None:
            self._reported.add(self._id(stage, proc.pid))
        if proc.is_alive():
            proc.kill()  # SIGKILL also ends a stopped (hung) process
        deadline = time.monotonic() + 5.0
        while proc.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if proc.is_alive():
            # Stuck in the kernel (a wedged driver call): a replacement beside it would share its
            # sockets and shared memory, so there is none.
            raise StageError(f"stage {stage} (pid {proc.pid}) does not die; cannot replace it", stage)
        proc.join(timeout=0)

    async def _handshake(self, fresh: set[int], resetting: set[int]) -> None:
        """Wait until every fresh stage is ready and every resetting one has reset, within the
        start-up timeout; raises StageError naming the stage that failed or is missing."""
        timeout_s = self.config.stage_start_timeout_s
        deadline = time.monotonic() + timeout_s
        self._handshaking = True
        try:
            while fresh or resetting:
                now = time.monotonic()
                for i in sorted(fresh | resetting):
                    if not self.procs[i].is_alive():
                        await self._raise_dead(i)
                    # A survivor was answering heartbeats before the reset: the usual grace applies.
                    if i in resetting and now - self.last_seen[i] > self.config.stage_timeout_s:
                        self.procs[i].kill()
                        raise StageError(f"stage {i} (pid {self.procs[i].pid}) did not answer the reset", i)
                if time.monotonic() > deadline:
                    missing = sorted(fresh | resetting)
                    raise StageError(f"stages {missing} not ready after {timeout_s:.0f} s", missing[0])
                try:
                    msg = await asyncio.wait_for(self._handshakes.get(), timeout=0.2)
                except TimeoutError:
                    continue
                if isinstance(msg, StageFailed) and self._owns(msg.stage, msg.pid):
                    raise StageError(f"stage {msg.stage} {msg.error}", msg.stage)
                if isinstance(msg, StageReady) and self._owns(msg.stage, msg.pid):
                    if msg.protocol != PROTOCOL_VERSION:
                        raise StageError(
                            f"stage {msg.stage} speaks protocol {msg.protocol}, host {PROTOCOL_VERSION}", msg.stage
                        )
                    fresh.discard(msg.stage)
                    self.profiles[msg.stage] = msg.profile
                    self.kv_addresses[msg.stage] = msg.kv_address
                    self.kernels[msg.stage] = msg.kernels
                if isinstance(msg, ResetDone) and msg.epoch == self.epoch:
                    resetting.discard(msg.stage)
        finally:
            self._handshaking = False
            now = time.monotonic()
            self.last_seen = [now] * self.config.pp_size

    def _id(self, stage: int, pid: int | None) -> tuple[int, int]:
        return (self.config.cluster.stage_nodes[stage] if self.config.cluster else 0, pid or 0)

    def _owns(self, stage: int, pid: int) -> bool:
        """Whether a message from process `pid` comes from the current process of `stage`."""
        proc = self.procs[stage]
        return proc.claim(pid) if isinstance(proc, RemoteStage) else proc.pid == pid

    async def _raise_dead(self, stage: int) -> None:
        """A stage died during a handshake: its own message (sent just before it exited) if it
        comes soon, else its exit code."""
        proc = self.procs[stage]
        self._reported.add(self._id(stage, proc.pid))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                while True:
                    msg = await self._handshakes.get()
                    if isinstance(msg, StageFailed) and msg.stage == stage and self._owns(stage, msg.pid):
                        raise StageError(f"stage {stage} {msg.error}", stage)
        if isinstance(proc, RemoteStage):
            raise StageError(f"{proc.describe()}: {proc.gone}", stage, fatal=self.config.cluster is not None)
        raise StageError(f"stage {stage} (pid {proc.pid}) exited during start-up (exit code {proc.exitcode})", stage)

    # ---- serving --------------------------------------------------------------------------

    def send_to(self, stage: int, msg: Msg) -> None:
        """A message on one stage's plan socket, in order with the plans."""
        self.plan_socks[stage].send_nowait(msg)

    def send_plan(self, plan: Msg) -> None:
        data = encode(plan)  # once for every stage
        for sock in self.plan_socks:
            sock.send_nowait(data)
        # ZMQ's I/O thread writes the plan out, and needs a core for it. Where the stages' OpenMP
        # teams keep every core busy (CPU serving), it waited for this thread's time slice to end
        # while this thread went on to stream the last step's tokens, and the stage sat idle between
        # steps (measured: docs/benchmarks.md#against-vllm-and-llamacpp). With a core free it
        # returns at once.
        _sched_yield()

    async def _read(self) -> None:
        while True:
            msg = await self.inbox.recv()
            if isinstance(msg, StepResult):
                self.last_seen[-1] = time.monotonic()
                self.results.put_nowait(msg)
                continue
            if isinstance(msg, NodeHeartbeat) and self.nodes is not None:
                self.nodes.heard(msg.node)
                continue
            if isinstance(msg, NodeStageExited):
                self._remote_exited(msg)
                continue
            if isinstance(msg, KvStatus):
                if self.on_kv_status is not None:
                    self.on_kv_status(msg)
                continue
            stage = getattr(msg, "stage", None)
            if stage is not None:
                self.last_seen[stage] = time.monotonic()
            if isinstance(msg, Heartbeat) and msg.expert_tokens:
                self.expert_load.report(msg.stage, time.monotonic(), msg.expert_tokens, msg.pid)
            if isinstance(msg, (StageReady, ResetDone)) or (isinstance(msg, StageFailed) and self._handshaking):
                self._handshakes.put_nowait(msg)
            elif isinstance(msg, StageFailed) and self._owns(msg.stage, msg.pid):
                self._report(StageError(f"stage {msg.stage} failed: {msg.error}", msg.stage), msg.pid)

    def _remote_exited(self, msg: NodeStageExited) -> None:
        proc = self.procs[msg.stage] if msg.stage < len(self.procs) else None
        if isinstance(proc, RemoteStage) and proc.claim(msg.pid) and proc.is_alive():
            proc.gone = f"its process exited (code {msg.exitcode})"

    async def _monitor(self) -> None:
        tick = time.monotonic()
        while True:
            await asyncio.sleep(MONITOR_S)
            now = time.monotonic()
            if now - tick > MONITOR_S + HOST_STALL_S:
                # The host was not running (paused, or its loop blocked): the stages' messages are
                # still queued unread, so their silence says nothing about them.
                log.warning("the host's event loop stalled for %.1f s; not blaming the stages", now - tick)
                self.last_seen = [now] * self.config.pp_size
                if self.nodes is not None:
                    self.nodes.refresh()
            tick = now
            self._check_nodes()
            if self._handshaking:
                continue
            self._report_deferred()
            for i, proc in enumerate(self.procs):
                if self._id(i, proc.pid) in self._reported:
                    continue
                if isinstance(proc, RemoteStage) and not proc.is_alive():
                    self._report(StageError(f"{proc.describe()} is gone: {proc.gone}", i), proc.pid)
                elif not proc.is_alive():
                    self._report(
                        StageError(f"stage {i} (pid {proc.pid}) died with exit code {proc.exitcode}", i), proc.pid
                    )
                elif (silent := now - self.last_seen[i]) > self.config.stage_timeout_s:
                    proc.kill()  # a hung process cannot be trusted to wake up later
                    message = f"stage {i} (pid {proc.pid}) sent nothing for {silent:.1f} s; killed it"
                    self._report(StageError(message, i), proc.pid)

    def _check_nodes(self) -> None:
        """A node silent too long is lost, and every stage on it with it."""
        if self.nodes is None:
            return
        for node, silent in self.nodes.newly_lost():
            why = f"node {node} is unreachable: nothing heard from it for {silent:.1f} s"
            log.error("%s (stage(s) %s)", why, ", ".join(str(p.stage) for p in self._remote(node)))
            for proc in self._remote(node):
                proc.gone = proc.gone or why

    def _remote(self, node: int) -> list[RemoteStage]:
        return [p for p in self.procs if isinstance(p, RemoteStage) and p.node == node]

    def _report(self, error: StageError, pid: int | None) -> None:
        """Tell the engine, once per failed process. In a cluster nothing is replaced: the failure
        is fatal, and the other nodes are told to stop their stages. There a stage's own error
        (say, its connection to the next node broke) waits a node timeout first: if a node is
        lost meanwhile, that is the cause to report, not the neighbour that noticed it."""
        assert error.stage is not None
        if self._id(error.stage, pid) in self._reported:
            return
        self._reported.add(self._id(error.stage, pid))
        if self.config.cluster is None:
            self.on_failure(error)
            return
        error.fatal = True
        lost = any(isinstance(p, RemoteStage) and not p.is_alive() for p in self.procs)
        if not lost:
            if self._deferred is None:  # the first one waits; later ones are its consequences
                self._deferred = (error, time.monotonic() + NODE_TIMEOUT_S + 2 * MONITOR_S)
            return
        self._deferred = None
        self.abandon()
        self.on_failure(error)

    def _report_deferred(self) -> None:
        if self._deferred is not None and time.monotonic() > self._deferred[1]:
            error, _ = self._deferred
            self._deferred = None
            self.abandon()
            self.on_failure(error)

    def abandon(self) -> None:
        """A cluster that lost a stage cannot serve: stop every stage on every node now (the
        host process and its server stay, reporting the engine dead)."""
        for stage, proc in enumerate(self.procs):
            self._reported.add(self._id(stage, proc.pid))
            if proc.is_alive():
                proc.kill()
        if self.nodes is not None:
            self.nodes.shutdown()

    # ---- shutdown -------------------------------------------------------------------------

    def kill_now(self) -> None:
        """Last resort when the interpreter exits without close(): no orphans, no socket files."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        self.addresses.cleanup()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Ask every stage to stop, wait briefly, then kill what is left; remove socket files.
        Other nodes' agents are told too: they give their stages the same grace."""
        for task in self.tasks.values():
            task.cancel()
        local = [p for p in self.procs if not isinstance(p, RemoteStage)]
        if any(not p.is_alive() for p in self.procs):
            timeout_s = 0.0  # survivors may be blocked on the dead stage's activations: kill them
        for sock in self.plan_socks:
            with contextlib.suppress(Exception):
                sock.send_nowait(Shutdown())
        if self.nodes is not None:
            self.nodes.shutdown()
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in local) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for p in local:
            if p.is_alive():
                p.kill()
        # Awaited, not joined: a join would hold the event loop (and whatever else it serves).
        deadline = time.monotonic() + 1.0
        while any(p.is_alive() for p in local) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for p in local:
            p.join(timeout=0)  # reaps the dead; one stuck in the kernel is left (SIGKILL was sent)
        # Across nodes, what was just sent may still be on its way: let it go out (briefly).
        linger_ms = 500 if self.config.cluster is not None else 0
        self.inbox.close()
        for sock in self.plan_socks:
            sock.close(linger_ms)
        if self.nodes is not None:
            await self.nodes.close()
        if self.guard is not None:
            self.guard.stop()
        self.ctx.term()
        if self.rendezvous is not None:
            self.rendezvous.close()
        self.addresses.cleanup()
