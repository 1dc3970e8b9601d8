"""A stage's side of disaggregation: its KV sender (prefill side) or receiver (decode side), and
the transfers that run beside its pipeline (kv_service.py has the protocol).

The host's KV messages arrive on the stage's plan socket, in order with its plans; each room's
transfer step runs as a task of its own, so the pipeline never waits for the network.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import zmq.asyncio

from ppserve.engine.config import EngineConfig
from ppserve.engine.disagg.kv_service import KvExporter, KvImporter
from ppserve.transport.addresses import tcp_address
from ppserve.transport.cluster_key import Guard
from ppserve.transport.control import PushSocket
from ppserve.transport.messages import KvBootstrap, KvExpect, KvExport, KvForget, KvStatus

log = logging.getLogger("ppserve.stage")
KvMessage = KvBootstrap | KvExport | KvExpect | KvForget


class StageKv:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        config: EngineConfig,
        stage: int,
        cache: Callable[[], torch.Tensor],
        compute_pool: ThreadPoolExecutor,
        inbox: PushSocket,
        guard: Guard | None,
        node_addr: str,
        watch: Callable[[asyncio.Task[None]], asyncio.Task[None]],
    ) -> None:
        """`cache()` is the stage's KV cache, touched only in `compute_pool` (where the stage
        computes); statuses go to the host on `inbox`; `watch` makes a failure of the receiver's
        server task fail the stage."""
        self.stage = stage
        self.inbox = inbox
        self._tasks: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()

        async def run(fn: Callable[[], Any]) -> Any:
            return await loop.run_in_executor(compute_pool, fn)

        own = config.layer_ranges[stage]
        faults = config.disagg_faults  # parsed once, where the config was made
        mode = config.disaggregation
        dice = faults.for_stage(mode, stage) if faults is not None and faults.active else None
        self.side: KvExporter | KvImporter
        if mode == "prefill":
            timeout_s, report = config.disagg_transfer_timeout_s, self._report
            self.side = KvExporter(ctx, stage, own, cache, run, report, guard, faults=dice, send_timeout_s=timeout_s)
        else:
            address = tcp_address(node_addr or config.disagg_host, "*")
            self.side = KvImporter(ctx, stage, own, cache, run, self._report, address, guard, faults=dice)
            self._tasks.add(watch(asyncio.create_task(self.side.serve())))

    @property
    def address(self) -> str:
        """Where the decode side receives KV ("" on the prefill side): told to the host at start-up."""
        return self.side.address if isinstance(self.side, KvImporter) else ""

    def handle(self, msg: KvMessage) -> None:
        """One of the host's KV messages (those for the other side are ignored)."""
        if isinstance(self.side, KvExporter):
            if isinstance(msg, KvBootstrap):
                self._room(msg.room, self.side.bootstrap(msg.room, msg.targets))
            elif isinstance(msg, KvExport):
                self._room(msg.room, self.side.export(msg.room, msg.blocks))
            elif isinstance(msg, KvForget):
                self.side.abort(msg.room)
        elif isinstance(msg, KvExpect):
            self.side.expect(msg.room, msg.blocks)
        elif isinstance(msg, KvForget):
            self.side.drop(msg.room)
        self._tasks = {t for t in self._tasks if not t.done()}

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.side.close()

    async def _report(self, status: KvStatus) -> None:
        await self.inbox.send(status)

    def _room(self, room: str, work: Coroutine[Any, Any, None]) -> None:
        """Run one room's transfer step beside the pipeline. It reports its own failures; anything
        else it raises fails the room (the host then ends it on both sides), never the stage."""

        async def supervised() -> None:
            try:
                await work
            except Exception as e:
                log.exception("stage %d: room %s failed", self.stage, room)
                await self.inbox.send(KvStatus(room, self.stage, "Failed", f"{type(e).__name__}: {e}"))

        self._tasks.add(asyncio.create_task(supervised()))
