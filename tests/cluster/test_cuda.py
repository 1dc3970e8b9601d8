"""The pipeline on GPUs, for a machine that has them (skipped elsewhere): PP=2 on two GPUs over
NCCL, and PP=2 on one GPU (NCCL refuses that pair, so activations go through host memory),
both token for token equal to PP=1 on the same GPU."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from helpers import random_prompt

from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.config import EngineConfig
from ppserve.scheduler.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


async def _greedy(config: EngineConfig, prompts: list[list[int]]) -> list[list[int]]:
    async def one(engine: AsyncEngine, prompt: list[int]) -> list[int]:
        return [t async for out in engine.generate(prompt, GREEDY) for t in out.token_ids]

    async with AsyncEngine(config) as engine:
        return list(await asyncio.gather(*(one(engine, p) for p in prompts)))


def _config(model: Path, pp_size: int, **kw: object) -> EngineConfig:
    return EngineConfig.create(model, pp_size=pp_size, device="cuda", dtype="float32", kv_cache_gb=0.05, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [random_prompt(rng, n) for n in (5, 40, 300)]


@pytest.fixture(scope="module")
def pp1(llama_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return asyncio.run(_greedy(_config(llama_dir, 1), prompts))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_pp2_on_two_gpus_over_nccl(llama_dir: Path, prompts: list[list[int]], pp1: list[list[int]]) -> None:
    config = _config(llama_dir, 2)
    assert config.stage_gpus == (0, 1) and config.tensor_transport == "nccl"
    assert asyncio.run(_greedy(config, prompts)) == pp1


def test_pp2_on_one_gpu(llama_dir: Path, prompts: list[list[int]], pp1: list[list[int]]) -> None:
    config = _config(llama_dir, 2, gpu_ids=(0,))
    assert config.stage_gpus == (0, 0) and config.tensor_transport == "shm"
    assert asyncio.run(_greedy(config, prompts)) == pp1


@pytest.mark.parametrize("quantization", ["int8", "auto"])
def test_quantization_flags_run_on_cuda(
    llama_dir: Path, tmp_path: Path, prompts: list[list[int]], quantization: str
) -> None:
    """--quantization on CUDA (the weight dequantized once at load, engine/model/quantized.py): int8
    on a float checkpoint and a Q4_1 GGUF kept as int4 both serve, equal across PP=1 and PP=2."""
    from gguf import GGMLQuantizationType
    from gguf_files import write_gguf

    model = (
        llama_dir if quantization == "int8" else write_gguf(llama_dir, tmp_path / "m.gguf", GGMLQuantizationType.Q4_1)
    )
    runs = [asyncio.run(_greedy(_config(model, pp, gpu_ids=(0,), quantization=quantization), prompts)) for pp in (1, 2)]
    assert runs[0] == runs[1] and all(len(r) == GREEDY.max_tokens for r in runs[0])
