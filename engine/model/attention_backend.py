"""How a stage computes attention over its paged KV cache: one interface, one file per backend
(attention_sdpa.py: torch's SDPA, any device; attention_cpu.py: ppserve's CPU kernels), chosen
once when the stage starts (attention_choice.py). A backend does three things: rotate queries and
keys and write the keys and values into the cache, attend the decode rows, attend prefill chunks.
`forward` walks a batch (engine/model/attention.py's metadata) and calls them; nothing in the
forward pass asks what the machine has.

Prefill chunks gather their request's keys/values from its blocks; a fresh prompt's are this
step's own, read where they were computed, and consecutive fresh prompts of one length go as one
call (each row's result is bitwise that of a call of its own on gathered keys).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ppserve.engine.model.attention import AttentionMetadata, PrefillGroup


class AttentionBackend(ABC):
    name: str
    # Whether fresh prompts on a sliding-window layer may go as one batch (the backend masks the
    # window itself); else only plain causal ones do.
    batches_windowed: bool = False

    @abstractmethod
    def rope_and_write(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k rotated (RoPE; `sin` signed as rope.apply_rope takes it), and k, v written into the
        cache `kv` ([2, num_blocks, block_size, kv_heads, head_dim]) at md.slot_mapping."""

    @abstractmethod
    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata, scale: float,
        window: int | None,
    ) -> torch.Tensor:  # fmt: skip
        """The decode rows' attention: q [num_decodes, heads, head_dim], one query per request of
        md.decode, over its cached keys."""

    @abstractmethod
    def prefill(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: int, scale: float,
        window: int | None, mask: torch.Tensor | None, out: torch.Tensor,
    ) -> None:  # fmt: skip
        """Causal attention of `batch` chunks of equal length into `out`: q [batch * nq, heads,
        head_dim] over keys/values [batch * nk, kv_heads, head_dim], query i of a chunk at
        position nk - nq + i. `mask`: md's mask for a single chunk on `window` (None: plain causal)."""

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        window: int | None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim].

        The current step's keys/values must already be in the cache (see `rope_and_write`). `k`,
        `v`: the same, [num_tokens, kv_heads, head_dim], where the caller has them: a fresh
        prompt's keys are all this step's, so they are read there rather than gathered."""
        d = md.decode
        if d is not None and not md.prefills and d.rows == slice(0, q.shape[0]):  # a decode step
            return self.decode(q, k_cache, v_cache, md, scale, window)
        out = torch.empty_like(q)
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        groups, i = md.prefills, 0
        while i < len(groups):
            group = groups[i]
            i += 1
            if k is not None and v is not None and self._batches(group, window):
                # Fresh prompts of the same length that follow each other in the batch: one call.
                n, end = group.context_len, group.rows.stop
                while i < len(groups) and self._batches(groups[i], window) and groups[i].context_len == n:
                    if groups[i].rows.start != end:
                        break  # decode rows in between
                    end, i = groups[i].rows.stop, i + 1
                rows = slice(group.rows.start, end)
                self.prefill(q[rows], k[rows], v[rows], (end - group.rows.start) // n, scale, window, None, out[rows])
                continue
            # keys: [context_len, kv_heads, head_dim]
            keys = md.buffers.gather(0, k_cache, group.block_ids).view(-1, kv_heads, head_dim)[: group.context_len]
            values = md.buffers.gather(1, v_cache, group.block_ids).view(-1, kv_heads, head_dim)[: group.context_len]
            self.prefill(q[group.rows], keys, values, 1, scale, window, group.masks[window], out[group.rows])
        if d is not None:
            out[d.rows] = self.decode(q[d.rows], k_cache, v_cache, md, scale, window)
        return out

    def _batches(self, group: PrefillGroup, window: int | None) -> bool:
        """Whether `group` is a whole prompt whose keys are this step's (in k), to batch with its
        neighbours of the same length."""
        fresh = group.context_len == group.rows.stop - group.rows.start
        return fresh and (self.batches_windowed or group.masks[window] is None)
