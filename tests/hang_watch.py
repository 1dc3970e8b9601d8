"""A test that hangs fails instead, with every asyncio task's stack in its output.

An async test whose event loop is still running after HANG_S gets each task's stack printed to
stderr and every task cancelled: the test then fails with CancelledError where it waited, and
the suite goes on. (A sync test that hangs is left to faulthandler_timeout, which dumps the
threads.) A timer thread finds the loop in the stuck thread's frames."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

HANG_S = 600.0  # far beyond any test's own time on two loaded cores


def _dump_and_cancel(loop: asyncio.AbstractEventLoop, name: str) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    print(f"\n{name}: still running after {HANG_S:.0f} s; {len(tasks)} task(s):", file=sys.stderr)
    for task in tasks:
        task.print_stack(file=sys.stderr)
    for task in tasks:
        task.cancel()


@contextmanager
def hang_watch(name: str) -> Iterator[None]:
    main = threading.current_thread()

    def rescue() -> None:
        # The loop the test's thread is stuck in: `self` of its run_forever / _run_once frame.
        frame = sys._current_frames().get(main.ident or 0)
        while frame is not None:
            loop = frame.f_locals.get("self")
            if isinstance(loop, asyncio.AbstractEventLoop) and loop.is_running():
                loop.call_soon_threadsafe(_dump_and_cancel, loop, name)
                return
            frame = frame.f_back

    timer = threading.Timer(HANG_S, rescue)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
