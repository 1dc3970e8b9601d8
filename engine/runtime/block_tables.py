"""Each request's KV block table, as a stage keeps it between plans.

A StepPlan carries only what changed (see SeqChunk in transport/messages.py): the blocks each
chunk's request gained since its previous chunk (a whole new table where `new_table` says so),
which requests are over (`released`) or were preempted (`preempted`), and which tables shrink
(`truncated`: blocks taken for drafts that were rejected, given back). A stage applies a plan
here, in plan order, right before running it; the tables then hold exactly what the scheduler's
requests held when it built the plan. A stage that loses its state (a `Reset`, or a fresh
process) starts with no tables, and the scheduler, told by `reset_pipeline`, sends every
request's whole table again.

Tables are rows of one int64 tensor on the CPU, so that a micro-batch's tables are one
index_select, never a Python list per request or per block: per-step work grows with the batch
(and a memory copy of its tables), not with the Python objects of every request's context.

A model with sliding-window layers has a second set of tables, over their own blocks
(`windowed`: read from each chunk's `window_blocks`). There the scheduler frees the blocks that
slide out without telling the stages: their entries keep stale ids (or 0, where a whole table
came with -1 in them), which attention never reads (AttentionMetadata.with_window).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ppserve.transport.messages import StepPlan


class UnknownRequestError(RuntimeError):
    """A chunk names a request this stage holds no table for: a plan was lost or reordered."""


class BlockTables:
    def __init__(self, rows: int = 64, width: int = 64, windowed: bool = False) -> None:
        self.windowed = windowed
        # table: [rows, width] long; row r holds its request's blocks in [0, length[r]), zeros after
        # (a valid block id, like the padding the attention expects).
        self._table = torch.zeros((rows, width), dtype=torch.long)
        self._length: list[int] = [0] * rows
        self._row: dict[str, int] = {}
        self._free_rows: list[int] = list(range(rows - 1, -1, -1))  # pop() hands out low rows first

    def __len__(self) -> int:
        return len(self._row)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._row

    def table(self, request_id: str) -> list[int]:
        """One request's blocks (tests and error messages; the hot path never builds lists)."""
        row = self._row[request_id]
        return self._table[row, : self._length[row]].tolist()

    def apply(self, plan: StepPlan) -> None:
        """A plan's changes, before it runs: tables of requests that are over or preempted go
        first, then each chunk's blocks, starting a table afresh where the chunk says so (so a
        table left under a reused id, or one this stage never heard was dropped, is replaced)."""
        for rid in plan.released:
            self.drop(rid)
        for rid in plan.preempted:
            self.drop(rid)
        for rid, keep in plan.truncated:
            self.truncate(rid, keep)
        for chunk in plan.chunks:
            if chunk.new_table:
                self.drop(chunk.request_id)
            blocks = chunk.window_blocks if self.windowed else chunk.blocks
            self.append(chunk.request_id, blocks, create=chunk.new_table)

    def append(self, request_id: str, blocks: Sequence[int], create: bool = True) -> None:
        """Add blocks to a request's table; a request without one gets one if `create`, else
        this is an error (a plan that starts no table may only extend one)."""
        row = self._row.get(request_id)
        if row is None:
            if not create:
                raise UnknownRequestError(f"no block table for request {request_id!r}: a plan was lost or reordered")
            row = self._new_row()
            self._row[request_id] = row
        if not blocks:
            return  # a step within the request's last block: the common decode case
        start = self._length[row]
        end = start + len(blocks)
        if end > self._table.shape[1]:
            self._grow(width=max(end, 2 * self._table.shape[1]))
        self._table[row, start:end] = torch.tensor(blocks, dtype=torch.long).clamp_(min=0)  # -1: slid out
        self._length[row] = end

    def truncate(self, request_id: str, blocks: int) -> None:
        """Keep a request's first `blocks` entries (the rest held rejected drafts' KV)."""
        row = self._row.get(request_id)
        if row is not None and blocks < self._length[row]:
            self._table[row, blocks : self._length[row]] = 0
            self._length[row] = blocks

    def drop(self, request_id: str) -> None:
        """Forget a request's table (unknown ids are ignored: a request preempted, then released)."""
        row = self._row.pop(request_id, None)
        if row is None:
            return
        self._table[row, : self._length[row]] = 0  # the next owner's padding stays block 0
        self._length[row] = 0
        self._free_rows.append(row)

    def clear(self) -> None:
        """Forget every table (the pipeline was reset: every plan so far is void)."""
        for rid in list(self._row):
            self.drop(rid)

    def lookup(self, request_ids: Sequence[str]) -> tuple[torch.Tensor, list[int]]:
        """The tables of a micro-batch's requests, in order: ([batch, width] long on the CPU, zero
        padded, width the longest of them), and each one's length."""
        try:
            rows = [self._row[rid] for rid in request_ids]
        except KeyError as e:
            missing = e.args[0]
            raise UnknownRequestError(f"no block table for request {missing!r}: a plan was lost or reordered") from None
        lengths = [self._length[r] for r in rows]
        width = max(lengths, default=0) or 1
        index = torch.tensor(rows, dtype=torch.long)
        return self._table[:, :width].index_select(0, index), lengths

    def _new_row(self) -> int:
        if not self._free_rows:
            rows = self._table.shape[0]
            self._grow(rows=2 * rows)
        return self._free_rows.pop()

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        """Double the tensor's rows or widen it; amortized, so appends stay O(new blocks)."""
        old_rows, old_width = self._table.shape
        new_rows, new_width = rows or old_rows, width or old_width
        table = torch.zeros((new_rows, new_width), dtype=torch.long)
        table[:old_rows, :old_width] = self._table
        self._table = table
        if new_rows > old_rows:
            self._length += [0] * (new_rows - old_rows)
            self._free_rows = list(range(new_rows - 1, old_rows - 1, -1)) + self._free_rows
