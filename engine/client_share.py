"""Each client's share of the queue: the running and waiting requests it holds, at most
`max_requests_per_client` of them, so that no client can fill the queue and starve the others.
A client is whatever the caller names (server/app.py: an API key's tenant, or a connection)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable


class ClientLimitError(RuntimeError):
    """The client holds as many running and waiting requests as it may (`max_requests_per_client`)."""


class ClientShares:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: Counter[Hashable] = Counter()

    def check(self, client: Hashable | None, pending: int = 0) -> None:
        """ClientLimitError if `client` (None: not counted) may not add a request to the `pending`
        ones it is about to add."""
        if client is not None and (held := self._held[client]) + pending >= self.limit:
            raise ClientLimitError(
                f"this client has {held + pending} requests running or waiting, the most one client may "
                f"(max_requests_per_client {self.limit})"
            )

    def take(self, client: Hashable | None) -> None:
        if client is not None:
            self._held[client] += 1

    def give(self, client: Hashable | None) -> None:
        if client is not None:
            self._held[client] -= 1
            if not self._held[client]:
                del self._held[client]
