"""Serving benchmark: an OpenAI-API load generator, and HTTP server vs in-process AsyncEngine.

Every request streams a prompt of random token ids (so lengths are exact) with temperature 0,
ignore_eos and max_tokens set, arriving all at once or as a Poisson process. Reported: request
and output-token throughput, TTFT and inter-token latency (ITL) percentiles, e2e median, and
(Linux) the CPU each side spent: client, server, stages, and other processes on the machine.

    # against any OpenAI-compatible server: HTTP only
    python -m benchmarks serving --url http://127.0.0.1:8000 [--api-key K] [--model-name M]
    # no --url: start `ppserve serve` on --model-dir (default: the tiny random model), run the workload;
    # then run the same workload through an in-process AsyncEngine; --rounds times, alternating
    python -m benchmarks serving --num-requests 64 --input-len 64:256 --output-len 32:128 \
        [--request-rate 8] [--rounds 2] [--tag poisson]

Writes benchmarks/results/serving[_TAG].json and .png (TTFT and ITL CDFs, both modes overlaid).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import torch
import uvloop

from benchmarks.harness.record import write_result
from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.config import EngineConfig
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.server.demo import tiny_random_checkpoint

ROOT = Path(__file__).resolve().parent.parent

STATS = ("ttft", "itl", "tpot", "e2e")


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    output_len: int
    arrival_s: float  # offset from the start of the run


@dataclass
class Record:
    """One request, created right before it is sent: when each chunk carrying tokens came, the outcome.
    TTFT is the first chunk's time, ITLs the gaps between chunks, the same in both modes."""

    start: float = field(default_factory=time.perf_counter)
    chunks: list[float] = field(default_factory=list)
    end: float = math.nan
    output_tokens: int = 0
    error: str | None = None

    def finish(self, tokens: int, error: str | None = None) -> Record:
        self.end, self.output_tokens, self.error = time.perf_counter(), tokens, error
        return self


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    bounds = (int(lo), int(hi or lo))
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 1 <= LO <= HI, got {text!r}")
    return bounds


def make_workload(
    n: int, input_len: tuple[int, int], output_len: tuple[int, int], rate: float, vocab: int, seed: int
) -> list[Job]:
    rng = random.Random(seed)
    jobs, t = [], 0.0
    for _ in range(n):
        if math.isfinite(rate):
            t += rng.expovariate(rate)
        # Low ids are usually special tokens (BOS/EOS/pad); random text never needs them.
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(*input_len))]
        jobs.append(Job(prompt, rng.randint(*output_len), t))
    return jobs


async def run_jobs(jobs: list[Job], one: Callable[[Job], Awaitable[Record]]) -> tuple[list[Record], float]:
    """Send each job at its arrival time; (records, seconds from the first arrival to the last finish)."""
    start = time.perf_counter()

    async def timed(job: Job) -> Record:
        await asyncio.sleep(max(0.0, start + job.arrival_s - time.perf_counter()))
        return await one(job)

    records = await asyncio.gather(*[timed(j) for j in jobs])
    return list(records), time.perf_counter() - start


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system, all threads) used so far by these processes (Linux /proc)."""
    try:
        stats = [Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split() for pid in pids]
    except OSError:
        return math.nan
    return sum(int(f[11]) + int(f[12]) for f in stats) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The stage processes: children of the server, or of this process in-process."""
    kids = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            if int(entry.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.parent.name))
    return kids


def machine_busy_s() -> float:
    """CPU seconds all processes on the machine used so far (user, nice, system, irq, softirq, steal)."""
    with contextlib.suppress(OSError):
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        return sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7)) / os.sysconf("SC_CLK_TCK")
    return math.nan


def settle(before: str, quiet: float = 0.1, window_s: float = 0.5, limit_s: float = 30.0) -> None:
    """Wait until the machine is quiet (under `quiet` cores busy over a window), at most `limit_s`,
    and say so if it never was. An engine's idle processes keep working for a few seconds after
    its last request (vLLM's spin down for about a core-second), and the engine that runs next
    would otherwise pay for it: in one bfloat16 run the engine after vLLM's saw 2 CPU-seconds of
    others in its burst and twice its TTFT."""
    deadline = time.monotonic() + limit_s
    while True:
        busy = machine_busy_s()
        time.sleep(window_s)
        cores = (machine_busy_s() - busy) / window_s
        if cores < quiet:
            return
        if time.monotonic() > deadline:
            print(f"  warning: the machine stayed busy ({cores:.2f} cores) before {before}")
            return


async def measured(jobs: list[Job], one: Callable[[Job], Awaitable[Record]], server_pid: int | None) -> dict[str, Any]:
    """One measured run, and the CPU each side spent on it. Other load on the machine (its CPU
    use is `other_cpu_s`) slows a run down; tokens per CPU-second of ours hardly notices it."""
    parts = {
        "client": [os.getpid()],  # in-process: the engine's host, which is also the client
        "server": [server_pid] if server_pid else [],
        "stages": children(server_pid or os.getpid()),
    }
    before = {k: cpu_s(v) for k, v in parts.items()}
    busy = machine_busy_s()
    out = summarize(jobs, *await run_jobs(jobs, one))
    busy = machine_busy_s() - busy
    for k, pids in parts.items():
        out[f"{k}_cpu_s"] = cpu_s(pids) - before[k]
    ours = sum(out[f"{k}_cpu_s"] for k in parts)
    tokens = out["output_token_throughput"] * out["duration_s"]
    out["other_cpu_s"] = busy - ours
    out["host_cpu_us_per_token"] = (out["client_cpu_s"] + out["server_cpu_s"]) / tokens * 1e6 if tokens else math.nan
    # Only with the stages in sight (not with --url, where a local server counts as "other").
    out["tokens_per_cpu_s"] = tokens / ours if parts["stages"] and ours else math.nan
    return out


def summarize(jobs: list[Job], records: list[Record], duration: float) -> dict[str, Any]:
    for job, r in zip(jobs, records, strict=True):
        if r.error is None and (r.output_tokens != job.output_len or not r.chunks):
            r.error = f"asked for {job.output_len} tokens, got {r.output_tokens}"
    ok = [r for r in records if r.error is None]
    ms = {
        "ttft": [(r.chunks[0] - r.start) * 1e3 for r in ok],
        "itl": [(b - a) * 1e3 for r in ok for a, b in itertools.pairwise(r.chunks)],
        # Time per output token after the first: robust to chunks that carry several tokens.
        "tpot": [(r.end - r.chunks[0]) * 1e3 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "e2e": [(r.end - r.start) * 1e3 for r in ok],
    }
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": sum(r.output_tokens for r in ok) / duration,
    }
    for name in STATS:
        for q in (50, 90, 99):
            out[f"{name}_ms_p{q}"] = float(np.percentile(ms[name], q)) if ms[name] else math.nan
    out["_samples"] = {"ttft": ms["ttft"], "itl": ms["itl"]}  # for the plot; dropped from the JSON
    return out


# ---- HTTP --------------------------------------------------------------------------------------


async def http_one(session: aiohttp.ClientSession, url: str, args: argparse.Namespace, job: Job) -> Record:
    body: dict[str, Any] = {
        "prompt": job.prompt,
        "max_tokens": job.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},  # chunk text can be empty: count tokens from usage
    }
    if args.model_name:
        body["model"] = args.model_name
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rec, usage_tokens = Record(), None
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                return rec.finish(0, f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or (data := line[5:].strip()) == b"[DONE]":
                    continue
                event = msgspec.json.decode(data)
                if "error" in event:
                    return rec.finish(0, str(event["error"])[:200])
                if event.get("choices"):  # every choice chunk carries >= 1 token
                    rec.chunks.append(time.perf_counter())
                if event.get("usage"):
                    usage_tokens = event["usage"]["completion_tokens"]
    except (TimeoutError, aiohttp.ClientError) as e:
        return rec.finish(0, repr(e))
    return rec.finish(len(rec.chunks) if usage_tokens is None else usage_tokens)


async def http_run(
    url: str, args: argparse.Namespace, warmup: list[Job], jobs: list[Job], server_pid: int | None = None
) -> dict[str, Any]:
    # One session for all requests; no connection cap, so the arrival schedule is never throttled.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        def one(job: Job) -> Awaitable[Record]:
            return http_one(session, url, args, job)

        await run_jobs(warmup, one)
        return await measured(jobs, one, server_pid)


@contextlib.contextmanager
def served(args: argparse.Namespace, model_dir: Path) -> Iterator[tuple[str, int]]:
    """`ppserve serve` on a free port; yields (base URL, pid); SIGTERM (then SIGKILL) on the way out."""
    cmd = [sys.executable, "-m", "ppserve.server.cli", "serve", "--model", str(model_dir), "--port", "0"]
    cmd += ["--pp-size", str(args.pp_size), "--kv-cache-gb", str(args.kv_cache_gb), "--log-level", "warning"]
    cmd += ["--max-running-requests", str(args.max_running_requests)]
    cmd += ["--chunked-prefill-size", str(args.chunked_prefill_size)]
    if quantization := getattr(args, "quantization", None):  # else the engine's default
        cmd += ["--quantization", quantization]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    try:
        lines = []
        for line in proc.stdout:  # the URL line comes once the stages are up; EOF if start-up failed
            lines.append(line)
            if match := re.search(r"at (http://\S+)", line):
                break
        else:
            raise RuntimeError("ppserve serve did not start:\n" + "".join(lines[-20:]))
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # a full pipe would block it
        yield match.group(1), proc.pid
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---- in-process --------------------------------------------------------------------------------


async def engine_one(engine: AsyncEngine, job: Job) -> Record:
    params = SamplingParams(max_tokens=job.output_len, temperature=0.0, ignore_eos=True)
    rec, tokens = Record(), 0
    try:
        async for out in engine.generate(job.prompt, params):
            if out.token_ids:
                rec.chunks.append(time.perf_counter())
                tokens += len(out.token_ids)
    except Exception as e:
        return rec.finish(tokens, repr(e))
    return rec.finish(tokens)


async def engine_run(args: argparse.Namespace, model_dir: Path, warmup: list[Job], jobs: list[Job]) -> dict[str, Any]:
    # The same settings the server's CLI flags give (threads_per_stage: the same default).
    config = EngineConfig.create(
        model_dir,
        pp_size=args.pp_size,
        kv_cache_gb=args.kv_cache_gb,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
    )
    async with AsyncEngine(config) as engine:
        await run_jobs(warmup, lambda j: engine_one(engine, j))
        return await measured(jobs, lambda j: engine_one(engine, j), None)


def run_async(coro: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """uvloop, as `ppserve serve` uses: the two modes should differ only in HTTP."""
    return uvloop.run(coro)


# ---- report ------------------------------------------------------------------------------------


def median_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, v in rounds[0].items() if isinstance(v, int | float)]
    return {k: statistics.median(r[k] for r in rounds) for k in keys}


def plot(runs: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, stat, label in zip(axes, ("ttft", "itl"), ("TTFT (ms)", "inter-token latency (ms)"), strict=True):
        for mode, rounds in runs.items():
            xs = np.sort([x for r in rounds for x in r["_samples"][stat]])
            if len(xs):
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=mode)
        ax.set_xlabel(label + (", log scale" if stat == "itl" else ""))
        ax.set_ylabel("fraction of samples")
        if stat == "itl":
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(modes: dict[str, dict[str, Any]]) -> None:
    rows = [("req/s", "request_throughput"), ("output tok/s", "output_token_throughput")]
    rows += [
        (f"{s.upper()} p{q} (ms)", f"{s}_ms_p{q}") for s in STATS for q in (50, 90, 99) if s in STATS[:2] or q == 50
    ]
    rows.append(("host CPU us/token", "host_cpu_us_per_token"))  # client + server, or the engine's host
    rows += [("tok per CPU-s", "tokens_per_cpu_s"), ("others' CPU-s", "other_cpu_s")]
    names = list(modes)
    print(f"{'':18s}" + "".join(f"{n:>12s}" for n in names) + ("   ratio" if len(names) == 2 else ""))
    for label, key in rows:
        vals = [modes[n][key] for n in names]
        ratio = f"{vals[0] / vals[1]:8.2f}" if len(vals) == 2 and vals[1] else ""
        print(f"{label:18s}" + "".join(f"{v:12.1f}" for v in vals) + ratio)
    print("failed requests: " + ", ".join(f"{n} {modes[n]['failed']:.0f}" for n in names))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="benchmark this server only (default: start ppserve, compare)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model-name", default=None, help="the request's model field (default: omitted)")
    p.add_argument("--model-dir", default=None, help="checkpoint (default: tiny-random); gives the vocab size")
    p.add_argument("--vocab-size", type=int, default=None, help="prompt ids are drawn below this")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson req/s (default inf: all at once)")
    p.add_argument("--input-len", type=parse_range, default=(64, 256), help="LO:HI, uniform")
    p.add_argument("--output-len", type=parse_range, default=(32, 128), help="LO:HI, uniform")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup-requests", type=int, default=8)
    p.add_argument("--pp-size", type=int, default=2)
    p.add_argument("--kv-cache-gb", type=float, default=0.5)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--tag", default="", help="suffix for the output files: serving_TAG.json/.png")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks/results"))
    args = p.parse_args(argv)
    # The stages use cpu_count // pp_size threads each; the host only schedules and streams.
    torch.set_num_threads(1)

    model_dir = Path(args.model_dir) if args.model_dir else tiny_random_checkpoint()
    vocab = args.vocab_size or json.loads((model_dir / "config.json").read_text())["vocab_size"]
    jobs = make_workload(args.num_requests, args.input_len, args.output_len, args.request_rate, vocab, args.seed)
    # Warm-up: a short burst of small requests (other seed), so no measured run pays first-call costs.
    warmup = make_workload(args.warmup_requests, args.input_len, (8, 8), math.inf, vocab, args.seed + 1)

    runs: dict[str, list[dict[str, Any]]] = {}
    for i in range(args.rounds):
        if args.url:
            runs.setdefault("http", []).append(run_async(http_run(args.url.rstrip("/"), args, warmup, jobs)))
            continue
        # Alternate which mode goes first, so drift in the machine's speed hits both alike.
        for mode in ("http", "in-process") if i % 2 == 0 else ("in-process", "http"):
            if mode == "http":
                with served(args, model_dir) as (url, pid):
                    result = run_async(http_run(url, args, warmup, jobs, pid))
            else:
                result = run_async(engine_run(args, model_dir, warmup, jobs))
            runs.setdefault(mode, []).append(result)
            print(f"round {i + 1} {mode}: {result['output_token_throughput']:.0f} tok/s, {result['failed']} failed")

    modes = {m: median_summary(r) for m, r in runs.items()}
    report: dict[str, Any] = {
        "benchmark": "serving",
        "model_dir": str(model_dir),
        "modes": {m: {**modes[m], "errors": sorted({e for r in runs[m] for e in r["errors"]})[:5]} for m in modes},
        "rounds": {m: [{k: v for k, v in r.items() if k != "_samples"} for r in rs] for m, rs in runs.items()},
    }
    if "in-process" in modes:
        http, local = modes["http"], modes["in-process"]
        report["ratio_http_over_inprocess_tok_s"] = http["output_token_throughput"] / local["output_token_throughput"]
        # The same ratio per CPU-second spent: what HTTP costs, less sensitive to other load.
        report["ratio_http_over_inprocess_tok_per_cpu_s"] = http["tokens_per_cpu_s"] / local["tokens_per_cpu_s"]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "serving" + (f"_{args.tag}" if args.tag else "")
    # NaN (a statistic with no samples) is written as null; the API key is no setting to keep.
    write_result(out_dir / f"{stem}.json", report, {k: v for k, v in vars(args).items() if k != "api_key"})
    rate = "all at once" if math.isinf(args.request_rate) else f"Poisson {args.request_rate:g} req/s"
    lens = "input {}:{}, output {}:{} tokens".format(*args.input_len, *args.output_len)
    title = f"{args.num_requests} requests, {rate}, {lens}"
    plot(runs, out_dir / f"{stem}.png", title)

    print_table(modes)
    if "ratio_http_over_inprocess_tok_s" in report:
        ratios = (report["ratio_http_over_inprocess_tok_s"], report["ratio_http_over_inprocess_tok_per_cpu_s"])
        print("HTTP / in-process output tok/s: {:.3f} (target >= 0.9); per CPU-second: {:.3f}".format(*ratios))
    print(f"wrote {out_dir / stem}.json and .png")
