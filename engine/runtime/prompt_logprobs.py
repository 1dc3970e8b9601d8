"""The last stage's work on a plan: sampling (its sampler: `make_sampler`), and prompt logprobs
and embeddings (pooled rows) where a plan asks for them.

Prompt logprobs are computed chunk by chunk, like any prefill: in a chunk covering positions
[s, s + n), logits row j predicts the token at s + j + 1. The plan's `PromptTargets` name those
tokens (the host holds every prompt), so the last stage needs no state between chunks and a
replaced last stage scores on as if nothing happened. Only the rows of chunks that asked get
logits; every other row of the micro-batch costs what it always did.
"""

from __future__ import annotations

import itertools

import torch

from ppserve.engine.config import EngineConfig
from ppserve.engine.model.grammar import Grammars
from ppserve.engine.model.sampler import Sampler
from ppserve.transport.messages import Pooled, PromptLogprobs, Sampled, StepPlan

SLICE_ROWS = 64  # rows scored at a time


def make_sampler(config: EngineConfig) -> Sampler:
    """The last stage's sampler for `config`'s model, its grammars over the model's tokenizer."""
    vocab = config.model_config.vocab_size
    grammars = lambda: Grammars.for_model(config.model, vocab)  # noqa: E731
    return Sampler(vocab, torch.device(config.device), grammars, jump_forward=config.speculative != "off")


def prompt_rows(plan: StepPlan) -> list[int]:
    """Rows of the micro-batch (tokens in chunk order) whose logits score prompt tokens, in the
    order of `plan.prompt_targets`."""
    if not plan.prompt_targets:
        return []
    offsets = list(itertools.accumulate((c.num_new for c in plan.chunks), initial=0))
    return [offsets[t.chunk] + t.first + j for t in plan.prompt_targets for j in range(len(t.token_ids))]


def last_stage_outputs(
    sampler: Sampler, plan: StepPlan, logits: torch.Tensor, pooled: torch.Tensor
) -> tuple[list[Sampled], list[PromptLogprobs], list[Pooled]]:
    """logits: float32 [num_sampled + len(prompt_rows(plan)), vocab], as `StageRunner.execute`
    returns them given `prompt_rows(plan)`: 1 + `drafts` rows per sampling chunk, then the prompt
    rows. A chunk with drafts gives one sample per token it made (Sampler.verify).
    pooled: [len(plan.pooled), hidden], the runner's `pooled` rows (embeddings)."""
    # Released requests have nothing in flight any more; drop them first, since a new
    # request in this very plan may reuse an id.
    for rid in plan.released:
        sampler.remove_request(rid)
    for new in plan.new_requests:
        sampler.add_request(new.request_id, new.params, new.output_token_ids, new.prompt_token_ids, new.grammar_cost)
    chunks = [c for c in plan.chunks if c.sample]
    rows = sum(1 + c.drafts for c in chunks)
    sampled = logits[:rows] if plan.prompt_targets else logits
    samples = [
        Sampled(c.request_id, s.token_id, s.logprob, list(s.top_logprobs), s.error, list(s.forced))
        for c, made in zip(chunks, sampler.verify(chunks, sampled), strict=True)
        for s in made
    ]
    vectors = [Pooled(plan.chunks[i].request_id, v) for i, v in zip(plan.pooled, pooled.tolist(), strict=True)]
    if not plan.prompt_targets:
        return samples, [], vectors
    return samples, score_prompts(sampler, plan, logits[rows:]), vectors


def score_prompts(sampler: Sampler, plan: StepPlan, logits: torch.Tensor) -> list[PromptLogprobs]:
    """logits: float32 [len(prompt_rows(plan)), vocab]. Logprobs are of the raw model
    distribution (as for sampled tokens: no penalties, no temperature), in float32."""
    out: list[PromptLogprobs] = []
    row = 0
    for t in plan.prompt_targets:
        chunk = plan.chunks[t.chunk]
        top_n = sampler.prompt_logprobs(chunk.request_id)
        chosen: list[float] = []
        top: list[list[tuple[int, float]]] = []
        for lo in range(0, len(t.token_ids), SLICE_ROWS):  # bounded [rows, vocab] temporaries
            ids = t.token_ids[lo : lo + SLICE_ROWS]
            logprobs = torch.log_softmax(logits[row : row + len(ids)].float(), dim=-1)  # [rows, vocab]
            row += len(ids)
            targets = torch.tensor(ids, dtype=torch.long, device=logprobs.device)
            chosen += logprobs.gather(1, targets[:, None])[:, 0].tolist()
            if top_n:
                values, token_ids = logprobs.topk(top_n, dim=-1)
                top += [list(zip(i, v, strict=True)) for i, v in zip(token_ids.tolist(), values.tolist(), strict=True)]
            else:
                top += [[] for _ in ids]
        out.append(PromptLogprobs(chunk.request_id, chunk.start + t.first + 1, chosen, top))
    return out
