"""Wire messages (msgspec). Everything that crosses a process boundary is defined here."""

from __future__ import annotations

import msgspec


class SeqChunk(msgspec.Struct, frozen=True):
    """One request's part of a micro-batch: `token_ids` are new tokens at positions
    [start, start + len(token_ids)); `block_table` holds the KV blocks for all of them."""

    request_id: str
    token_ids: list[int]
    start: int
    block_table: list[int]
    sample: bool  # sample a token after this chunk (last prefill chunk, or a decode step)

    @property
    def num_new(self) -> int:
        return len(self.token_ids)
