"""The scheduler's side of prefill/decode disaggregation: a prefill server holds a finished
request's KV until it is sent; a decode server reserves blocks for a prompt prefilled elsewhere and
starts decoding it once its KV and first token are in (engine/disagg/)."""

from __future__ import annotations

from ppserve.scheduler.block_allocator import BlockAllocator
from ppserve.scheduler.kv_groups import KvGroups
from ppserve.scheduler.request import Request


class Handover:
    """Scheduler's disaggregation methods (a base of it: what they use is the scheduler's)."""

    requests: dict[str, Request]
    running: list[Request]
    kv: KvGroups
    allocator: BlockAllocator
    # Prefill side: finished requests whose KV is still being sent. Decode side: requests whose
    # blocks are reserved while their KV arrives.
    held: dict[str, Request]
    receiving: dict[str, Request]

    def _free(self, r: Request) -> None:
        raise NotImplementedError

    def release_held(self, request_id: str) -> bool:
        """Prefill side: the KV of a finished `hold_kv` request has been sent (or its transfer
        failed); its blocks are free now. False if there is no such request."""
        r = self.held.pop(request_id, None)
        if r is None:
            return False
        r.hold_kv = False
        self._free(r)
        return True

    def reserve_prefilled(self, request: Request) -> list[int] | None:
        """Decode side: blocks for a request whose prompt is prefilled elsewhere; the prefill
        side writes its KV into them. None if the cache cannot hold the prompt now (nothing is
        preempted for it: the KV may never come). `activate` or `abort` ends the reservation."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if self.kv.window is not None:  # engine/config.py refuses such a pair at start
            raise ValueError("the KV of sliding-window layers is not transferred between servers")
        need = self.allocator.blocks_for(len(request.prompt_token_ids))
        if need > self.allocator.num_free:
            return None
        self.allocator.grow(request.block_table, len(request.prompt_token_ids))
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
            self._free(r)
        else:
            self.running.append(r)
        return r
