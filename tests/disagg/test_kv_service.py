"""Stages' KV senders and receivers over real sockets: a prefill pipeline cut 1,1,2 hands its
KV to a decode pipeline cut 3,1, which decodes on exactly; faults end rooms with reasons."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers import pipeline

from ppserve.engine.disagg.faults import DisaggFaults
from ppserve.engine.disagg.kv_blocks import layer_slices
from ppserve.engine.disagg.kv_service import KvExporter, KvImporter
from ppserve.engine.offline import OfflineEngine
from ppserve.scheduler.bootstrap import handshake_order
from ppserve.scheduler.request import Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.transport.control import context
from ppserve.transport.kv_transfer import KvChunk, open_sender
from ppserve.transport.messages import KvStatus, KvTarget

PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPT = [(i * 31 + 7) % 500 for i in range(70)]  # five blocks of 16, the last partial


async def run_here(fn: Callable[[], Any]) -> Any:
    return fn()


class Pair:
    """Prefill and decode pipelines with a KV service on every stage, as two servers would have."""

    def __init__(self, llama_dir: Path, faults: DisaggFaults | None = None) -> None:
        self.src = pipeline(llama_dir, 3, layer_partition="1,1,2")
        self.dst = pipeline(llama_dir, 2, layer_partition="3,1")
        self.dst.allocator.allocate(2)  # other block ids than the prefill side's
        self.ctx = context()
        self.statuses: list[KvStatus] = []
        self.slices = layer_slices(self.src.config.layer_ranges, self.dst.config.layer_ranges)

        async def report(status: KvStatus) -> None:
            self.statuses.append(status)

        def cache(p: OfflineEngine, i: int) -> Callable[[], Any]:
            return lambda: p.executor.runners[i].kv_cache

        self.importers = [
            KvImporter(self.ctx, i, r, cache(self.dst, i), run_here, report, "tcp://127.0.0.1:*")
            for i, r in enumerate(self.dst.config.layer_ranges)
        ]
        self.exporters = [
            KvExporter(
                self.ctx,
                i,
                r,
                cache(self.src, i),
                run_here,
                report,
                faults=faults.for_stage("prefill", i) if faults else None,
            )
            for i, r in enumerate(self.src.config.layer_ranges)
        ]
        self.serving = [asyncio.create_task(imp.serve()) for imp in self.importers]

    def targets(self, stage: int) -> list[KvTarget]:
        return [
            KvTarget(s.dst, self.importers[s.dst].address, s.layers.start, s.layers.stop)
            for s in self.slices
            if s.src == stage
        ]

    async def wait_for(self, count: int, state: str) -> list[KvStatus]:
        for _ in range(200):
            found = [s for s in self.statuses if s.state == state]
            if len(found) >= count:
                return found
            await asyncio.sleep(0.02)
        raise AssertionError(f"not {count} x {state}: {self.statuses}")

    async def prefill(self) -> tuple[Request, int]:
        """The prompt and its first token on the prefill side, its KV kept for the transfer."""
        p = self.src.request(PROMPT, replace(PARAMS, max_tokens=1))
        p.hold_kv = True
        await self.src.serve([p])
        return p, p.output_token_ids[0]

    async def close(self) -> None:
        for task in self.serving:
            task.cancel()
        await asyncio.gather(*self.serving, return_exceptions=True)
        for e in self.exporters:
            e.close()
        for i in self.importers:
            i.close()
        self.ctx.term()


async def test_prefill_stages_hand_their_kv_to_differently_cut_decode_stages(llama_dir: Path) -> None:
    expected = pipeline(llama_dir).generate([PROMPT], PARAMS)[0].token_ids
    pair = Pair(llama_dir)
    try:
        p, first = await pair.prefill()
        d = pair.dst.request(PROMPT, PARAMS, "room-1")
        blocks = pair.dst.scheduler.handover.reserve(d)
        assert blocks is not None
        for importer in pair.importers:
            importer.expect("room-1", blocks)
        for stage in handshake_order(3):
            await pair.exporters[stage].bootstrap("room-1", pair.targets(stage))
        assert [s.stage for s in await pair.wait_for(3, "WaitingForInput")] == [2, 1, 0]
        for exporter in pair.exporters:
            await exporter.export("room-1", p.block_table)
        assert {s.stage for s in await pair.wait_for(3, "Success")} == {0, 1, 2}
        assert {s.stage for s in await pair.wait_for(2, "Received")} == {0, 1}
        assert pair.src.scheduler.handover.release(p.request_id)
        pair.dst.scheduler.handover.activate(d.request_id, first)
        await pair.dst.serve([d])
        assert d.output_token_ids == expected
    finally:
        await pair.close()


async def test_faults_and_strays_end_rooms_with_reasons(llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ppserve.kv")
    pair = Pair(llama_dir, DisaggFaults(drop_handshake=0.0, fail_transfer=1.0, seed=1))
    try:
        p, _ = await pair.prefill()
        blocks = pair.dst.allocator.allocate(5)
        pair.importers[0].expect("room", blocks)
        await pair.exporters[1].bootstrap("room", pair.targets(1))
        await pair.exporters[1].export("room", p.block_table)
        [failed] = await pair.wait_for(1, "Failed")
        assert failed.stage == 1 and "the transfer failed (injected)" in failed.error
        await pair.exporters[0].export("never-bootstrapped", p.block_table)
        assert "no handshake for this room" in (await pair.wait_for(2, "Failed"))[1].error
        # A chunk for a room nobody announced is dropped and logged, never written.
        stray = open_sender("zmq", pair.ctx, pair.importers[0].address)
        before = pair.dst.executor.runners[0].kv_cache.clone()
        data = pair.dst.executor.runners[0].kv_cache[0:1, :, 0:1].clone() + 1
        await stray.send(KvChunk("other", 0, 0, 1, 0, 1, 1, "float32", tuple(data.shape)), data)
        for _ in range(100):
            if any("dropped a KV chunk of room other" in r.message for r in caplog.records):
                break
            await asyncio.sleep(0.02)
        assert any("not expected here" in r.message for r in caplog.records)
        assert pair.dst.executor.runners[0].kv_cache.equal(before)
        stray.close()
    finally:
        await pair.close()


async def test_a_dropped_handshake_reports_nothing(llama_dir: Path) -> None:
    pair = Pair(llama_dir, DisaggFaults(drop_handshake=1.0, seed=2))
    try:
        await pair.exporters[2].bootstrap("room", pair.targets(2))  # a report would be made before it returns
        assert pair.statuses == []  # the host's bootstrap timeout is what ends such a room
        pair.exporters[2].abort("room")
    finally:
        await pair.close()


async def test_an_abort_stops_a_transfer_in_progress(llama_dir: Path) -> None:
    pair = Pair(llama_dir, DisaggFaults(jitter_ms=(200.0, 200.0), seed=3))  # every chunk waits 200 ms
    try:
        p, _ = await pair.prefill()
        await pair.exporters[2].bootstrap("room", pair.targets(2))  # two targets: two chunks at least
        export = asyncio.create_task(pair.exporters[2].export("room", p.block_table))
        await pair.wait_for(1, "Transferring")
        pair.exporters[2].abort("room")  # while the first chunk waits
        await export
        [failed] = await pair.wait_for(1, "Failed")
        assert failed.stage == 2 and "aborted by the host" in failed.error
        assert not pair.exporters[2].aborted and not pair.exporters[2].exporting
    finally:
        await pair.close()
