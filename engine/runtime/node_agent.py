"""A node other than node 0: joins the cluster, runs its own stages, and keeps them tied to the host.

    join (engine/cluster/rendezvous.py) -> spawn this node's stages -> until told to stop:
        NodeHeartbeat to the host every 0.2 s; a stage process that ends is reported
        the host silent for HOST_TIMEOUT_S (killed, or the link cut): stop the stages, exit 1
        Shutdown from the host: the stages drain (they got it too); after a grace, kill the rest

The stages talk to the host and to each other directly; the agent only watches. A stage also
exits by itself if the agent dies (its parent is gone), so no process outlives its node's agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from multiprocessing.process import BaseProcess

import msgspec

from ppserve.engine.cluster.fingerprint import checkpoint_fingerprint
from ppserve.engine.cluster.remote_nodes import BEAT_S
from ppserve.engine.cluster.rendezvous import join_cluster
from ppserve.engine.config import EngineConfig
from ppserve.engine.runtime.stage_process import channel_specs
from ppserve.engine.runtime.stage_worker import StageLaunch, spawn_stage
from ppserve.transport.addresses import Addresses, free_ports, tcp_address
from ppserve.transport.cluster_key import CurveKeys, Guard
from ppserve.transport.control import PullSocket, PushSocket, context
from ppserve.transport.messages import HostHeartbeat, NodeHeartbeat, NodeStageExited, Shutdown

log = logging.getLogger("ppserve.cluster")
HOST_TIMEOUT_S = 2.0  # then the stages go: well inside the 5 s a stage may outlive its host
DRAIN_S = 3.0  # after Shutdown, stages that have not exited by themselves are killed


class NodeAgent:
    def __init__(self, config: EngineConfig) -> None:
        assert config.cluster is not None and not config.cluster.is_host
        self.config = config
        self.cluster = config.cluster
        self.node = self.cluster.node_rank
        self.ctx = context()
        keys = CurveKeys.from_secret(self.cluster.key) if self.cluster.key else None
        self.guard = Guard(self.ctx, keys, f"node {self.node}") if keys else None
        addr = self.cluster.node_addr
        self.control = PullSocket(self.ctx, tcp_address(addr, "*"), bind=True, guard=self.guard)
        # The inbound edge of each local stage (but stage 0, which has none) binds here.
        self.local = self.cluster.local_stages
        receivers = [s for s in self.local if s > 0]
        ports = free_ports(len(receivers), addr)
        self.edges = {s: tcp_address(addr, port) for s, port in zip(receivers, ports, strict=True)}
        self.procs: dict[int, BaseProcess] = {}
        self.inbox: PushSocket | None = None

    async def run(self) -> int:
        """0 when node 0 shut the cluster down, 1 when node 0 is gone; RendezvousError when this
        node cannot join."""
        timeout_s = self.config.stage_start_timeout_s
        fingerprint = checkpoint_fingerprint(self.config.model)
        settings = self.config.cluster_settings()
        layout, self.store = await join_cluster(
            self.cluster, fingerprint, settings, self.control.address, self.edges, timeout_s
        )
        addresses = Addresses.from_layout(layout)
        self.inbox = PushSocket(self.ctx, addresses.host_inbox(), bind=False, guard=self.guard)
        specs = channel_specs(self.config, addresses, self.local)
        last = self.config.pp_size - 1
        for stage in self.local:
            launch = StageLaunch(
                config=self.config,
                stage=stage,
                addresses=addresses,
                inbound=specs[stage - 1] if stage > 0 else None,
                outbound=specs[stage] if stage < last else None,
                dist_port=0,
                threads=self.config.threads_per_stage,
                parent_pid=os.getpid(),
                key=self.cluster.key,
            )
            self.procs[stage] = spawn_stage(launch)
        stages = ", ".join(map(str, self.local))
        print(f"ppserve: node {self.node} joined {self.cluster.dist_init_addr}; running stage(s) {stages}", flush=True)
        return await self._watch()

    async def _watch(self) -> int:
        assert self.inbox is not None
        heard = time.monotonic()
        reported: set[int] = set()
        messages = asyncio.ensure_future(self.control.recv())
        try:
            while True:
                self.inbox.send_nowait(NodeHeartbeat(self.node))
                for stage, proc in self.procs.items():
                    if not proc.is_alive() and stage not in reported:
                        reported.add(stage)
                        self.inbox.send_nowait(NodeStageExited(self.node, stage, proc.pid or 0, proc.exitcode))
                await asyncio.wait([messages], timeout=BEAT_S)
                while messages.done():
                    try:
                        msg = messages.result()
                    except msgspec.DecodeError:
                        msg = None  # not ours (possible only with --insecure-cluster): ignored
                    messages = asyncio.ensure_future(self.control.recv())
                    if isinstance(msg, HostHeartbeat):
                        heard = time.monotonic()
                    elif isinstance(msg, Shutdown):
                        await self._stop(DRAIN_S)
                        return 0
                if (silent := time.monotonic() - heard) > HOST_TIMEOUT_S:
                    print(
                        f"ppserve: node {self.node}: node 0 ({self.cluster.dist_init_host}) is unreachable "
                        f"(nothing heard for {silent:.1f} s); stopping stage(s) {', '.join(map(str, self.local))}",
                        flush=True,
                    )
                    await self._stop(drain_s=0.0)
                    return 1
        finally:
            messages.cancel()

    async def _stop(self, drain_s: float) -> None:
        deadline = time.monotonic() + drain_s
        while any(p.is_alive() for p in self.procs.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.kill_stages()

    async def kill_stages(self) -> None:
        """Kill the stages still there and wait for them to go. Awaited, not joined: a join
        would hold the event loop, and with it the heartbeats to the host."""
        self.kill_now()
        deadline = time.monotonic() + 1.0
        while any(p.is_alive() for p in self.procs.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for proc in self.procs.values():
            proc.join(timeout=0)  # reaps

    def kill_now(self) -> None:
        """Without waiting (kill_stages waits): SIGKILL, and reap what is gone already."""
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=0)

    def close(self) -> None:
        self.kill_now()
        self.control.close()
        if self.inbox is not None:
            self.inbox.close()
        if self.guard is not None:
            self.guard.stop()
        self.ctx.term()


async def run_node(config: EngineConfig) -> int:
    """`ppserve serve|generate --node-rank R` for R > 0: this node's part, until the cluster
    stops (0), node 0 is gone (1), or SIGINT/SIGTERM (130; the stages are killed)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    agent = NodeAgent(config)
    work = asyncio.ensure_future(agent.run())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([work, stopped], return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        print(f"ppserve: node {agent.node}: stopped", flush=True)
        return 130
    finally:
        stopped.cancel()
        try:
            with contextlib.suppress(Exception):
                await agent.kill_stages()
        finally:  # even if cancelled while waiting: close() kills without waiting
            with contextlib.suppress(Exception):
                agent.close()
