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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from multiprocessing.process import BaseProcess

import torch.multiprocessing as mp

from ppserve.engine.config import EngineConfig
from ppserve.engine.stage_worker import StageLaunch, stage_main
from ppserve.transport.addresses import Addresses, free_port_block
from ppserve.transport.control import PullSocket, PushSocket, context
from ppserve.transport.messages import (
    PROTOCOL_VERSION,
    Msg,
    Reset,
    ResetDone,
    Shutdown,
    StageFailed,
    StageReady,
    StepResult,
    encode,
)
from ppserve.transport.tensor_channel import ChannelSpec

log = logging.getLogger("ppserve.engine")
MONITOR_S = 0.1
HOST_STALL_S = 0.5  # a monitor tick this late means the host itself was not running
Handshake = StageReady | ResetDone | StageFailed


class StageError(RuntimeError):
    """A stage failed to start, crashed, or stopped answering (`stage`: which, when known)."""

    def __init__(self, message: str, stage: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage


class StagePool:
    def __init__(
        self,
        config: EngineConfig,
        on_result: Callable[[StepResult], None],
        on_failure: Callable[[StageError], None],
    ) -> None:
        self.config = config
        self.on_result = on_result
        # Called once per failed stage process while serving; during start-up or a replacement,
        # failures are raised by `start` / `replace` instead.
        self.on_failure = on_failure
        self.addresses = (
            Addresses.tcp(config.pp_size, config.stage_hosts[0], config.stage_hosts)
            if config.stage_hosts
            else Addresses.ipc(config.pp_size)
        )
        self.ctx = context()
        self.inbox = PullSocket(self.ctx, self.addresses.host_inbox(), bind=True)
        self.plan_socks = [PushSocket(self.ctx, self.addresses.plans(i), bind=True) for i in range(config.pp_size)]
        self.procs: list[BaseProcess] = []
        self.last_seen: list[float] = [time.monotonic()] * config.pp_size
        self.profiles: list[list[tuple[int, int, float]]] = [[] for _ in range(config.pp_size)]
        self.epoch = 0  # resets sent so far
        self.tasks: list[asyncio.Task[None]] = []  # the reader and the monitor (the engine supervises them)
        self._specs = self._channel_specs()
        self._dist_port = 0
        self._handshakes: asyncio.Queue[Handshake] = asyncio.Queue()
        self._handshaking = False  # start-up or replacement: `_handshake` watches the stages itself
        self._reported: set[int] = set()  # pids whose failure was reported (or that we killed)

    @property
    def uses_process_group(self) -> bool:
        return self.config.tensor_transport in ("gloo", "nccl")

    def _channel_specs(self) -> list[ChannelSpec]:
        cfg = self.config
        specs = []
        for i in range(cfg.pp_size - 1):
            ring = None
            if cfg.tensor_transport == "shm":
                from ppserve.transport.shm_channel import allocate_ring

                elem = cfg.torch_dtype.itemsize
                slot_bytes = cfg.max_batched_tokens * cfg.model_config.hidden_size * elem
                ring = allocate_ring(cfg.pp_size + cfg.async_depth, slot_bytes)
            specs.append(ChannelSpec(cfg.tensor_transport, i, i + 1, self.addresses.edge(i), ring))
        return specs

    def _spawn(self, stage: int, first_mb: int = 0) -> None:
        cfg = self.config
        launch = StageLaunch(
            config=cfg,
            stage=stage,
            addresses=self.addresses,
            inbound=self._specs[stage - 1] if stage > 0 else None,
            outbound=self._specs[stage] if stage < cfg.pp_size - 1 else None,
            dist_port=self._dist_port,
            threads=cfg.threads_per_stage,
            parent_pid=os.getpid(),
            first_mb=first_mb,
        )
        proc = mp.get_context("spawn").Process(
            target=stage_main, args=(launch,), name=f"ppserve-stage-{stage}", daemon=True
        )
        with _sigint_blocked():
            proc.start()
        self._reported.discard(proc.pid or 0)  # a pid the OS reused from a process reported before
        if stage < len(self.procs):
            self.procs[stage] = proc
        else:
            self.procs.append(proc)
        self.last_seen[stage] = time.monotonic()

    # ---- start-up and replacement ---------------------------------------------------------

    async def start(self) -> None:
        """Spawn every stage and wait until all are ready; a stage's own error if one fails."""
        self.tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._monitor())]
        if self.uses_process_group:
            self._dist_port = free_port_block(1)
        for i in range(self.config.pp_size):
            self._spawn(i)
        await self._handshake(set(range(self.config.pp_size)), set())

    async def replace(self, stage: int, first_mb: int) -> list[int]:
        """Replace a failed stage (or every stage, with a process group) and reset the others;
        returns the stages that were replaced. `first_mb`: the id of the first plan after the
        reset (older ones are void). Raises StageError if that fails."""
        every = set(range(self.config.pp_size))
        fresh = every if self.uses_process_group else {stage}
        for i in sorted(fresh):
            await self._kill(i)
        self.epoch += 1
        survivors = every - fresh
        for i in sorted(survivors):
            self.plan_socks[i].send_nowait(Reset(self.epoch, first_mb))
        if self.uses_process_group:
            self._dist_port = free_port_block(1)  # a fresh group: the old store may still linger
        for i in sorted(fresh):
            self._spawn(i, first_mb)
        await self._handshake(set(fresh), survivors)
        return sorted(fresh)

    async def _kill(self, stage: int) -> None:
        self.plan_socks[stage].discard_pending()  # plans that never reached the old process
        proc = self.procs[stage]
        if proc.pid is not None:
            self._reported.add(proc.pid)
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
                if isinstance(msg, StageFailed) and msg.pid == self.procs[msg.stage].pid:
                    raise StageError(f"stage {msg.stage} {msg.error}", msg.stage)
                if isinstance(msg, StageReady) and msg.pid == self.procs[msg.stage].pid:
                    if msg.protocol != PROTOCOL_VERSION:
                        raise StageError(
                            f"stage {msg.stage} speaks protocol {msg.protocol}, host {PROTOCOL_VERSION}", msg.stage
                        )
                    fresh.discard(msg.stage)
                    self.profiles[msg.stage] = msg.profile
                if isinstance(msg, ResetDone) and msg.epoch == self.epoch:
                    resetting.discard(msg.stage)
        finally:
            self._handshaking = False
            now = time.monotonic()
            self.last_seen = [now] * self.config.pp_size

    async def _raise_dead(self, stage: int) -> None:
        """A stage died during a handshake: its own message (sent just before it exited) if it
        comes soon, else its exit code."""
        proc = self.procs[stage]
        self._reported.add(proc.pid or 0)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                while True:
                    msg = await self._handshakes.get()
                    if isinstance(msg, StageFailed) and msg.pid == proc.pid:
                        raise StageError(f"stage {stage} {msg.error}", stage)
        raise StageError(f"stage {stage} (pid {proc.pid}) exited during start-up (exit code {proc.exitcode})", stage)

    # ---- serving --------------------------------------------------------------------------

    def send_plan(self, plan: Msg) -> None:
        data = encode(plan)  # once for every stage
        for sock in self.plan_socks:
            sock.send_nowait(data)

    async def _read(self) -> None:
        while True:
            msg = await self.inbox.recv()
            if isinstance(msg, StepResult):
                self.last_seen[-1] = time.monotonic()
                self.on_result(msg)
                continue
            stage = getattr(msg, "stage", None)
            if stage is not None:
                self.last_seen[stage] = time.monotonic()
            if isinstance(msg, (StageReady, ResetDone)) or (isinstance(msg, StageFailed) and self._handshaking):
                self._handshakes.put_nowait(msg)
            elif isinstance(msg, StageFailed) and msg.pid == self.procs[msg.stage].pid:
                self._report(StageError(f"stage {msg.stage} failed: {msg.error}", msg.stage), msg.pid)

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
            tick = now
            if self._handshaking:
                continue
            for i, proc in enumerate(self.procs):
                if proc.pid in self._reported:
                    continue
                if not proc.is_alive():
                    self._report(
                        StageError(f"stage {i} (pid {proc.pid}) died with exit code {proc.exitcode}", i), proc.pid
                    )
                elif (silent := now - self.last_seen[i]) > self.config.stage_timeout_s:
                    proc.kill()  # a hung process cannot be trusted to wake up later
                    message = f"stage {i} (pid {proc.pid}) sent nothing for {silent:.1f} s; killed it"
                    self._report(StageError(message, i), proc.pid)

    def _report(self, error: StageError, pid: int | None) -> None:
        """Tell the engine, once per failed process."""
        if pid in self._reported:
            return
        self._reported.add(pid or 0)
        self.on_failure(error)

    # ---- shutdown -------------------------------------------------------------------------

    def kill_now(self) -> None:
        """Last resort when the interpreter exits without close(): no orphans, no socket files."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        self.addresses.cleanup()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Ask every stage to stop, wait briefly, then kill what is left; remove socket files."""
        for task in self.tasks:
            task.cancel()
        if any(not p.is_alive() for p in self.procs):
            timeout_s = 0.0  # survivors may be blocked on the dead stage's activations: kill them
        for sock in self.plan_socks:
            with contextlib.suppress(Exception):
                sock.send_nowait(Shutdown())
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=1.0)
        self.inbox.close()
        for sock in self.plan_socks:
            sock.close()
        self.ctx.term()
        self.addresses.cleanup()


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Block SIGINT while a stage process is spawned. Ctrl-C reaches the whole process group;
    the child inherits the blocked signal, so a stage interrupted while it still imports torch
    prints no KeyboardInterrupt traceback (the host decides when stages stop). In this process
    a Ctrl-C that comes meanwhile stays pending and is delivered when the block ends."""
    # Starting multiprocessing's resource tracker (which spawning does on first use) unblocks
    # SIGINT when it is done, so it is started before the block.
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
