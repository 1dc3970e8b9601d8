"""The mixture-of-experts benchmark: ppserve against llama.cpp on a Qwen3-MoE-shaped GGUF.

The model is benchmarks/make_moe_gguf.py's (24 layers, hidden 1024, 32 experts of 768, top 4: 1.9B
parameters, 0.3B active; Q4_0, random weights), written once into the cache. Four parts:

- speed: benchmarks/peers.py with --gguf on the file (ppserve-pp1-gguf and llama-server-gguf,
  2 threads each, alternating rounds): batch 1 (requests one after another) and 32 streams of 192
  prompt and 96 output tokens. The issue's targets: batch-1 time per token at most 1.0x
  llama-server's, 32 streams at least 1.5x its throughput. Writes peers_moe_q4_0.json.
- split: where a decode step's time goes in ppserve at batch 1 and 32 (in process, the stage's
  forward on the file, KV of 192 tokens a request): routing (the router and its top k), the experts
  (the grouped kernel), and the rest (attention, norms, the head), medians of several steps.
- vllm: whether vLLM's CPU build serves a Qwen3-MoE checkpoint at all (a small random one in
  float32, written by transformers): what it answers, or how it fails.
- vllm-speed: the same model in float32 against vLLM's CPU build: the file dequantized by
  transformers' GGUF loader into a Hugging Face directory (written once beside the file, 7.6 GB),
  ppserve-pp1 and vllm on it through benchmarks/peers.py --checkpoint, with `speed`'s workload, one
  engine at a time (two copies of the float32 weights do not fit in memory at once). Writes
  peers_moe_f32_ppserve.json and peers_moe_f32_vllm.json.

    .venv/bin/python -m benchmarks moe                     # about 25 minutes on 2 cores
    .venv/bin/python -m benchmarks moe --parts split       # only the step's split

Writes benchmarks/results/moe.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.record import read_result, write_result
from benchmarks.kquant import PEER, speed
from benchmarks.make_moe_gguf import default_path, write

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "benchmarks/results"
TAG, TAG_F32 = "moe_q4_0", "moe_f32"
TARGETS = {"batch1_itl_ratio_at_most": 1.0, "burst_throughput_ratio_at_least": 1.5}


def float_checkpoint(model: Path) -> Path:
    """The GGUF's weights dequantized to float32, as a Hugging Face directory beside it (made once, by
    transformers' GGUF loader: the model transformers itself would run from this file)."""
    out = model.with_name(model.stem + "-f32")
    if not (out / "config.json").is_file():
        import shutil

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"writing {out.name} (the file dequantized to float32)", flush=True)
        hf = AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name, dtype=torch.float32)
        # Loaded from a GGUF, the model counts as quantized and save_pretrained refuses it: its float32
        # tensors go into a model made from its config instead (no copy), which saves them as a Hugging
        # Face checkpoint does (experts one by one).
        del hf.config.quantization_config
        hf.config.architectures = [type(hf).__name__]
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32)
        plain.load_state_dict(hf.state_dict(), assign=True)
        plain.save_pretrained(tmp)
        del hf, plain
        AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name).save_pretrained(tmp)
        os.replace(tmp, out)
    return out


def peers_cmd(source: list[str], tag: str, engines: str, args: argparse.Namespace) -> list[str]:
    """benchmarks/peers.py on `source` (its --gguf or --checkpoint) with the benchmark's workload."""
    cmd = [sys.executable, "-m", "benchmarks", "peers", *source, "--tag", tag]
    cmd += ["--engines", engines, "--llama-parallel", str(args.streams)]
    cmd += ["--num-requests", str(args.streams), "--input-len", f"{args.input_len}:{args.input_len}"]
    cmd += ["--output-len", f"{args.output_len}:{args.output_len}", "--batch1-requests", str(args.batch1_requests)]
    cmd += [
        "--batch1-len",
        str(args.input_len),
        "--batch1-output-len",
        str(args.output_len),
        "--rounds",
        str(args.rounds),
    ]
    return cmd


def run_speed(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = peers_cmd(["--gguf", str(model)], TAG, "ppserve-pp1-gguf,llama-server-gguf", args)
    print(f"$ {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    path = RESULTS / f"peers_{TAG}.json"
    out = speed({**read_result(path), "_path": str(path)})
    ratios = out["ratios"].get(f"ppserve-pp1-gguf/{PEER}", {})
    out["targets"] = {
        "batch1_itl_ratio": {"value": ratios.get("batch1_itl"), "met": ratios.get("batch1_itl", 9) <= 1.0},
        "burst_throughput_ratio": {
            "value": ratios.get("burst_output_tok_s"),
            "met": ratios.get("burst_output_tok_s", 0) >= 1.5,
        },
    }
    return out


def split(model: Path, batches: list[int], steps: int, context: int) -> dict[str, Any]:
    """Per batch size: a decode step's milliseconds in routing, in the experts and in the rest."""
    import torch

    from ppserve.engine.config import EngineConfig
    from ppserve.engine.model.moe import MoE
    from ppserve.engine.offline import OfflineEngine
    from ppserve.transport.messages import SeqChunk

    torch.set_num_threads(2)
    config = EngineConfig.create(model, kv_cache_gb=1.0, enable_prefix_caching=False)
    pipe = OfflineEngine(config)
    runner = pipe.executor.runners[0]
    moes = [m for m in runner.model.modules() if isinstance(m, MoE)]
    spent = {"routing": 0.0, "experts": 0.0}

    def timed(kind: str, fn: Any) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[kind] += time.perf_counter() - start

        return wrapper

    for m in moes:
        m.route = timed("routing", m.route)  # type: ignore[method-assign]
        if m.grouped is not None:
            m.grouped = timed("experts", m.grouped)
    out: dict[str, Any] = {"kernel": "grouped" if moes and moes[0].grouped is not None else "loop"}
    rng = torch.Generator().manual_seed(0)
    for batch in batches:
        tables = [pipe.allocator.allocate(pipe.allocator.blocks_for(context + steps + 4)) for _ in range(batch)]
        with torch.no_grad():
            for i, table in enumerate(tables):  # each request's prompt, prefilled alone
                ids = torch.randint(300, 20000, (context,), generator=rng).tolist()
                pipe.executor.forward([SeqChunk(str(i), ids, 0, table, True)])
            totals, routing, experts = [], [], []
            for s in range(steps + 2):
                chunks = [SeqChunk(str(i), [400 + s], context + s, t, True) for i, t in enumerate(tables)]
                spent["routing"] = spent["experts"] = 0.0
                start = time.perf_counter()
                pipe.executor.forward(chunks)
                if s >= 2:  # two to warm up
                    totals.append(time.perf_counter() - start)
                    routing.append(spent["routing"])
                    experts.append(spent["experts"])
        for t in tables:
            pipe.allocator.free(t)
        total, r, e = (statistics.median(v) * 1e3 for v in (totals, routing, experts))
        out[f"batch{batch}"] = {"step_ms": total, "routing_ms": r, "experts_ms": e, "rest_ms": total - r - e}
        print(f"  batch {batch}: step {total:.1f} ms: routing {r:.1f}, experts {e:.1f}, rest {total - r - e:.1f}")
    pipe.close()
    return out


def run_vllm_speed(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """ppserve and vLLM's CPU build on the file dequantized to float32, as `speed` runs the GGUF (no
    target: the issue asks how the two compare, or what vLLM does instead). Each engine holds the
    8 GB of float32 weights, and two of them do not fit this machine's memory at once: one run each,
    one after the other (so not side by side)."""
    ckpt = float_checkpoint(model)
    out: dict[str, Any] = {"engines": {}, "skipped": {}, "runs": {}}
    for engine, tag in (("ppserve-pp1", f"{TAG_F32}_ppserve"), ("vllm", f"{TAG_F32}_vllm")):
        cmd = peers_cmd(["--checkpoint", str(ckpt)], tag, engine, args)
        print(f"$ {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
        path = RESULTS / f"peers_{tag}.json"
        peers = read_result(path)
        out["engines"] |= speed({**peers, "_path": str(path)})["engines"]
        out["skipped"] |= peers["skipped"]
        source = path.relative_to(ROOT).as_posix()
        out["runs"][engine] = {"source": source, "commit": peers["commit"], "date": peers["date"]}
    if len(out["engines"]) == 2:
        ours, theirs = out["engines"]["ppserve-pp1"], out["engines"]["vllm"]
        out["ratios"] = {
            "ppserve-pp1/vllm": {
                "batch1_itl": ours["batch1_itl_ms_p50"] / theirs["batch1_itl_ms_p50"],
                "burst_output_tok_s": ours["burst_output_tok_s"] / theirs["burst_output_tok_s"],
            }
        }
    return out


def vllm_check(args: argparse.Namespace) -> dict[str, Any]:
    """Whether vLLM's CPU build (the peers' venv) serves a small Qwen3-MoE checkpoint: a few greedy tokens."""
    from ppserve.engine.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint

    ckpt = ROOT / "build/peers/moe-small"
    if not (ckpt / "config.json").is_file():
        spec = TinySpec(
            arch="qwen3_moe", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=2048,
            intermediate_size=512,
            overrides=(("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 256)),
        )  # fmt: skip
        make_tiny_checkpoint(ckpt, spec)
    python = ROOT / ".venv-peers/bin/python"
    if not python.exists():
        return {"ran": False, "why": "no .venv-peers (benchmarks/harness/peers_setup.py makes it)"}
    code = (
        "from vllm import LLM, SamplingParams\n"
        f"llm = LLM(model={str(ckpt)!r}, dtype='float32', max_model_len=512, enforce_eager=True)\n"
        "out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0))\n"
        "print('TOKENS', list(out[0].outputs[0].token_ids))\n"
    )
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    start = time.perf_counter()
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, timeout=args.vllm_timeout)
    seconds = time.perf_counter() - start
    tokens = next((line for line in proc.stdout.splitlines() if line.startswith("TOKENS")), None)
    tail = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()][-6:]
    return {"ran": True, "served": tokens is not None, "tokens": tokens, "exit": proc.returncode, "seconds": seconds,
            "output_tail": tail}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = ["speed", "split", "vllm", "vllm-speed"]
    p.add_argument("--parts", nargs="+", default=parts, choices=parts)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--input-len", type=int, default=192)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--batch1-requests", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--split-batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--split-steps", type=int, default=8)
    p.add_argument("--vllm-timeout", type=float, default=900)
    p.add_argument("--out", default=str(RESULTS / "moe.json"))
    args = p.parse_args(argv)
    model = default_path()
    if not model.is_file():
        write(model)
    report: dict[str, Any] = {"benchmark": "moe", "file": model.name, "targets": TARGETS}
    previous = read_result(args.out) if Path(args.out).is_file() else {}
    for part in parts:
        if part not in args.parts and part in previous:
            report[part] = previous[part]  # kept from the last run, which recorded its own commit there
    if "split" in args.parts:
        print("split of a decode step", flush=True)
        report["split"] = split(model, args.split_batches, args.split_steps, args.input_len)
    if "vllm" in args.parts:
        print("vLLM on a Qwen3-MoE checkpoint", flush=True)
        report["vllm"] = vllm_check(args)
        print(f"  {report['vllm']}")
    if "speed" in args.parts:
        report["speed"] = run_speed(model, args)
        for engine, e in report["speed"]["engines"].items():
            b1, burst = e["batch1_itl_ms_p50"], e["burst_output_tok_s"]
            print(f"  {engine}: batch 1 {b1:.1f} ms/token, {args.streams} streams {burst:.1f} tok/s")
        print(f"  targets: {report['speed']['targets']}")
    if "vllm-speed" in args.parts:
        report["vllm-speed"] = run_vllm_speed(model, args)
        for engine, e in report["vllm-speed"]["engines"].items():
            b1, burst = e["batch1_itl_ms_p50"], e["burst_output_tok_s"]
            print(f"  float32, {engine}: batch 1 {b1:.1f} ms/token, {args.streams} streams {burst:.1f} tok/s")
    report["machine"] = {"loadavg_at_end": os.getloadavg()}
    write_result(args.out, report, args)
    return 0
