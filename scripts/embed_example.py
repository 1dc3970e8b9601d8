"""Embedding AsyncEngine in an asyncio application: two requests streamed concurrently.

.venv/bin/python scripts/embed_example.py [MODEL_DIR]      (default: the built-in demo model)
"""

from __future__ import annotations

import asyncio
import sys

from ppserve import AsyncEngine, EngineConfig, SamplingParams
from ppserve.server.demo import resolve_model


async def answer(engine: AsyncEngine, name: str, prompt: str) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=1)
    text, tokens = "", 0
    async for out in engine.generate(prompt, params):  # one output per new token (or few)
        text += out.text
        tokens += len(out.token_ids)
    print(f"{name}: {tokens} tokens ({out.finish_reason}): {text!r}")


async def main(model_dir: str) -> None:
    config = EngineConfig.create(model_dir, pp_size=2, kv_cache_gb=0.1)
    async with AsyncEngine(config) as engine:  # starts the stage processes; stops them on exit
        await asyncio.gather(answer(engine, "first", "The pipeline"), answer(engine, "second", "A river"))


if __name__ == "__main__":  # required: stage processes are spawned and re-import this module
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else resolve_model(None)))
