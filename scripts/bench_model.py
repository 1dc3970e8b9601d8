"""Model-core speed against transformers on the same weights, side by side in one run.

Measures prefill of one 512-token prompt and greedy decode at batch 1 and 16 on a ~50M-parameter
float32 Llama, with the same torch thread count for both. Ratios are transformers time / ppserve
time (> 1 means ppserve is faster). Writes benchmarks/results/model.json.

    python scripts/bench_model.py [--threads 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig  # noqa: E402
from engine.local_pipeline import LocalPipeline  # noqa: E402
from engine.tiny_checkpoint import TinySpec, make_tiny_checkpoint  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402

SPEC = TinySpec(
    arch="llama",
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=1536,
    vocab_size=32000,
    init_std=0.02,
    seed=0,
)
PROMPT_LEN = 512
DECODE_PROMPT_LEN = 128
DECODE_TOKENS = 32


def median_time(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hf_decode_steps(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int) -> list[float]:
    """transformers at its leanest: one forward for the prompts, then one per token, greedy, with
    its own KV cache. Returns the time of each decode step (argmax included)."""
    times = []
    with torch.inference_mode():
        out = model(prompts, use_cache=True)
        cache = out.cache
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new_tokens - 1):
            start = time.perf_counter()
            out = model(token, cache=cache, use_cache=True)
            cache = out.cache
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - start)
    return times


def ppserve_decode_steps(pipe: LocalPipeline, prompts: torch.Tensor, new_tokens: int) -> list[float]:
    """The same with this engine: one step prefills every prompt, then one decode step per token
    (forward, sampling and KV-block bookkeeping included)."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    requests = pipe.add_requests(prompts.tolist(), params)
    times = []
    try:
        pipe.step(requests, chunk_size=prompts.shape[1])
        while not all(r.finished for r in requests):
            start = time.perf_counter()
            pipe.step(requests, chunk_size=1)
            times.append(time.perf_counter() - start)
    finally:
        for r in requests:
            pipe.release(r)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/model.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(Path(tmp) / "bench-llama", SPEC)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        num_params = sum(t.numel() for t in hf.parameters())
        pipe = LocalPipeline(EngineConfig.create(model_dir, kv_cache_gb=1.0))

    gen = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(10, SPEC.vocab_size, (1, PROMPT_LEN), generator=gen)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    results: dict[str, dict[str, float]] = {}

    # Prefill: the whole prompt in one chunk, first token sampled.
    ours = median_time(lambda: pipe.generate(long_prompt.tolist(), greedy, chunk_size=PROMPT_LEN), args.reps)
    with torch.inference_mode():
        theirs = median_time(lambda: hf(long_prompt, use_cache=True), args.reps)
    results["prefill_1x512"] = {"ppserve_s": ours, "transformers_s": theirs, "ratio": theirs / ours}

    # Decode: median time of one decode step over all steps of all repetitions, both engines
    # interleaved so that drift in the machine's speed hits both alike.
    for batch in (1, 16):
        prompts = torch.randint(10, SPEC.vocab_size, (batch, DECODE_PROMPT_LEN), generator=gen)
        ours_steps: list[float] = []
        theirs_steps: list[float] = []
        for rep in range(args.reps + 1):
            ours_rep = ppserve_decode_steps(pipe, prompts, DECODE_TOKENS)
            theirs_rep = hf_decode_steps(hf, prompts, DECODE_TOKENS)
            if rep:  # the first repetition is warm-up
                ours_steps += ours_rep
                theirs_steps += theirs_rep
        ours_tps = batch / statistics.median(ours_steps)
        theirs_tps = batch / statistics.median(theirs_steps)
        results[f"decode_batch{batch}"] = {
            "ppserve_tokens_per_s": ours_tps,
            "transformers_tokens_per_s": theirs_tps,
            "ratio": ours_tps / theirs_tps,
        }

    report = {
        "benchmark": "model",
        "model": {"arch": "llama", "params": num_params, "dtype": "float32", **SPEC.__dict__},
        "threads": args.threads,
        "reps": args.reps,
        "prompt_tokens": {"prefill": PROMPT_LEN, "decode": DECODE_PROMPT_LEN},
        "decode_tokens": DECODE_TOKENS,
        "machine": {"cpu_count": torch.get_num_threads(), "platform": platform.platform()},
        "torch": torch.__version__,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{num_params / 1e6:.1f}M params, {args.threads} threads (ratio > 1: ppserve faster)")
    for name, r in results.items():
        print(f"  {name:16s} " + "  ".join(f"{k}={v:.4g}" for k, v in r.items()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
