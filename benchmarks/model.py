"""Model-core speed against transformers on the same weights, side by side in one run.

Measures prefill of one 512-token prompt and greedy decode at batch 1 and 16 on a ~50M-parameter
float32 Llama, with the same torch thread count for both. Ratios are transformers time / ppserve
time (> 1 means ppserve is faster). Writes benchmarks/results/model.json.

    python -m benchmarks model [--threads 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.harness.record import write_result
from ppserve.engine.config import EngineConfig
from ppserve.engine.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint
from ppserve.engine.offline import OfflineEngine
from ppserve.engine.runtime.executors import InProcessExecutor
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.transport.messages import StepPlan, StepResult

ROOT = Path(__file__).resolve().parent.parent

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


class StepTimes(InProcessExecutor):
    """Decode steps of one batch, timed (and optionally profiled) inside the engine's own loop.

    The in-process executor with a stopwatch: the `EngineCore` plans as it always does, and every
    plan in which each request of the batch decodes one token is timed (the forward pass of every
    stage and sampling; the scheduler's share is not in it). A batch runs through
    `OfflineEngine(config, StepTimes(...))` and the times are read afterwards."""

    def __init__(
        self,
        config: EngineConfig,
        batch: int,
        after_step: Callable[[], object] | None = None,
        profiled: range = range(0),
    ) -> None:
        super().__init__(config)
        self.batch = batch
        self.after_step = after_step  # run after each timed step, outside its time (a peer's step)
        self.profiled = profiled  # which decode steps (by index) to profile
        self.times: list[float] = []  # seconds per decode step of the whole batch
        self.profile: profile | None = None
        self.profiled_all = False  # every step of `profiled` ran, and the profile stopped

    def run(self, plan: StepPlan) -> StepResult:
        if len(plan.chunks) != self.batch or any(c.num_new != 1 for c in plan.chunks):
            return super().run(plan)  # prefill, or not every request decoding yet
        step = len(self.times)
        if step == self.profiled.start and self.profiled:
            # Started here, on the compute thread, so that it records this thread's ops.
            self.profile = profile(activities=[ProfilerActivity.CPU])
            self.profile.start()
        start = time.perf_counter()
        result = super().run(plan)
        self.times.append(time.perf_counter() - start)
        if self.profile is not None and step == self.profiled.stop - 1:
            self.profile.stop()
            self.profiled_all = True
        if self.after_step is not None:
            self.after_step()
        return result


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
    its own KV cache. Yields the time of each decode step (argmax included). Inference mode is
    entered and left around each step, never held across a yield: the generator is advanced on
    the engine's compute thread, and a mode left open there would leak into that thread."""
    with torch.inference_mode():
        out = model(prompts, use_cache=True)
        cache = out.cache
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(new_tokens - 1):
        with torch.inference_mode():
            start = time.perf_counter()
            out = model(token, cache=cache, use_cache=True)
            cache = out.cache
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            seconds = time.perf_counter() - start
        yield seconds


def paired_decode_steps(
    config: EngineConfig, hf: torch.nn.Module, prompts: torch.Tensor, new_tokens: int
) -> tuple[list[float], list[float]]:
    """The two engines take turns step by step on the same batch: a decode step of this engine
    (forward and sampling, in its own loop), then one of transformers, so that drift in the
    machine's speed hits both alike. Returns both engines' step times."""
    hf_steps = hf_decode_steps(hf, prompts, new_tokens)
    theirs: list[float] = []
    executor = StepTimes(config, prompts.shape[0], after_step=lambda: theirs.append(next(hf_steps)))
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    OfflineEngine(config, executor).generate(prompts.tolist(), params)
    executor.close()
    return executor.times, theirs


def decode_time_split(config: EngineConfig, prompts: torch.Tensor) -> dict[str, float]:
    """Where a decode step's time goes, as fractions of profiled CPU time, by op family."""
    families = {
        "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"),
        "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "ppserve::decode_attention"),
        "kv_cache_gather_and_write": ("aten::index_select", "aten::index_copy_"),
    }
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=9)
    executor = StepTimes(config, prompts.shape[0], profiled=range(0, 8))  # every decode step
    OfflineEngine(config, executor).generate(prompts.tolist(), params)
    executor.close()
    assert executor.profile is not None
    self_us = {e.key: e.self_cpu_time_total for e in executor.profile.key_averages()}
    total = sum(self_us.values())
    split = {name: sum(self_us.get(op, 0.0) for op in ops) / total for name, ops in families.items()}
    split["other"] = 1.0 - sum(split.values())
    return split


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/model.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(Path(tmp) / "bench-llama", SPEC)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        num_params = sum(t.numel() for t in hf.parameters())
        # Each prompt prefilled in one chunk and computed every time (no cache hits).
        config = EngineConfig.create(
            model_dir, kv_cache_gb=1.0, chunked_prefill_size=PROMPT_LEN, enable_prefix_caching=False
        )
        pipe = OfflineEngine(config)

        gen = torch.Generator().manual_seed(0)
        long_prompt = torch.randint(10, SPEC.vocab_size, (1, PROMPT_LEN), generator=gen)
        greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
        results: dict[str, dict[str, float]] = {}

        # Prefill: the whole prompt in one chunk, first token sampled.
        ours = median_time(lambda: pipe.generate(long_prompt.tolist(), greedy), args.reps)
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
                ours_t, theirs_t = paired_decode_steps(config, hf, prompts, DECODE_TOKENS)
                if rep:  # the first repetition is warm-up
                    ours_steps += ours_t
                    theirs_steps += theirs_t
            ours_tps = batch / statistics.median(ours_steps)
            theirs_tps = batch / statistics.median(theirs_steps)
            results[f"decode_batch{batch}"] = {
                "ppserve_tokens_per_s": ours_tps,
                "transformers_tokens_per_s": theirs_tps,
                "ratio": ours_tps / theirs_tps,
            }
        time_split = decode_time_split(config, prompts)

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
