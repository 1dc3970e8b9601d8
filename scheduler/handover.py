"""The scheduler's side of prefill/decode disaggregation (engine/disagg/rooms.py has the picture).

One small object answers the scheduler's three questions about a request whose KV moves between
servers: which requests wait for their KV (`receiving`: a decode server reserved their blocks and
the KV is on its way), which hold their KV for export (`held`: a prefill server finished them and
the KV is still being sent), and when they may run (`activate`: the KV and the first token are
in). The scheduler asks it when it frees, aborts or fails requests; the engine's rooms call the
rest. Pure: no sockets, no clocks.
"""

from __future__ import annotations

from collections.abc import Callable

from ppserve.scheduler.kv_groups import KvGroups
from ppserve.scheduler.request import Request


class KvHandover:
    """`requests` and `running` are the scheduler's own (shared, never rebound); `free` frees a
    request's blocks there."""

    def __init__(
        self, kv: KvGroups, requests: dict[str, Request], running: list[Request], free: Callable[[Request], None]
    ) -> None:
        self.kv = kv
        self.requests = requests
        self.running = running
        self.free = free
        self.held: dict[str, Request] = {}
        self.receiving: dict[str, Request] = {}

    # ---- asked by the scheduler ---------------------------------------------------------

    def keeps(self, r: Request) -> bool:
        """Whether r's blocks must stay although it finished: its KV is still to be sent (it is
        held until `release`)."""
        if r.hold_kv:
            self.held[r.request_id] = r
        return r.hold_kv

    def forget(self, r: Request) -> bool:
        """r is aborted: True if it was waiting for its KV (its blocks are then freed here:
        nothing reads or writes them); a held prefill has nothing to send any more."""
        r.hold_kv = False
        if self.receiving.pop(r.request_id, None) is None:
            return False
        self.free(r)
        return True

    def fail_all(self) -> list[Request]:
        """A stage died: held KV is freed, and the requests waiting for KV are returned (they end)."""
        waiting = list(self.receiving.values())
        self.receiving.clear()
        held, self.held = list(self.held.values()), {}
        for r in [*held, *waiting]:
            r.hold_kv = False
        for r in held:
            self.free(r)
        return waiting

    # ---- called by the rooms ------------------------------------------------------------

    def held_blocks(self, request_id: str) -> list[int] | None:
        """Prefill side: the blocks of a held request, to export (None if it is not held)."""
        r = self.held.get(request_id)
        return None if r is None else list(r.block_table)

    def release(self, request_id: str) -> bool:
        """Prefill side: the KV of a held request has been sent (or its transfer failed); its
        blocks are free now. False if there is no such request."""
        r = self.held.pop(request_id, None)
        if r is None:
            return False
        r.hold_kv = False
        self.free(r)
        return True

    def reserve(self, request: Request) -> list[int] | None:
        """Decode side: blocks for a request whose prompt is prefilled elsewhere; the prefill
        side writes its KV into them. None if the cache cannot hold the prompt now (nothing is
        preempted for it: the KV may never come). `activate` or an abort ends the reservation."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if self.kv.window is not None:  # engine/config.py refuses such a pair at start
            raise ValueError("the KV of sliding-window layers is not transferred between servers")
        need = self.kv.full.blocks_for(len(request.prompt_token_ids))
        if need > self.kv.full.num_free:
            return None
        self.kv.full.grow(request.block_table, len(request.prompt_token_ids))
        self.requests[request.request_id] = request
        self.receiving[request.request_id] = request
        return list(request.block_table)

    def activate(self, request_id: str, first_token: int) -> Request | None:
        """Decode side: the KV is in and the prefill side sampled `first_token`: the request
        decodes from here as if it had been prefilled here (None if it was aborted meanwhile).
        It may already be finished (EOS, or max_tokens of 1)."""
        r = self.receiving.pop(request_id, None)
        if r is None:
            return None
        r.num_computed_tokens = r.num_scheduled_tokens = len(r.prompt_token_ids)
        if r.append_token(first_token) is not None:
            self.free(r)
        else:
            self.running.append(r)
        return r
