"""Prefill/decode disaggregation against colocated serving, side by side in one run; writes
benchmarks/results/pd.json.

Workload: decoding streams that run throughout, and long prompts arriving every few seconds.
  colocated: one engine, PP=2 (two stage processes);
  PD:        a prefill engine (PP=1) and a decode engine (PP=1): the same two stage processes.
Reported: inter-token latency p50/p99 of the decoding streams while the long prompts arrive,
the long prompts' time to first token, and the transfer's own cost: one long prompt's TTFT on
an idle deployment, PD against colocated and against the prefill engine alone (the handover).

    python -m benchmarks pd [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.record import write_result
from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.config import EngineConfig
from ppserve.engine.disagg.prefill import PrefillRooms
from ppserve.engine.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint
from ppserve.scheduler.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent

SPEC = TinySpec(
    arch="llama", hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=768,
    vocab_size=4096, max_position_embeddings=8192,
)  # fmt: skip


KEY = b"the-benchmark-pair-secret"  # the pair's sockets under CURVE, as a deployment runs them


def config(model: Path, pp: int, mode: str = "") -> EngineConfig:
    return EngineConfig.create(
        model, pp_size=pp, disaggregation=mode, threads_per_stage=1, kv_cache_gb=0.5, chunked_prefill_size=512,
        disagg_key=KEY if mode else None,
        enable_prefix_caching=False,  # measured: prefill and transfer (a cache hit would skip the prompt)
    )  # fmt: skip


async def stream(engine: AsyncEngine, prompt: list[int], tokens: int, prefill: str | None) -> list[float]:
    """Arrival times of every token of one request (the first one is its TTFT)."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    stamps = []
    async for out in engine.generate(prompt, params, prefill=prefill):
        stamps += [time.perf_counter()] * len(out.token_ids)
    return stamps


class Recorder:
    """Token arrival times of the decoding streams, kept outside their tasks."""

    def __init__(self) -> None:
        self.stamps: list[list[float]] = []

    async def run(self, engine: AsyncEngine, prompt: list[int], prefill: str | None) -> None:
        mine: list[float] = []
        self.stamps.append(mine)
        params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
        async for out in engine.generate(prompt, params, prefill=prefill):
            mine += [time.perf_counter()] * len(out.token_ids)


async def measure(engine: AsyncEngine, prefill: str | None, streams: int, longs: int, long_len: int) -> dict[str, Any]:
    rec = Recorder()
    tasks = [
        asyncio.create_task(rec.run(engine, [10 + (i * 7 + j) % 4000 for j in range(32)], prefill))
        for i in range(streams)
    ]
    await asyncio.sleep(3.0)  # every stream is decoding
    window = time.perf_counter()
    ttft = []
    for i in range(longs):
        t0 = time.perf_counter()
        stamps = await stream(engine, [20 + (i * 13 + j) % 4000 for j in range(long_len)], 1, prefill)
        ttft.append(stamps[0] - t0)
        await asyncio.sleep(2.0)  # the next long prompt comes a little later
    end = time.perf_counter()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    gaps = [b - a for s in rec.stamps for a, b in itertools.pairwise(s) if window <= a and b <= end and b > a]
    gaps.sort()
    return {
        "itl_p50_ms": round(1e3 * statistics.median(gaps), 2),
        "itl_p99_ms": round(1e3 * gaps[int(0.99 * (len(gaps) - 1))], 2),
        "long_ttft_s": [round(t, 3) for t in ttft],
        "long_ttft_median_s": round(statistics.median(ttft), 3),
        "decode_tokens_in_window": len(gaps),
    }


async def idle_ttft(engine: AsyncEngine, prefill: str | None, long_len: int, rounds: int = 3) -> float:
    times = []
    for i in range(rounds):
        t0 = time.perf_counter()
        stamps = await stream(engine, [30 + (i * 17 + j) % 4000 for j in range(long_len)], 1, prefill)
        times.append(stamps[0] - t0)
    return statistics.median(times)


async def main_async(quick: bool) -> dict[str, Any]:
    streams, longs, long_len = (8, 2, 2048) if quick else (16, 4, 4096)
    model = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="ppserve-bench-")) / "model", SPEC)
    results: dict[str, Any] = {}
    async with AsyncEngine(config(model, 2)) as colocated:
        results["colocated"] = await measure(colocated, None, streams, longs, long_len)
        results["colocated"]["idle_ttft_s"] = round(await idle_ttft(colocated, None, long_len), 3)
    async with AsyncEngine(config(model, 1, "prefill")) as p, AsyncEngine(config(model, 1, "decode")) as d:
        assert isinstance(p.rooms, PrefillRooms)
        results["pd"] = await measure(d, p.rooms.address, streams, longs, long_len)
        results["pd"]["idle_ttft_s"] = round(await idle_ttft(d, p.rooms.address, long_len), 3)
        # The same prompt on the prefill engine alone: what the handover itself adds to TTFT.
        results["pd"]["prefill_engine_alone_idle_ttft_s"] = round(await idle_ttft(p, None, long_len), 3)
    c, pd = results["colocated"], results["pd"]
    results["ratios"] = {
        "itl_p99_pd_over_colocated": round(pd["itl_p99_ms"] / c["itl_p99_ms"], 3),
        "itl_p50_pd_over_colocated": round(pd["itl_p50_ms"] / c["itl_p50_ms"], 3),
        "idle_ttft_pd_over_colocated": round(pd["idle_ttft_s"] / c["idle_ttft_s"], 3),
        "handover_s": round(pd["idle_ttft_s"] - pd["prefill_engine_alone_idle_ttft_s"], 3),
    }
    results["workload"] = {"decode_streams": streams, "long_prompts": longs, "long_prompt_tokens": long_len}
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer streams and shorter long prompts")
    args = parser.parse_args(argv)
    results = asyncio.run(main_async(args.quick))
    path = ROOT / "benchmarks" / "results" / "pd.json"
    # What the script fixes, beside its flags: the pair runs under a cluster key, caching off.
    write_result(path, {"benchmark": "pd", **results}, {**vars(args), "cluster_key": True, "prefix_caching": False})
    print(json.dumps(results, indent=2))
    print(f"wrote {path}")
