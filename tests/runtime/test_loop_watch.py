"""The event-loop watch (engine/runtime/loop_watch.py): what it reports, and what it leaves alone."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import time

from ppserve.engine.runtime import loop_watch


def _spin(seconds: float) -> None:
    """Use the CPU of this thread for `seconds`."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _watched(coro_fn: object) -> list[str]:
    found: list[str] = []
    with loop_watch.watching(50.0, found.append):
        asyncio.run(coro_fn())  # type: ignore[operator]
    return found


def test_a_callback_that_computes_past_the_bound_is_reported() -> None:
    async def main() -> None:
        _spin(0.08)

    found = _watched(main)
    assert len(found) == 1 and found[0].startswith(loop_watch.MARKER), found


def test_waiting_and_short_callbacks_are_not_reported() -> None:
    """A callback that waits without computing (here: sleeps in the thread, as one preempted on a
    loaded machine would) is not the loop's fault; nor are many short ones."""

    async def main() -> None:
        time.sleep(0.12)  # wall time only
        for _ in range(20):
            _spin(0.002)
            await asyncio.sleep(0)

    assert _watched(main) == []


def test_a_process_joined_on_the_loop_is_reported() -> None:
    async def main() -> None:
        proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
        proc.start()
        while proc.is_alive():
            await asyncio.sleep(0.01)
        proc.join(timeout=0)  # reaps: allowed
        proc.join(timeout=1.0)  # would wait, had it been alive: reported

    found = _watched(main)
    assert len(found) == 1 and "join(timeout=1.0)" in found[0], found


def test_uninstall_restores_asyncio() -> None:
    handle_run = asyncio.Handle._run
    with loop_watch.watching(50.0, lambda line: None):
        assert asyncio.Handle._run is not handle_run
    assert asyncio.Handle._run is handle_run


def test_garbage_collection_is_not_counted() -> None:
    """A full collection lands on whichever callback allocates: not that callback's doing."""
    keep: list[list[int]] = [[] for _ in range(200_000)]  # tracked objects: every collection walks them

    async def main() -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.08:  # past the bound, all of it collecting
            gc.collect()

    assert _watched(main) == []
    del keep
