"""Progress of the slow steps of a first start (preparing a GGUF, converting its tensors): a bar
on a terminal, a line per step where stderr is a log, so that no start sits silent for a minute."""

from __future__ import annotations

import sys
import threading
import time

from tqdm import tqdm


class Progress:
    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.done = what, total, 0
        self.start = time.monotonic()
        self.bar: tqdm | None = None
        if sys.stderr.isatty():
            # tqdm's default lock is a multiprocessing semaphore, which a stage process would leak.
            tqdm.set_lock(threading.RLock())
            self.bar = tqdm(total=total, desc=f"ppserve: {what}", file=sys.stderr, leave=True)

    def step(self, label: str) -> None:
        """One step done; `label` says which."""
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update()
        else:
            print(f"ppserve: {self.what}: {label} ({self.done}/{self.total})", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            print(f"ppserve: {self.what}: done in {time.monotonic() - self.start:.0f} s", file=sys.stderr, flush=True)
