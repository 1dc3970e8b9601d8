"""Sliding-window KV in the engine: windowed layers keep only their window's blocks, and the
output is unchanged. Tiny random models: Mistral (a window of 24 on every layer), Qwen2 with
sliding layers (16 on its last two of four) and Gemma 3 (16 on two of every three layers, so the
stages of a split hold one group or both). Greedy tokens must equal
transformers', with prompts longer than the window, chunks that cross its edge, a pool far
smaller than the requests' contexts, prefix hits and a pipeline reset."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import hf_greedy, pipeline, random_prompt
from stepper import Stepper
from transformers import AutoModelForCausalLM

from ppserve.engine.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint
from ppserve.engine.offline import OfflineEngine
from ppserve.scheduler.request import Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.scheduler.scheduler import Scheduler
from ppserve.scheduler.window_kv import blocks_per_request

BLOCK, CHUNK = 4, 12  # chunks of 12 start mid-window and mid-block
TOKENS = 16
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
WINDOWED = ["mistral", "qwen2-sliding", "gemma3"]


@pytest.fixture(scope="module")
def models(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    gemma = TinySpec(
        arch="gemma3", seed=33, num_layers=6, sliding_window=16, overrides=(("sliding_window_pattern", 3),)
    )
    return {**checkpoints, "gemma3": make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3"), gemma)}


@functools.cache
def reference(model_dir: Path, prompt: tuple[int, ...]) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return hf_greedy(hf, list(prompt), TOKENS)


def windowed_pipeline(model_dir: Path, pp: int, requests_at_once: int) -> OfflineEngine:
    """A windowed pool that holds `requests_at_once` requests at their most, and no more."""
    probe = pipeline(model_dir, pp_size=pp, block_size=BLOCK, chunked_prefill_size=CHUNK, num_kv_blocks=128)
    window = probe.config.kv_window
    assert window is not None and window < 30  # the prompts below are longer
    probe.close()
    pool = requests_at_once * blocks_per_request(window, CHUNK, BLOCK)
    return pipeline(
        model_dir, pp_size=pp, block_size=BLOCK, chunked_prefill_size=CHUNK, num_kv_blocks=128, num_window_blocks=pool
    )


def assert_all_free(s: Scheduler) -> None:
    assert s.kv.window is not None
    assert s.kv.window.allocator.num_free == s.kv.window.allocator.num_blocks, "windowed blocks leaked"
    assert s.allocator.num_free == s.allocator.num_blocks, "blocks leaked"


@pytest.mark.parametrize("arch", WINDOWED)
@pytest.mark.parametrize("pp", [1, 2, 3])
def test_greedy_equals_transformers_while_blocks_slide_out(models: dict[str, Path], arch: str, pp: int) -> None:
    pipe = windowed_pipeline(models[arch], pp, requests_at_once=2)
    rng = random.Random(pp)
    prompts = [random_prompt(rng, n) for n in (90, 37, 9)]
    pool = pipe.config.num_window_blocks
    # Without freeing, two of these would not fit the pool at once, nor the longest alone.
    assert pool < -(-(90 + TOKENS) // BLOCK) and pool < 2 * -(-(37 + TOKENS) // BLOCK)
    outputs = pipe.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [reference(models[arch], tuple(p)) for p in prompts]
    assert_all_free(pipe.scheduler)


@pytest.mark.parametrize("arch", WINDOWED)
def test_prefix_hits_and_a_reset_keep_the_output(models: dict[str, Path], arch: str) -> None:
    """Requests sharing a prompt longer than the window find it cached (the windowed group's last
    window of it included), one is aborted, the pipeline is reset mid-answer (every request
    recomputed): each output is transformers', and no block is left behind."""
    pipe = windowed_pipeline(models[arch], 2, requests_at_once=3)
    s = Scheduler(replace(pipe.config.scheduler_config(), enable_prefix_caching=True))
    rng = random.Random(5)
    shared = random_prompt(rng, 45)
    prompts = {
        "a": shared + random_prompt(rng, 5),
        "b": shared + random_prompt(rng, 7),  # while a decodes: a's blocks, of both groups
        "c": shared[:30] + random_prompt(rng, 3),  # a prefix of the shared prompt only
        "gone": shared + random_prompt(rng, 20),
        "late": shared + random_prompt(rng, 2),  # after the reset flushed the cache
    }
    arrive = {"a": 0, "b": 14, "c": 16, "gone": 16, "late": 40}
    requests: dict[str, Request] = {}
    resets = []

    def script(steps: Stepper) -> bool:
        for name, step in arrive.items():
            if step == steps.step:
                requests[name] = pipe.request(prompts[name], GREEDY, name)
                s.add(requests[name])
        if steps.step == 22:
            s.abort("gone")
        if steps.step == 30:
            resets.append(steps.reset())
        return steps.step < 40

    Stepper(pipe, s).run(script)
    assert resets and resets[0] > 0  # requests were running when the pipeline was reset
    for name in ("a", "b", "c", "late"):
        assert requests[name].output_token_ids == reference(models[arch], tuple(prompts[name])), name
    assert (requests["b"].num_cached_tokens or 0) >= 40 and (requests["c"].num_cached_tokens or 0) >= 28
    assert_all_free(s)


@pytest.mark.slow
def test_stage_processes_carry_on_after_a_stage_is_killed(models: dict[str, Path]) -> None:
    """Gemma 3 over stage processes (plans on the wire, each stage's tables of both groups), a
    stage killed mid-answer and replaced: every request is recomputed from its tokens, with its
    windowed table sent whole again, and the output is transformers'."""
    from helpers import collect, engine_config, wait_until

    from ppserve.engine.async_engine import AsyncEngine

    model = models["gemma3"]
    rng = random.Random(8)
    prompts = [random_prompt(rng, n) for n in (70, 41, 23, 90)]
    per = blocks_per_request(16, 8, BLOCK)
    config = engine_config(model, 3, block_size=BLOCK, num_kv_blocks=256, num_window_blocks=3 * per)

    async def run() -> list[list[int]]:
        async with AsyncEngine(config) as engine:
            assert engine._pool is not None
            tasks = asyncio.gather(*[collect(engine, p, GREEDY) for p in prompts])
            await wait_until(lambda: any(r.output_token_ids for r in engine.scheduler.running), timeout_s=60)
            victim = engine._pool.procs[1].pid
            assert victim is not None
            os.kill(victim, signal.SIGKILL)
            results = await asyncio.wait_for(tasks, timeout=120)  # a guard against a hang, not a speed check
            assert engine.stage_restarts == [0, 1, 0]
            assert_all_free(engine.scheduler)
            return results

    assert asyncio.run(run()) == [reference(model, tuple(p)) for p in prompts]


def test_the_pools_share_the_budget_and_disaggregation_is_refused(models: dict[str, Path]) -> None:
    """From kv_cache_gb: each stage's cache fits it (full-attention layers' blocks and windowed
    layers' blocks by their own counts); the windowed pool is no larger than the full one, nor than
    max_running_requests requests need; a model whose every layer has a window spends it all there.
    PD disaggregation, which would transfer only full tables, refuses such a model at start."""
    from ppserve.engine.config import EngineConfig
    from ppserve.engine.model.kv_cache import kv_bytes_per_block, windowed_layers
    from ppserve.engine.model.model_config import ConfigError

    for arch, pp, running in [("gemma3", 1, 256), ("gemma3", 3, 2), ("qwen2-sliding", 2, 4), ("mistral", 2, 8)]:
        budget = 0.002
        c = EngineConfig.create(models[arch], pp_size=pp, kv_cache_gb=budget, max_running_requests=running)
        assert c.kv_window is not None
        flags = windowed_layers(c.model_config.sliding_windows, c.kv_window)
        layer = kv_bytes_per_block(c.model_config, 1, c.block_size, c.torch_dtype)
        used = [sum(layer * (c.num_window_blocks if flags[i] else c.num_kv_blocks) for i in r) for r in c.layer_ranges]
        assert 0.95 * budget * 2**30 < max(used) <= budget * 2**30, arch
        most = running * blocks_per_request(c.kv_window, c.chunked_prefill_size, c.block_size)
        if all(flags):  # the full group holds no KV: its blocks only name positions
            assert c.num_kv_blocks >= running * -(-c.max_model_len // c.block_size)
        else:
            assert c.num_window_blocks == min(c.num_kv_blocks, most), arch
    with pytest.raises(ConfigError, match="sliding-window"):
        EngineConfig.create(models["mistral"], disaggregation="prefill", disagg_insecure=True)
