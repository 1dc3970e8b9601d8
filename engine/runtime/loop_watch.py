"""A debug watch on event loops: reports any callback that holds its loop past a bound.

One event loop serves every socket of a process, so a callback that holds it for tens of
milliseconds (a large copy, a device sync, a join) delays every heartbeat, plan and token behind
it. The watch is a debug mode: tests turn it on (tests/conftest.py), and a stage turns it on in
its own process when `EngineConfig.debug_loop_ms` is set (environment: `PPSERVE_DEBUG_LOOP_MS`).

Two checks, both chosen so that a loaded machine cannot trip them:
  - A callback's cost is the CPU time of the loop's thread while it ran, not its wall time. Tests
    share two cores: a harmless callback may wait for a core or for the GIL for longer than the
    bound, and wall time would make tests flaky. CPU time grows only with the callback's own
    work (copies, long Python loops, a device sync that spins); time in the garbage collector,
    which strikes whichever callback happens to allocate, is left out (_GcTime).
  - A wait that costs no CPU (a process join) is caught at the call instead: joining a process
    with a timeout other than 0 from a thread that runs a loop is reported whatever it cost (a
    join with timeout 0 only reaps a process that is already gone).

It times asyncio's own loop, through `asyncio.Handle._run`, where asyncio runs every callback;
uvloop runs its callbacks in C, out of reach, so a watched process uses asyncio's loop.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing.process
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

MARKER = "event loop blocked"  # every report starts with it: tests look for it in a process's output

_run = asyncio.Handle._run
_join = multiprocessing.process.BaseProcess.join
_active: list[tuple[float, Callable[[str], None]]] = []  # (bound in CPU seconds, report); at most one


def install(bound_ms: float, report: Callable[[str], None]) -> None:
    """Watch every asyncio loop of this process until `uninstall`; `report` gets one line per
    finding (it runs on the loop's thread: keep it short)."""
    if _active:
        raise RuntimeError("the event loop watch is installed already")
    _active.append((bound_ms / 1000.0, report))
    asyncio.Handle._run = _timed_run  # type: ignore[method-assign, assignment]
    gc.callbacks.append(_on_gc)
    multiprocessing.process.BaseProcess.join = _checked_join  # type: ignore[method-assign]


def uninstall() -> None:
    if _on_gc in gc.callbacks:
        gc.callbacks.remove(_on_gc)
    asyncio.Handle._run = _run  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.join = _join  # type: ignore[method-assign]
    _active.clear()


@contextmanager
def watching(bound_ms: float, report: Callable[[str], None]) -> Iterator[None]:
    install(bound_ms, report)
    try:
        yield
    finally:
        uninstall()


class _GcTime(threading.local):
    """CPU time this thread spent collecting garbage. A full collection can take a few hundred
    ms in a process that holds torch: it lands on whichever callback happened to allocate, is
    no blocking call of ours, and would make the watch report at random; so it is left out."""

    spent = 0.0
    start = 0.0


_gc = _GcTime()


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc.start = time.thread_time()
    else:
        _gc.spent += time.thread_time() - _gc.start


def _timed_run(handle: asyncio.Handle) -> None:
    start, gc_before = time.thread_time(), _gc.spent
    try:
        _run(handle)
    finally:
        in_gc = _gc.spent - gc_before
        spent = time.thread_time() - start - in_gc
        if _active and spent > _active[0][0]:
            bound, report = _active[0]
            report(
                f"{MARKER}: {_describe(handle)} took {spent * 1000:.1f} ms of CPU "
                f"(bound {bound * 1000:g} ms; garbage collection, not counted: {in_gc * 1000:.1f} ms)"
            )


def _describe(handle: asyncio.Handle) -> str:
    """A task's step names the task's coroutine and where it waits now (just after the slow
    part); other callbacks are named by asyncio's own repr."""
    task = getattr(getattr(handle, "_callback", None), "__self__", None)
    if not isinstance(task, asyncio.Task):
        return repr(handle)
    frames = task.get_stack(limit=1)
    where = f" (now at {frames[0].f_code.co_filename}:{frames[0].f_lineno})" if frames else ""
    return f"a step of {task.get_coro()!r}{where}"


def _checked_join(self: multiprocessing.process.BaseProcess, timeout: float | None = None) -> Any:
    if _active and timeout != 0 and asyncio._get_running_loop() is not None:
        _active[0][1](f"{MARKER}: {self!r}.join(timeout={timeout}) on the event loop's thread")
    return _join(self, timeout)
