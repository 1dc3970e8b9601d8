"""Cache salts across prefill/decode disaggregation: the prefill engine looks up and registers the
prompt's blocks under the salt the decode engine sends in RoomOpen."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.config import EngineConfig
from ppserve.scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
PROMPT = [(7 * j) % 500 for j in range(40)]  # two full blocks of 16 can be found cached


def _engine(model: Path, mode: str) -> AsyncEngine:
    config = EngineConfig.create(
        model, disaggregation=mode, threads_per_stage=1, num_kv_blocks=64, disagg_key=b"the-pair-secret-0123"
    )
    return AsyncEngine(config)


async def _prefill_hits(p: AsyncEngine, d: AsyncEngine, salt: str | None) -> int:
    """Prompt tokens the prefill engine found cached for one request through the pair."""
    assert p.rooms is not None
    before = p.scheduler.prefix_hits
    async for _ in d.generate(PROMPT, GREEDY, prefill=p.rooms.address, cache_salt=salt):
        pass
    return p.scheduler.prefix_hits - before


async def test_the_prefill_side_keeps_salts_apart(llama_dir: Path) -> None:
    async with _engine(llama_dir, "prefill") as p, _engine(llama_dir, "decode") as d:
        assert await _prefill_hits(p, d, "tenant-a") == 0
        assert await _prefill_hits(p, d, "tenant-a") == 32  # the same salt shares
        assert await _prefill_hits(p, d, "tenant-b") == 0  # another does not
        assert await _prefill_hits(p, d, None) == 0  # nor does no salt
        assert await _prefill_hits(p, d, None) == 32
