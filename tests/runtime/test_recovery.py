"""A pipeline that heals: failed stages are replaced while their requests carry on exactly, and
host tasks that fail are never silent."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import pytest
from helpers import PROMPTS, alive, collect, engine_config, wait_until

from ppserve.engine.async_engine import AsyncEngine, EngineDeadError
from ppserve.engine.runtime.stage_pool import StageError
from ppserve.scheduler.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("watch_loops")]  # event loops checked (conftest.py)

LONG_GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
# Seeded sampling with penalties: the replaced last stage must rebuild both from the tokens.
LONG_SEEDED = SamplingParams(
    max_tokens=48, temperature=0.9, top_k=40, seed=11, presence_penalty=0.5, frequency_penalty=0.3, ignore_eos=True
)
CASES = [(p, LONG_GREEDY) for p in PROMPTS[4:10]] + [(p, LONG_SEEDED) for p in PROMPTS[10:13]]


async def _run_all(engine: AsyncEngine) -> list[list[int]]:
    return await asyncio.gather(*[collect(engine, p, params) for p, params in CASES])


@pytest.fixture(scope="module")
def fault_free(llama_dir: Path) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with AsyncEngine(engine_config(llama_dir, 3)) as engine:
            return await _run_all(engine)

    return asyncio.run(run())


@pytest.mark.parametrize("victim", [0, 1, 2])
async def test_killed_stage_is_replaced_and_requests_carry_on(
    llama_dir: Path, fault_free: list[list[int]], victim: int
) -> None:
    async with AsyncEngine(engine_config(llama_dir, 3)) as engine:
        assert engine._pool is not None
        old = engine._pool.procs[victim].pid
        assert old is not None
        tasks = asyncio.gather(*[collect(engine, p, params) for p, params in CASES])
        # Kill it mid-decode: every request has some output that must survive the fault.
        await wait_until(lambda: all(r.output_token_ids for r in engine.scheduler.running), timeout_s=60)
        os.kill(old, signal.SIGKILL)
        await wait_until(lambda: engine.recovering)
        results = await asyncio.wait_for(tasks, timeout=120)  # a guard against a hang, not a speed check
        assert results == fault_free  # greedy and seeded-with-penalties tokens, exactly
        assert engine.stage_restarts == [int(i == victim) for i in range(3)]
        assert engine.healthy and not engine.recovering
        stats = engine.stats()
        assert stats.preemptions >= 1 and stats.kv_blocks_used == 0
        new = engine._pool.procs[victim].pid
        assert new != old and new is not None and alive(new) and not alive(old)
        # And the repaired pipeline serves new requests as before.
        assert await collect(engine, CASES[0][0], LONG_GREEDY) == fault_free[0]


async def test_hung_stage_is_killed_and_replaced(llama_dir: Path, fault_free: list[list[int]]) -> None:
    async with AsyncEngine(engine_config(llama_dir, 3, stage_timeout_s=1.5)) as engine:
        assert engine._pool is not None
        hung = engine._pool.procs[1].pid
        assert hung is not None
        tasks = asyncio.gather(*[collect(engine, p, params) for p, params in CASES])
        await wait_until(lambda: all(r.output_token_ids for r in engine.scheduler.running), timeout_s=60)
        os.kill(hung, signal.SIGSTOP)
        results = await asyncio.wait_for(tasks, timeout=120)
        assert results == fault_free
        assert engine.stage_restarts == [0, 1, 0]
        await wait_until(lambda: not alive(hung))


async def test_restart_budget_is_bounded(llama_dir: Path) -> None:
    """With one restart allowed, the first failure heals and the second kills the engine."""
    async with AsyncEngine(engine_config(llama_dir, 2, max_stage_restarts=1)) as engine:
        assert engine._pool is not None
        os.kill(engine._pool.procs[0].pid or 0, signal.SIGKILL)
        await wait_until(lambda: engine.stage_restarts == [1, 0], timeout_s=60)
        await wait_until(lambda: not engine.recovering, timeout_s=60)
        assert await collect(engine, PROMPTS[5], LONG_GREEDY)
        os.kill(engine._pool.procs[1].pid or 0, signal.SIGKILL)
        await wait_until(lambda: not engine.healthy)
        with pytest.raises(EngineDeadError, match="stage 1"):
            await collect(engine, PROMPTS[5], LONG_GREEDY)


async def test_a_failed_host_task_is_logged_and_kills_the_engine(
    llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in a host task (here: the scheduler raising inside the driver) must not leave a
    silent hang: requests fail, the engine says it is dead, the traceback is logged."""
    async with AsyncEngine(engine_config(llama_dir, 2)) as engine:
        assert await collect(engine, PROMPTS[3], LONG_GREEDY)

        def broken() -> None:
            raise OverflowError("int too big to convert")

        engine.scheduler.schedule = broken  # type: ignore[method-assign]
        dead = pytest.raises(EngineDeadError, match=r"engine core.*OverflowError")
        with caplog.at_level(logging.ERROR, logger="ppserve.engine"), dead:
            await asyncio.wait_for(collect(engine, PROMPTS[3], LONG_GREEDY), timeout=10)
        assert not engine.healthy
        assert any(r.exc_info and "engine core" in r.getMessage() for r in caplog.records)
        assert engine.stats().kv_blocks_used == 0


async def test_a_stage_killed_during_start_up_fails_the_start_at_once(llama_dir: Path) -> None:
    engine = AsyncEngine(engine_config(llama_dir, 2))
    start = asyncio.ensure_future(engine.start())
    await wait_until(lambda: engine._pool is not None and len(engine._pool.procs) == 2)
    assert engine._pool is not None
    os.kill(engine._pool.procs[1].pid or 0, signal.SIGKILL)  # while it is still loading
    with pytest.raises(StageError, match=r"stage 1 .*exited during start-up"):
        await asyncio.wait_for(start, timeout=30)  # a guard against a hang


async def test_the_start_up_timeout_holds_while_stages_send_heartbeats(llama_dir: Path) -> None:
    """Stages send heartbeats while they load; those must not keep the start-up waiting forever."""
    engine = AsyncEngine(engine_config(llama_dir, 2, stage_start_timeout_s=0.5))
    with pytest.raises(StageError, match=r"not ready after"):
        await asyncio.wait_for(engine.start(), timeout=30)


@pytest.mark.parametrize("transport", ["zmq", "gloo"])
async def test_recovery_on_other_tensor_channels(llama_dir: Path, fault_free: list[list[int]], transport: str) -> None:
    """zmq frames: leftovers of voided micro-batches are skipped by id. gloo: a process group
    cannot take a new member, so every stage is replaced together."""
    async with AsyncEngine(engine_config(llama_dir, 3, transport)) as engine:
        assert engine._pool is not None
        tasks = asyncio.gather(*[collect(engine, p, params) for p, params in CASES])
        await wait_until(lambda: all(r.output_token_ids for r in engine.scheduler.running), timeout_s=60)
        os.kill(engine._pool.procs[1].pid or 0, signal.SIGKILL)
        assert await asyncio.wait_for(tasks, timeout=120) == fault_free
        assert engine.stage_restarts == ([0, 1, 0] if transport == "zmq" else [1, 1, 1])


async def test_stages_send_heartbeats_while_they_load(llama_dir: Path) -> None:
    """Liveness (and the stage's own orphan check) runs from the moment a stage starts, not only
    once its model is loaded and profiled: a heartbeat arrives before each stage's StageReady."""
    from ppserve.engine.runtime.stage_pool import StagePool
    from ppserve.transport.messages import ControlMsg, Heartbeat, StageReady

    config = engine_config(llama_dir, 2, dynamic_chunking=True)  # start-up includes a ~1-3 s profile
    pool = StagePool(config, lambda _: None)
    seen: list[ControlMsg] = []
    recv = pool.inbox.recv

    async def recording() -> ControlMsg:
        msg = await recv()
        seen.append(msg)
        return msg

    pool.inbox.recv = recording  # type: ignore[method-assign]
    try:
        await asyncio.wait_for(pool.start(), timeout=120)
    finally:
        await pool.close()
    for stage in range(2):
        kinds = [type(m) for m in seen if getattr(m, "stage", None) == stage]
        assert Heartbeat in kinds and kinds.index(Heartbeat) < kinds.index(StageReady), kinds
