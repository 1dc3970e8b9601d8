"""The real pipeline: stage processes, tensor channels, the central scheduler, AsyncEngine."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from pathlib import Path

import pytest
from helpers import PROMPTS, alive, collect, engine_config, pipeline, random_prompt, wait_until

from ppserve.engine.async_engine import AsyncEngine, EngineDeadError
from ppserve.engine.runtime.stage_pool import StageError
from ppserve.scheduler.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("watch_loops")]  # event loops checked (conftest.py)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)


async def run_batch(engine: AsyncEngine) -> tuple[list[list[int]], list[list[int]]]:
    greedy = [collect(engine, p, GREEDY) for p in PROMPTS]
    seeded = [collect(engine, p, SEEDED) for p in PROMPTS]
    results = await asyncio.gather(*greedy, *seeded)
    return results[: len(PROMPTS)], results[len(PROMPTS) :]


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> list[list[int]]:
    """Greedy tokens from the single-process reference."""
    return [g.token_ids for g in pipeline(llama_dir, chunked_prefill_size=8).generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def seeded_pp1(llama_dir: Path) -> list[list[int]]:
    async def go() -> list[list[int]]:
        async with AsyncEngine(engine_config(llama_dir, 1)) as engine:
            _, seeded = await run_batch(engine)
        return seeded

    return asyncio.run(go())


@pytest.mark.parametrize(("pp", "transport"), [(1, "shm"), (2, "shm"), (2, "gloo"), (2, "zmq"), (3, "shm"), (4, "zmq")])
async def test_outputs_equal_reference(
    llama_dir: Path, reference: list[list[int]], seeded_pp1: list[list[int]], pp: int, transport: str
) -> None:
    async with AsyncEngine(engine_config(llama_dir, pp, transport)) as engine:
        greedy, seeded = await run_batch(engine)
        assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_blocks
    assert greedy == reference
    assert seeded == seeded_pp1


async def test_long_prompt_fills_every_stage(llama_dir: Path) -> None:
    prompt = random_prompt(random.Random(99), 600)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    # A whole generation in this process: in a thread, not on the event loop the test runs on.
    reference = await asyncio.to_thread(lambda: pipeline(llama_dir, num_kv_blocks=512).generate([prompt], params))
    expected = reference[0].token_ids
    async with AsyncEngine(engine_config(llama_dir, 3, chunked_prefill_size=32)) as engine:
        assert await collect(engine, prompt, params) == expected
        # Compute intervals of different micro-batches on different stages overlap in time.
        intervals = [(i.mb_id, i.stage, i.start, i.end) for i in engine.timeline.intervals]
    overlaps = {
        (s1, s2)
        for m1, s1, a1, b1 in intervals
        for m2, s2, a2, b2 in intervals
        if m1 != m2 and s1 != s2 and a1 < b2 and a2 < b1
    }
    assert len({frozenset(p) for p in overlaps}) >= 2, "the pipeline never had two stages busy at once"


async def test_abort_and_many_concurrent_requests(llama_dir: Path) -> None:
    distinct = PROMPTS[::2]
    generated = await asyncio.to_thread(lambda: pipeline(llama_dir).generate(distinct, GREEDY))  # off the loop
    reference = {tuple(p): g.token_ids for p, g in zip(distinct, generated, strict=True)}
    async with AsyncEngine(engine_config(llama_dir, 2, max_running_requests=64)) as engine:
        alloc = engine.scheduler.allocator

        # Closing the iterator mid-stream aborts the request.
        stream = engine.generate(PROMPTS[-1], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        # Cancelling the task that reads the stream aborts it too.
        task = asyncio.create_task(collect(engine, PROMPTS[-2], SamplingParams(max_tokens=200, ignore_eos=True)))
        await wait_until(lambda: alloc.num_free < alloc.num_blocks)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: alloc.num_free == alloc.num_blocks and not engine.scheduler.inflight)

        # 200 concurrent requests, all correct, and every block back afterwards.
        prompts = [distinct[i % len(distinct)] for i in range(200)]
        outs = await asyncio.gather(*[collect(engine, p, GREEDY) for p in prompts])
        assert all(out == reference[tuple(p)] for p, out in zip(prompts, outs, strict=True))
        assert alloc.num_free == alloc.num_blocks

        # A finished request's id can be used again.
        for _ in range(2):
            again = [t async for out in engine.generate(distinct[0], GREEDY, request_id="same") for t in out.token_ids]
            assert again == reference[tuple(distinct[0])]


async def test_killed_stage_fails_requests_fast_without_restarts(llama_dir: Path) -> None:
    """With no stage restarts allowed, a dead stage fails every request at once (as
    EngineDeadError, naming the stage) and later requests too."""
    engine = await AsyncEngine(engine_config(llama_dir, 2, max_stage_restarts=0)).start()
    assert engine._pool is not None
    pids = [p.pid for p in engine._pool.procs if p.pid is not None]
    try:
        params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
        tasks = [asyncio.create_task(collect(engine, p, params)) for p in PROMPTS[:4]]
        await wait_until(lambda: engine.scheduler.running and all(r.output_token_ids for r in engine.scheduler.running))
        os.kill(pids[1], signal.SIGKILL)
        # Failing fast is by design (the monitor polls every 0.1 s); the timeout only guards a hang.
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)
        assert all(isinstance(r, EngineDeadError) and "stage 1" in str(r) for r in results), results
        assert not engine.healthy
        with pytest.raises(EngineDeadError, match="stage 1"):
            await collect(engine, PROMPTS[0], GREEDY)
    finally:
        await asyncio.wait_for(engine.close(), timeout=10)  # close() must not hang on a dead stage
    for pid in pids:
        await wait_until(lambda pid=pid: not alive(pid))


async def test_stalled_stage_is_noticed(llama_dir: Path) -> None:
    """A stage that stops answering (SIGSTOP) for longer than the stage timeout is declared hung
    and killed (here, with no restarts allowed, the requests then fail)."""
    engine = await AsyncEngine(engine_config(llama_dir, 2, max_stage_restarts=0, stage_timeout_s=1.0)).start()
    assert engine._pool is not None
    pid = engine._pool.procs[0].pid
    assert pid is not None
    try:
        params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
        task = asyncio.create_task(collect(engine, PROMPTS[3], params))
        await wait_until(lambda: bool(engine.scheduler.running))
        os.kill(pid, signal.SIGSTOP)
        # The monitor gives up on a silent stage after stage_timeout_s; the timeout only guards a hang.
        with pytest.raises(EngineDeadError, match=r"stage 0 \(pid \d+\) sent nothing for"):
            await asyncio.wait_for(task, timeout=10)
    finally:
        await engine.close()
    await wait_until(lambda: not alive(pid))


async def test_stage_start_failure_reports_the_stage_error(llama_dir: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    ckpt = shutil.copytree(llama_dir, tmp_path / "broken")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(StageError, match=r"stage 1 failed to start: .*missing tensor\(s\): model.layers.3"):
        async with AsyncEngine(engine_config(ckpt, 2)):
            pass


async def test_text_prompts_do_not_stall_the_event_loop(llama_dir: Path) -> None:
    """generate() with text: a text too long for the context is refused from its length alone
    (the tokenizer never sees it), and a long text is tokenized off the event loop's thread."""
    import threading

    async with AsyncEngine(engine_config(llama_dir, 2)) as engine:
        threads: list[int] = []
        encode = engine.tokenizer.encode

        def recording(text: str, add_special_tokens: bool = True) -> list[int]:
            threads.append(threading.get_ident())
            return encode(text, add_special_tokens)

        engine.tokenizer.encode = recording  # type: ignore[method-assign]
        huge = "x" * (engine.config.max_model_len * engine.tokenizer.max_token_chars + 1)
        with pytest.raises(ValueError, match="characters long"):
            await collect(engine, huge, GREEDY)
        assert threads == []
        assert await collect(engine, "a short prompt", GREEDY)
        assert threads == [threading.get_ident()]  # small: inline, cheaper than a thread hop
        assert await engine.tokenizer.encode_async("a longer prompt " * 500, engine.config.max_model_len)
        assert threads[-1] != threading.get_ident()
