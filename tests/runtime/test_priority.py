"""Stages' compute threads run below their event loops (engine/runtime/priority.py)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from ppserve.engine import environment
from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.config import EngineConfig
from ppserve.engine.model.model_config import ConfigError
from ppserve.engine.runtime.priority import lower_this_thread
from ppserve.scheduler.sampling_params import SamplingParams

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")


def nice_of(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


@linux_only
def test_a_thread_lowers_itself_and_the_threads_it_starts() -> None:
    before = nice_of(threading.get_native_id())
    seen: dict[str, object] = {}

    def child() -> None:
        seen["child"] = nice_of(threading.get_native_id())

    def worker() -> None:
        me = threading.get_native_id()
        seen["lowered"] = lower_this_thread(before + 5)
        seen["raised"] = lower_this_thread(before + 2)  # never back up
        seen["worker"] = nice_of(me)
        t = threading.Thread(target=child)
        t.start()
        t.join()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"lowered": True, "raised": False, "worker": before + 5, "child": before + 5}
    assert nice_of(threading.get_native_id()) == before  # the caller's other threads keep theirs
    assert not lower_this_thread(0)


def test_the_nice_value_is_checked(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (-1, 20):
        with pytest.raises(ConfigError, match=r"compute_nice .*must be in \[0, 19\]"):
            EngineConfig.create(llama_dir, compute_nice=bad)
    monkeypatch.setenv(environment.COMPUTE_NICE_ENV, "2.5")
    with pytest.raises(ConfigError, match="whole number"):
        EngineConfig.create(llama_dir)


def stage_threads(pid: int) -> dict[int, int]:
    """Thread id -> nice value, for every thread of process `pid`."""
    return {int(tid): nice_of(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@linux_only
@pytest.mark.slow
async def test_a_stage_computes_below_its_event_loop(llama_dir: Path) -> None:
    """The compute thread and its OpenMP team (two threads here) at the configured nice value; the
    stage's event loop, which sends each token on, at the process's own."""
    config = EngineConfig.create(llama_dir, pp_size=1, num_kv_blocks=64, threads_per_stage=2, compute_nice=7)
    async with AsyncEngine(config) as engine:
        assert engine._pool is not None
        (pid,) = [p.pid for p in engine._pool.procs if p.pid is not None]
        prompts = [[(7 * i + j) % 500 + 3 for j in range(96)] for i in range(4)]
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        for prompt in prompts:
            async for _ in engine.generate(prompt, params):
                pass
        threads = stage_threads(pid)
    own = nice_of(threading.get_native_id())  # this thread's, which its processes inherit
    assert threads[pid] == own  # the stage's event loop
    lowered = [tid for tid, nice in threads.items() if nice == 7]
    assert len(lowered) >= 2, threads  # the compute thread and the OpenMP thread it started
    assert set(threads.values()) == {own, 7}
