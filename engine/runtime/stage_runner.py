"""One pipeline stage's compute: its model slice, KV cache and block tables, executing a micro-batch.

This is the process-independent core of a stage: an in-process pipeline calls it in sequence in
one process, and a stage process wraps it with transport. Two entry points share one forward:
`execute_plan` runs a scheduler's StepPlan, whose chunks carry only new blocks (the runner keeps
each request's table between plans), and `execute` runs chunks that carry whole tables
(synthetic chunks of the start-up profile, reference passes in tests).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from ppserve.engine.config import EngineConfig
from ppserve.engine.model import cpu_kernels
from ppserve.engine.model.amx import amx
from ppserve.engine.model.attention import AttentionMetadata, GatherBuffers, padded_tables
from ppserve.engine.model.cache_dir import cache_dir
from ppserve.engine.model.kernel_choice import ROWS, KernelChooser
from ppserve.engine.model.kv_cache import StageKvCache, windowed_layers
from ppserve.engine.model.model import StageModel
from ppserve.engine.model.model_config import ConfigError
from ppserve.engine.model.moe import MoE
from ppserve.engine.model.rope import rope_inv_freq
from ppserve.engine.model.weights import load_stage_weights
from ppserve.engine.runtime.block_tables import BlockTables
from ppserve.transport.messages import SeqChunk, StageKernels, StepPlan

log = logging.getLogger(__name__)


class StageRunner:
    def __init__(self, config: EngineConfig, stage: int) -> None:
        self.config = config
        self.stage = stage
        self.layers = config.layer_ranges[stage]
        self.first = stage == 0
        self.last = stage == config.pp_size - 1
        self.device = torch.device(config.device)
        cpu_kernels.configure(config.cpu_kernels, config.cache_dir)
        mc = config.model_config
        with torch.device("meta"):
            model = StageModel(mc, self.layers, self.first, self.last)
        load_stage_weights(model, config.model, config.torch_dtype, self.device, config.quantization)
        model.inv_freq = rope_inv_freq(mc.rope, mc.head_dim).to(self.device)
        chooser = None
        if config.kernel_choice != "off" and self.device.type == "cpu":
            cache = Path(config.cache_dir or cache_dir())
            chooser = KernelChooser.for_machine(cache, cpu_kernels.library_name(), config.kernel_choice)
        model.fuse(config.torch_dtype, self.device, config.quantization == "int8", chooser)
        self.model = model.eval()
        linears = {} if chooser is None else {shape: list(ks) for shape, ks in chooser.chosen.items()}
        self.kernels = StageKernels(cpu_kernels.isa() or "", amx(), list(ROWS), linears)  # StageReady says it
        if chooser is not None and chooser.chosen:
            log.info("stage %d: %s", stage, chooser.report())
        self.gather_buffers = GatherBuffers()
        self.tables = BlockTables()  # each request's KV blocks, kept between plans
        # A model with sliding-window layers: their blocks' tables (engine/model/kv_cache.py).
        self.window_tables = BlockTables(windowed=True) if config.kv_window is not None else None
        self.tokens_computed = 0  # rows through this stage's layers, since start (metrics, tests)
        # The last stage's pooled rows of the last plan (StepPlan.pooled), in its order: `execute`
        # returns logits alone, and the embeddings of a plan are few.
        self.pooled = torch.empty(0)
        windows = [mc.sliding_windows[i] for i in self.layers]
        flags = windowed_layers(windows, config.kv_window)
        # The windows each group's metadata makes masks for: (the full group's, the windowed group's).
        self.windows = tuple({w for w, f in zip(windows, flags, strict=True) if f == g} for g in (False, True))
        try:
            self.kv = StageKvCache.allocate(
                mc, flags, config.num_kv_blocks, config.num_window_blocks, config.block_size, config.torch_dtype,
                self.device,
            )  # fmt: skip
        except (RuntimeError, MemoryError) as e:
            raise ConfigError(
                f"cannot allocate the KV cache of stage {stage} ({config.num_kv_blocks} blocks) on "
                f"{config.device}: {e}; lower --kv-cache-gb"
            ) from None
        self.kv_cache = self.kv.full  # the full-attention layers' (every layer's, in a model without windows)

    def expert_tokens(self) -> dict[int, list[int]]:
        """Per MoE layer of this stage, tokens routed to each expert since the start (the heartbeat's)."""
        layers = self.model.model.layers.items()
        return {int(i): layer.mlp.tokens.tolist() for i, layer in layers if isinstance(layer.mlp, MoE)}

    def execute_plan(
        self, plan: StepPlan, hidden: torch.Tensor | None = None, prompt_rows: Sequence[int] = ()
    ) -> torch.Tensor:
        """Run a scheduler's plan: apply its block-table changes, then run its chunks with the
        tables this stage keeps. Plans must come in the order they were built (see BlockTables)."""
        self.tables.apply(plan)
        if self.window_tables is not None:
            self.window_tables.apply(plan)
        ends = list(itertools.accumulate(c.num_new for c in plan.chunks))
        pool_rows = [ends[i] - 1 for i in plan.pooled]
        return self.execute(plan.chunks, hidden, prompt_rows=prompt_rows, tables=self.tables, pool_rows=pool_rows)

    def clear_tables(self) -> None:
        """Forget every request's table: the plans so far are void (the pipeline was reset)."""
        self.tables.clear()
        if self.window_tables is not None:
            self.window_tables.clear()

    @torch.inference_mode()
    def execute(
        self,
        chunks: Sequence[SeqChunk],
        hidden: torch.Tensor | None = None,
        all_logits: bool = False,
        prompt_rows: Sequence[int] = (),
        tables: BlockTables | None = None,
        pool_rows: Sequence[int] = (),
    ) -> torch.Tensor:
        """Run one micro-batch through this stage. `tables`: where the chunks' requests' block
        tables are (`execute_plan` passes the kept ones, and the windowed group's are kept beside
        them); None: each chunk's `blocks` is its whole table, in either group.

        First stage: reads `chunks[i].token_ids`; other stages: `hidden` [num_tokens, hidden_size]
        from the previous stage, rows in chunk order. Returns the hidden states for the next stage,
        or, on the last stage, float32 logits [num_sampled + len(prompt_rows), vocab]: the last row
        of each chunk with `sample` (its last 1 + `drafts` rows), in order, then `prompt_rows` (rows
        of the micro-batch, for prompt logprobs); `all_logits`: every row, [num_tokens, vocab]. The
        last stage leaves the pooled `pool_rows` (embeddings) in `self.pooled`.
        """
        device = self.device
        spans = _spans(chunks)
        ids = [c.request_id for c, _, _ in spans]
        if tables is None:
            block_tables, lengths = padded_tables([c.blocks for c, _, _ in spans])
        else:
            block_tables, lengths = tables.lookup(ids)
        starts, num_new, bs = [s for _, s, _ in spans], [n for _, _, n in spans], self.config.block_size
        md = AttentionMetadata.from_tables(
            starts, num_new, block_tables, lengths, bs, device, self.windows[0], self.gather_buffers
        )
        if self.config.kv_window is not None and self.windows[1]:  # this stage has windowed layers
            if tables is not None and self.window_tables is not None:
                window = self.window_tables.lookup(ids)
            else:  # given whole, a chunk's `blocks` is its table in either group
                window = block_tables, lengths
            md = md.with_window(*window, starts, num_new, bs, self.config.kv_window, self.windows[1])
        if self.first:
            inputs = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=device)
        else:
            if hidden is None:
                raise ValueError(f"stage {self.stage} needs hidden states from stage {self.stage - 1}")
            inputs = hidden.to(device)
        h = self.model(inputs, md.positions, self.kv, md)
        self.tokens_computed += h.shape[0]
        if not self.last:
            return h
        self.pooled = torch.empty(0)
        if pool_rows:
            self.pooled = self.model.pool(h[torch.tensor(pool_rows, dtype=torch.long, device=device)])
        if all_logits:
            return self.model.compute_logits(h)
        # Only the last new token of each sampled chunk needs logits (every token of one with drafts).
        rows: list[int] = []
        end = 0
        for c in chunks:
            end += c.num_new
            if c.sample:
                rows += range(end - 1 - c.drafts, end)
        rows += prompt_rows  # only requests that asked for prompt logprobs pay for these
        if rows == list(range(h.shape[0])):  # every row, in order (a decode step): no gather
            return self.model.compute_logits(h)
        return self.model.compute_logits(h[torch.tensor(rows, dtype=torch.long, device=device)])


def _spans(chunks: Sequence[SeqChunk]) -> list[tuple[SeqChunk, int, int]]:
    """(chunk, start, new tokens) per attention span: a chunk, or one span per row of a chunk with
    drafts, so that each of its rows is computed as a decode step of its own (the decode kernel,
    whose row sees its request's keys up to its own position): bitwise the logits that decoding
    one token at a time would give, which is what makes verification exact."""
    if not any(c.drafts for c in chunks):
        return [(c, c.start, c.num_new) for c in chunks]
    out: list[tuple[SeqChunk, int, int]] = []
    for c in chunks:
        if c.drafts:
            out += [(c, c.start + i, 1) for i in range(c.num_new)]
        else:
            out.append((c, c.start, c.num_new))
    return out
