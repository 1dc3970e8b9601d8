"""The host's side of the stages: start the processes, send plans, read what comes back, and
notice (within a second) a stage that died or stopped answering."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.stage_worker import HEARTBEAT_S, StageLaunch, stage_main
from transport.addresses import Addresses, free_port_block
from transport.control import PullSocket, PushSocket, context
from transport.messages import (
    PROTOCOL_VERSION,
    Heartbeat,
    Msg,
    Shutdown,
    StageFailed,
    StageReady,
    StepResult,
)
from transport.tensor_channel import ChannelSpec

DEAD_AFTER_S = 1.0  # no heartbeat for this long: the stage is considered dead
MONITOR_S = 0.1


class StageError(RuntimeError):
    """A stage failed to start, crashed, or stopped answering."""


class StagePool:
    def __init__(
        self,
        config: EngineConfig,
        on_result: Callable[[StepResult], None],
        on_failure: Callable[[StageError], None],
    ) -> None:
        self.config = config
        self.on_result = on_result
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
        self.last_seen: list[float] = []
        self.failed: StageError | None = None
        self.profiles: list[list[tuple[int, int, float]]] = [[] for _ in range(config.pp_size)]
        self._tasks: list[asyncio.Task[None]] = []

    def _channel_specs(self) -> list[ChannelSpec]:
        cfg = self.config
        specs = []
        for i in range(cfg.pp_size - 1):
            ring = None
            if cfg.tensor_transport == "shm":
                from transport.shm_channel import allocate_ring

                elem = cfg.torch_dtype.itemsize
                slot_bytes = cfg.max_batched_tokens * cfg.model_config.hidden_size * elem
                ring = allocate_ring(cfg.pp_size + cfg.async_depth, slot_bytes)
            specs.append(ChannelSpec(cfg.tensor_transport, i, i + 1, self.addresses.edge(i), ring))
        return specs

    async def start(self) -> None:
        """Spawn every stage and wait until all are ready; a stage's own error if one fails."""
        cfg = self.config
        specs = self._channel_specs()
        dist_port = free_port_block(1) if cfg.tensor_transport in ("gloo", "nccl") else 0
        ctx = mp.get_context("spawn")
        for i in range(cfg.pp_size):
            launch = StageLaunch(
                config=cfg,
                stage=i,
                addresses=self.addresses,
                inbound=specs[i - 1] if i > 0 else None,
                outbound=specs[i] if i < cfg.pp_size - 1 else None,
                dist_port=dist_port,
                threads=cfg.threads_per_stage,
                parent_pid=os.getpid(),
            )
            proc = ctx.Process(target=stage_main, args=(launch,), name=f"ppserve-stage-{i}", daemon=True)
            proc.start()
            self.procs.append(proc)
        self.last_seen = [time.monotonic()] * cfg.pp_size
        ready: set[int] = set()
        deadline = time.monotonic() + cfg.stage_start_timeout_s
        while len(ready) < cfg.pp_size:
            try:
                msg = await asyncio.wait_for(self.inbox.recv(), timeout=0.2)
            except TimeoutError:
                dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    # Prefer the stage's own message (sent just before it exited) to its exit code.
                    with contextlib.suppress(TimeoutError):
                        while not isinstance(msg := await asyncio.wait_for(self.inbox.recv(), 0.5), StageFailed):
                            pass
                        raise StageError(f"stage {msg.stage} {msg.error}") from None
                    code = self.procs[dead[0]].exitcode
                    raise StageError(f"stage {dead[0]} exited during start-up (exit code {code})") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(cfg.pp_size)) - ready)
                    raise StageError(f"stages {missing} not ready after {cfg.stage_start_timeout_s:.0f} s") from None
                continue
            if isinstance(msg, StageFailed):
                raise StageError(f"stage {msg.stage} {msg.error}")
            if isinstance(msg, StageReady):
                if msg.protocol != PROTOCOL_VERSION:
                    raise StageError(f"stage {msg.stage} speaks protocol {msg.protocol}, host {PROTOCOL_VERSION}")
                ready.add(msg.stage)
                self.profiles[msg.stage] = msg.profile
            self._seen(msg)
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._monitor())]

    def _seen(self, msg: Msg) -> None:
        stage = getattr(msg, "stage", None)
        if stage is not None:
            self.last_seen[stage] = time.monotonic()

    async def send_plan(self, plan: Msg) -> None:
        for sock in self.plan_socks:
            await sock.send(plan)

    async def _read(self) -> None:
        while True:
            msg = await self.inbox.recv()
            if isinstance(msg, StepResult):
                self.last_seen[-1] = time.monotonic()
                self.on_result(msg)
            elif isinstance(msg, Heartbeat):
                self._seen(msg)
            elif isinstance(msg, StageFailed):
                self._fail(StageError(f"stage {msg.stage} failed: {msg.error}"))

    async def _monitor(self) -> None:
        while self.failed is None:
            now = time.monotonic()
            for i, proc in enumerate(self.procs):
                if not proc.is_alive():
                    self._fail(StageError(f"stage {i} (pid {proc.pid}) died with exit code {proc.exitcode}"))
                    break
                if now - self.last_seen[i] > max(DEAD_AFTER_S, 3 * HEARTBEAT_S):
                    self._fail(StageError(f"stage {i} (pid {proc.pid}) stopped answering"))
                    break
            await asyncio.sleep(MONITOR_S)

    def _fail(self, error: StageError) -> None:
        if self.failed is None:
            self.failed = error
            self.on_failure(error)

    def kill_now(self) -> None:
        """Last resort when the interpreter exits without close(): no orphans, no socket files."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        self.addresses.cleanup()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Ask every stage to stop, wait briefly, then kill what is left; remove socket files."""
        for task in self._tasks:
            task.cancel()
        if self.failed is not None:
            timeout_s = 0.0  # survivors may be blocked on the dead stage's activations: kill them
        for sock in self.plan_socks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sock.send(Shutdown()), 0.2)
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
