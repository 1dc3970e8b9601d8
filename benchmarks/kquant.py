"""The K-quant benchmark: ppserve on two Q4_K_M files against llama.cpp on the same files.

The files (benchmarks/kquant_reference.py's):

    smollm2_q4_k_m         the demo model re-quantized by llama-quantize (benchmarks/harness/peers_setup.py)
    gemma3_270m_q4_k_m     Gemma 3 270M's Q4_K_M as people download it (benchmarks/fetch_gemma3.py)

and the issue's three targets, each measured on both, ppserve keeping the file's tensors as their
blocks (`--quantization auto`, the default), both sides on the machine's cores (2 threads each):

- batch 1: ppserve's time per output token (ITL p50) at most 1.0x llama-server's;
- 32 streams: ppserve's output tokens/s at least 1.5x llama-server's;
- perplexity within 1% of llama-perplexity's.

Speed goes through benchmarks/peers.py with --gguf (engines ppserve-pp1-gguf, ppserve-pp2-gguf,
llama-server-gguf, side by side in alternating rounds; llama-server gets one slot per stream, -np
32), which writes benchmarks/results/peers_kquant_<model>.json. Perplexity needs no llama.cpp:
benchmarks/results/kquant_reference.json holds llama-perplexity's figure on each file and text, the
window's token ids and the log-probabilities of the tokens it scored; ppserve is given the same ids
(`/v1/completions` with echo, benchmarks/eval_perplexity.py's `server_logprobs`) and scored on the same
tokens (bench_quant_quality.scored), with --quantization auto (the target, at PP=1; PP=2 too) and
none (the weights dequantized to float32, for the record).

    .venv/bin/python -m benchmarks kquant                         # both files: about 15 minutes on 2 cores
    .venv/bin/python -m benchmarks kquant --models smollm2_q4_k_m --rounds 1
    .venv/bin/python -m benchmarks kquant --speed reuse           # perplexity again, the peers JSONs as they are

Writes benchmarks/results/kquant.json (the summary: figures, ratios, targets, and the load on the
machine while the speed rounds ran); exits 1 where a target is not met.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import serving  # (its `served`: ppserve serve on a free port)
from benchmarks.eval_perplexity import perplexity, server_logprobs
from benchmarks.fetch_gemma3 import gemma3_270m_q4_k_m
from benchmarks.harness.peers_setup import smollm2_q4_k_m
from benchmarks.harness.record import read_result, write_result
from benchmarks.quant_quality import per_token, relative, scored, shown

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "benchmarks/results"
REFERENCE = RESULTS / "kquant_reference.json"
MODELS = {"smollm2_q4_k_m": smollm2_q4_k_m, "gemma3_270m_q4_k_m": gemma3_270m_q4_k_m}
PEER = "llama-server-gguf"
TARGETS = {"batch1_itl_ratio_at_most": 1.0, "burst_throughput_ratio_at_least": 1.5, "perplexity_within": 0.01}


def peers_json(name: str) -> Path:
    return RESULTS / f"peers_kquant_{name.removesuffix('_q4_k_m')}.json"


# ---- perplexity --------------------------------------------------------------------------------


def ppserve_perplexity(model: Path, ref: dict[str, Any], quantization: str, pp: int, chunk: int) -> dict[str, Any]:
    """ppserve's perplexity on each of the reference's windows (one server for all), on the tokens
    llama-perplexity scored, against its figure and its per-token log-probabilities."""
    settings = argparse.Namespace(
        pp_size=pp, kv_cache_gb=0.5, max_running_requests=8, chunked_prefill_size=chunk, quantization=quantization
    )
    out: dict[str, Any] = {}
    with serving.served(settings, model) as (url, _):
        for text, run in ref["runs"].items():
            ids, n_ctx = run["ids"], run["n_ctx"]
            start = time.perf_counter()
            lp = server_logprobs(url, ids)
            seconds = time.perf_counter() - start
            ours = scored(lp, n_ctx)
            if len(ours) != len(run["logprobs"]):
                raise RuntimeError(f"{text}: scored {len(ours)} tokens, llama-perplexity {len(run['logprobs'])}")
            ppl = perplexity(ours)
            out[text] = {
                "perplexity": ppl,
                "perplexity_all_tokens": perplexity(lp),
                "llama_perplexity": run["perplexity"],
                "relative_difference": relative(ppl, run["perplexity"]),
                # against llama-perplexity's, token by token: the mean is what moves the ratio of perplexities
                "token_logprob_difference": per_token(ours, run["logprobs"]),
                "max_token_logprob_difference": float(np.max(np.abs(np.subtract(ours, run["logprobs"])))),
                "seconds": round(seconds, 2),
            }
            print(
                f"  {text}: ppserve ({quantization}, PP={pp}) PPL {ppl:.4f}, llama-perplexity {run['perplexity']:.4f}"
                f" ({out[text]['relative_difference']:.3%} apart) in {seconds:.1f} s"
            )
    return out


# ---- speed -------------------------------------------------------------------------------------


def run_peers(name: str, model: Path, args: argparse.Namespace) -> None:
    """benchmarks/peers.py on `model`'s GGUF engines: writes peers_json(name)."""
    tag = peers_json(name).stem.removeprefix("peers_")
    cmd = [sys.executable, "-m", "benchmarks", "peers", "--gguf", str(model), "--tag", tag]
    cmd += ["--engines", args.engines, "--llama-parallel", str(args.streams), "--num-requests", str(args.streams)]
    cmd += ["--input-len", f"{args.input_len}:{args.input_len}", "--output-len", f"{args.output_len}:{args.output_len}"]
    cmd += ["--batch1-requests", str(args.batch1_requests), "--batch1-len", str(args.input_len)]
    cmd += ["--batch1-output-len", str(args.output_len), "--rounds", str(args.rounds)]
    print(f"$ {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def speed(peers: dict[str, Any]) -> dict[str, Any]:
    """Each engine's batch-1 time per token and burst throughput from a peers JSON, and ppserve's
    ratios to llama-server's (batch 1: < 1 is faster; burst: > 1 is faster)."""
    engines = peers["engines"]
    out: dict[str, Any] = {"engines": {}, "ratios": {}}
    for name, e in engines.items():
        tpot = [r["batch1"]["tpot_ms_p50"] for r in peers["rounds"][name]]
        out["engines"][name] = {
            "batch1_itl_ms_p50": e["batch1_itl_ms_p50"],
            "batch1_itl_ms_p50_rounds": e["batch1_itl_ms_p50_rounds"],
            "batch1_tpot_ms_p50": float(np.median(tpot)),
            "burst_output_tok_s": e["output_tok_s"],
            "burst_output_tok_s_rounds": e["output_tok_s_rounds"],
            "burst_tok_per_server_cpu_s": e["burst_tok_per_server_cpu_s"],
            "burst_other_cpu_s_rounds": e["burst_other_cpu_s_rounds"],
            "failed_requests": e["failed_requests"],
        }
    peer = out["engines"].get(PEER)
    for name, e in out["engines"].items():
        if name.startswith("ppserve") and peer:
            out["ratios"][f"{name}/{PEER}"] = {
                "batch1_itl": e["batch1_itl_ms_p50"] / peer["batch1_itl_ms_p50"],
                "batch1_tpot": e["batch1_tpot_ms_p50"] / peer["batch1_tpot_ms_p50"],
                "burst_output_tok_s": e["burst_output_tok_s"] / peer["burst_output_tok_s"],
            }
    # Others' CPU use while the rounds ran (cores, on average over each burst): what the figures rest on.
    others = [
        r[case]["other_cpu_s"] / r[case]["duration_s"]
        for rounds in peers["rounds"].values()
        for r in rounds
        for case in ("burst", "batch1")
    ]
    out["other_cores_mean"], out["other_cores_max"] = float(np.mean(others)), float(np.max(others))
    out["greedy_agreement"] = {k: v["identical_fraction"] for k, v in peers["greedy_agreement"]["pairs"].items()}
    out["source"] = {"file": shown(Path(peers["_path"])), "commit": peers["commit"], "dirty": peers["dirty"]}
    out["settings"] = {k: peers["settings"][k] for k in ("num_requests", "input_len", "output_len", "rounds")}
    out["settings"]["batch1_requests"] = peers["settings"]["batch1_requests"]
    out["settings"]["llama_parallel"] = peers["settings"].get("llama_parallel")
    return out


# ---- report ------------------------------------------------------------------------------------


def targets(model: dict[str, Any], pp1: str) -> dict[str, Any]:
    """The issue's three targets for ppserve at PP=1, each with its figure and whether it is met."""
    out: dict[str, Any] = {}
    ratios = model.get("speed", {}).get("ratios", {}).get(f"{pp1}/{PEER}")
    if ratios:
        b1, burst = ratios["batch1_itl"], ratios["burst_output_tok_s"]
        out["batch1_itl_ratio"] = {"value": b1, "met": b1 <= TARGETS["batch1_itl_ratio_at_most"]}
        out["burst_throughput_ratio"] = {"value": burst, "met": burst >= TARGETS["burst_throughput_ratio_at_least"]}
    if auto := model.get("perplexity", {}).get("auto_pp1"):
        worst = max(r["relative_difference"] for r in auto.values())
        out["perplexity_relative_difference"] = {"value": worst, "met": worst <= TARGETS["perplexity_within"]}
    return out


def print_table(models: dict[str, Any]) -> None:
    print(f"\n{'model':22s}{'engine':20s}{'b1 ms/tok':>10s}{'ratio':>7s}{'burst tok/s':>13s}{'ratio':>7s}")
    for name, m in models.items():
        sp = m.get("speed")
        for engine, e in (sp or {}).get("engines", {}).items():
            r = sp["ratios"].get(f"{engine}/{PEER}", {})
            b1r, br = r.get("batch1_itl", math.nan), r.get("burst_output_tok_s", math.nan)
            print(
                f"{name:22s}{engine:20s}{e['batch1_itl_ms_p50']:10.2f}{b1r:7.2f}{e['burst_output_tok_s']:13.1f}{br:7.2f}"
            )
        for key, runs in m.get("perplexity", {}).items():
            for text, r in runs.items():
                print(
                    f"{name:22s}ppl {key:16s}{text:16s}{r['perplexity']:9.4f} vs {r['llama_perplexity']:9.4f}"
                    f" ({r['relative_difference']:.3%})"
                )
        for target, t in m["targets"].items():
            print(f"{name:22s}target {target}: {t['value']:.4f} {'met' if t['met'] else 'NOT met'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--speed", choices=["run", "reuse", "skip"], default="run", help="reuse: read the peers JSONs")
    p.add_argument("--perplexity", choices=["run", "skip"], default="run")
    p.add_argument("--engines", default="ppserve-pp1-gguf,ppserve-pp2-gguf,llama-server-gguf", help="bench_peers'")
    p.add_argument("--streams", type=int, default=32, help="burst: requests at once (llama-server: as many slots)")
    p.add_argument("--input-len", type=int, default=192, help="prompt tokens (burst and batch 1)")
    p.add_argument("--output-len", type=int, default=96, help="output tokens (burst and batch 1)")
    p.add_argument("--batch1-requests", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--perplexity-runs",
        nargs="+",
        default=["auto:1", "none:1", "auto:2"],
        help="ppserve's --quantization and --pp-size for each perplexity run (the target: auto:1)",
    )
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--out", default=str(RESULTS / "kquant.json"))
    return p.parse_args(argv)


def engine_changes() -> list[str]:
    """The engine's files that differ from the commit (`write_result` records only that some do):
    other people's work in progress in this tree is what a dirty run measured."""
    cmd = ["git", "-C", str(ROOT), "status", "--short", "--", "engine", "scheduler", "server", "transport"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    return [line.strip() for line in out.stdout.splitlines()] if out.returncode == 0 else ["(git status failed)"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    changes_at_start = engine_changes()
    reference = read_result(REFERENCE)
    models: dict[str, Any] = {}
    for name in args.models:
        model = MODELS[name]()
        ref = reference["models"][name]
        m: dict[str, Any] = {"file": model.name, "sha256": ref["sha256"], "tensor_types": ref["tensor_types"]}
        if args.perplexity == "run":
            print(f"{name}: perplexity on the reference's windows", flush=True)
            runs = [(q, int(pp)) for q, _, pp in (r.partition(":") for r in args.perplexity_runs)]
            m["perplexity"] = {
                f"{q}_pp{pp}": ppserve_perplexity(model, ref, q, pp, args.chunked_prefill_size) for q, pp in runs
            }
        if args.speed == "run":
            run_peers(name, model, args)
        if args.speed != "skip":
            peers = read_result(peers_json(name))
            if peers.get("gguf", {}).get("sha256") != ref["sha256"]:
                raise RuntimeError(f"{peers_json(name)} did not measure {model.name} (sha256 differs)")
            m["speed"] = speed({**peers, "_path": str(peers_json(name))})
        m["targets"] = targets(m, "ppserve-pp1-gguf")
        models[name] = m
    met = all(t["met"] for m in models.values() for t in m["targets"].values())
    report = {
        "benchmark": "kquant",
        "reference": {"file": shown(REFERENCE), "commit": reference["commit"], "llama_cpp": reference["llama_cpp"]},
        "threads": os.cpu_count() or 1,
        "targets": TARGETS,
        "models": models,
        "all_targets_met": met,
        "engine_changes": {"at_start": changes_at_start, "at_end": engine_changes()},
        "machine": {"loadavg_at_end": os.getloadavg()},
        "wall_s": round(time.monotonic() - t0),
    }
    write_result(Path(args.out), report, args)
    print_table(models)
    print(f"wrote {args.out} in {report['wall_s']} s; targets {'all met' if met else 'NOT all met'}")
    return 0 if met else 1
