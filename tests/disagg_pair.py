"""A prefill engine and a decode engine for tests of disaggregation, each with its own stage
processes, and requests run through the pair."""

from __future__ import annotations

from pathlib import Path

from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.config import EngineConfig
from ppserve.scheduler.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

KEY = b"a-secret-for-the-pair-0123"


def engine(model: Path, mode: str, pp: int, partition: str | None = None, **kw: float | bytes) -> AsyncEngine:
    kw.setdefault("num_kv_blocks", 128)
    if not kw.get("disagg_insecure"):
        kw.setdefault("disagg_key", KEY)
    config = EngineConfig.create(
        model, pp_size=pp, layer_partition=partition, disaggregation=mode, threads_per_stage=1,
        chunked_prefill_size=32, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    return AsyncEngine(config)


async def collect(e: AsyncEngine, prompt: list[int], params: SamplingParams, prefill: str) -> list[int]:
    return [t async for out in e.generate(prompt, params, prefill=prefill) for t in out.token_ids]
