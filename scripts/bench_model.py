"""Model-core speed against transformers on the same weights, side by side in one run.

Measures prefill of one 512-token prompt and greedy decode at batch 1 and 16 on a ~50M-parameter
float32 Llama, with the same torch thread count for both. Ratios are transformers time / ppserve
time (> 1 means ppserve is faster). Writes benchmarks/results/model.json.

    python scripts/bench_model.py [--threads 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_record import write_result  # noqa: E402

from ppserve.engine.config import EngineConfig  # noqa: E402
from ppserve.engine.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint  # noqa: E402
from ppserve.engine.runtime.local_pipeline import LocalPipeline  # noqa: E402
from ppserve.scheduler.sampling_params import SamplingParams  # noqa: E402

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


def hf_decode_steps(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int) -> Iterator[float]:
    """transformers at its leanest: one forward for the prompts, then one per token, greedy, with
    its own KV cache. Yields the time of each decode step (argmax included)."""
    with torch.inference_mode():
        out = model(prompts, use_cache=True)
        cache = out.cache
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new_tokens - 1):
            start = time.perf_counter()
            out = model(token, cache=cache, use_cache=True)
            cache = out.cache
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            yield time.perf_counter() - start


def ppserve_decode_steps(pipe: LocalPipeline, prompts: torch.Tensor, new_tokens: int) -> Iterator[float]:
    """The same with this engine: one step prefills every prompt, then one decode step per token
    (forward, sampling and KV-block bookkeeping included)."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    requests = pipe.add_requests(prompts.tolist(), params)
    try:
        pipe.step(requests, chunk_size=prompts.shape[1])
        while not all(r.finished for r in requests):
            start = time.perf_counter()
            pipe.step(requests, chunk_size=1)
            yield time.perf_counter() - start
    finally:
        for r in requests:
            pipe.release(r)


def decode_time_split(pipe: LocalPipeline, prompts: torch.Tensor) -> dict[str, float]:
    """Where a decode step's time goes, as fractions of profiled CPU time, by op family."""
    from torch.profiler import ProfilerActivity, profile

    families = {
        "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"),
        "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "ppserve::decode_attention"),
        "kv_cache_gather_and_write": ("aten::index_select", "aten::index_copy_"),
    }
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=9)
    requests = pipe.add_requests(prompts.tolist(), params)
    try:
        pipe.step(requests, chunk_size=prompts.shape[1])  # prefill, not profiled
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            while not all(r.finished for r in requests):
                pipe.step(requests, chunk_size=1)
    finally:
        for r in requests:
            pipe.release(r)
    self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(self_us.values())
    split = {name: sum(self_us.get(op, 0.0) for op in ops) / total for name, ops in families.items()}
    split["other"] = 1.0 - sum(split.values())
    return split


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
        # logits_to_keep=1: transformers too computes logits for the last position only.
        theirs = median_time(lambda: hf(long_prompt, use_cache=True, logits_to_keep=1), args.reps)
    results["prefill_1x512"] = {"ppserve_s": ours, "transformers_s": theirs, "ratio": theirs / ours}

    # Decode: the two engines take turns step by step (same batch, same context length at each
    # step), so drift in the machine's speed hits both alike; medians over all steps.
    for batch in (1, 16):
        prompts = torch.randint(10, SPEC.vocab_size, (batch, DECODE_PROMPT_LEN), generator=gen)
        ours_steps: list[float] = []
        theirs_steps: list[float] = []
        for rep in range(args.reps + 1):
            paired = zip(
                ppserve_decode_steps(pipe, prompts, DECODE_TOKENS),
                hf_decode_steps(hf, prompts, DECODE_TOKENS),
                strict=True,
            )
            for ours_t, theirs_t in paired:
                if rep:  # the first repetition is warm-up
                    ours_steps.append(ours_t)
                    theirs_steps.append(theirs_t)
        ours_tps = batch / statistics.median(ours_steps)
        theirs_tps = batch / statistics.median(theirs_steps)
        results[f"decode_batch{batch}"] = {
            "ppserve_tokens_per_s": ours_tps,
            "transformers_tokens_per_s": theirs_tps,
            "ratio": ours_tps / theirs_tps,
        }
    time_split = decode_time_split(pipe, prompts)

    report = {
        "benchmark": "model",
        "model": {"arch": "llama", "params": num_params, "dtype": "float32", **SPEC.__dict__},
        "threads": args.threads,
        "reps": args.reps,
        "prompt_tokens": {"prefill": PROMPT_LEN, "decode": DECODE_PROMPT_LEN},
        "decode_tokens": DECODE_TOKENS,
        "results": results,
        "ppserve_decode_batch16_time_split": time_split,
    }
    write_result(args.out, report, args)
    print(f"{num_params / 1e6:.1f}M params, {args.threads} threads (ratio > 1: ppserve faster)")
    for name, r in results.items():
        print(f"  {name:16s} " + "  ".join(f"{k}={v:.4g}" for k, v in r.items()))
    print("  ppserve decode (batch 16) time split: " + ", ".join(f"{k} {v:.0%}" for k, v in time_split.items()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
