"""How many stage restarts the engine may spend: at most `limit` within any `window_s` seconds.

A stage that keeps dying (a broken GPU, a poisoned request that crashes every replacement) must
not keep the engine in a restart loop: past the budget, the engine reports itself dead.
"""

from __future__ import annotations

from collections import deque


class RestartBudget:
    def __init__(self, limit: int, window_s: float) -> None:
        self.limit = limit
        self.window_s = window_s
        self._spent: deque[float] = deque()  # times of the restarts inside the window

    def take(self, now: float) -> bool:
        """Spend one restart at time `now` (monotonic seconds) if the budget allows it."""
        while self._spent and now - self._spent[0] >= self.window_s:
            self._spent.popleft()
        if len(self._spent) >= self.limit:
            return False
        self._spent.append(now)
        return True
