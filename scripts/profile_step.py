"""Where a decode step's time goes, in one process: the model of one stage, op by op.

Prefills `--batch` requests of `--context` tokens, then times `--steps` decode steps of the
whole batch (all layers, logits and sampling) inside the engine's own loop (scripts/step_times.py).
Where the engine runs a decode step's layers in one call (engine/model/decode_step.py), which the
profiler sees as one opaque call, it then times `--steps` more with the layers run as modules, the
same kernels one by one. Those are what it profiles, grouping the ops' self time with
torch.profiler: GEMMs, attention, KV gather, KV write, norms/RoPE/activations, sampling, and the rest.
What no op accounts for is Python (the per-layer module calls and the attention metadata) and the
CPU kernels that the profiler cannot see (engine/model/cpu_kernels.py: the residual add with
RMSNorm, SiLU * up, RoPE with the cache write; decode attention is named, as
ppserve::decode_attention, and so are ppserve's float and quantized GEMMs, here only, while the
profiler runs).

    python scripts/profile_step.py --model-dir DIR [--batch 64] [--context 200] [--dtype float32]

Writes benchmarks/results/profile_step[_TAG].json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_record import write_result  # noqa: E402
from step_times import StepTimes  # noqa: E402

from ppserve.engine.config import EngineConfig  # noqa: E402
from ppserve.engine.model import cpu_kernels, linear  # noqa: E402
from ppserve.engine.offline import OfflineEngine  # noqa: E402
from ppserve.scheduler.sampling_params import SamplingParams  # noqa: E402

# Op name -> group. First match wins; anything unmatched is "other ops".
GROUPS: list[tuple[str, tuple[str, ...]]] = [
    (
        "gemm",
        (
            "aten::_weight_int",
            "aten::mm",
            "aten::addmm",
            "aten::linear",
            "mkldnn",
            "mkl_linear",
            "aten::matmul",
            "onednn",
            "ppserve::float_gemm",
            "ppserve::quant_gemm",
        ),
    ),
    (
        "attention",
        (
            "ppserve::decode_attention",
            "scaled_dot_product",
            "flash_attention",
            "aten::bmm",
            "aten::baddbmm",
            "_softmax",
        ),
    ),
    ("kv gather", ("aten::index_select",)),
    ("kv write", ("aten::index_copy",)),
    (
        "norm, rope, activation",
        ("aten::mul", "aten::add", "aten::rsqrt", "aten::pow", "aten::mean", "aten::silu", "aten::flip", "aten::neg"),
    ),
    ("sampling", ("aten::argmax", "aten::topk", "aten::sort", "aten::log_softmax", "aten::multinomial")),
    ("embedding", ("aten::embedding",)),
]


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other ops"


def name_in_profiles() -> None:
    """Calls of ppserve's GEMMs (ctypes, invisible to the profiler) as ops named ppserve::KERNEL while
    the profiler runs (the check costs a fraction of a microsecond a call; the engine itself does not
    name them)."""
    call = cpu_kernels.PackedGemm.__call__

    def named(self: cpu_kernels.PackedGemm, x: torch.Tensor) -> torch.Tensor:
        if not torch.autograd.profiler._is_profiler_enabled:
            return call(self, x)
        with torch.profiler.record_function(f"ppserve::{self.kernel}"):
            return call(self, x)

    cpu_kernels.PackedGemm.__call__ = named  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="none", choices=["auto", "none", "int8"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--linear-kernel", choices=linear.KERNELS, help="the float linears' kernel (default: the engine's)")
    p.add_argument("--tag", default="")
    a = p.parse_args()
    if a.linear_kernel:
        linear.default_kernel = lambda device, dtype: a.linear_kernel
    name_in_profiles()
    torch.set_num_threads(a.threads)
    # Every prompt prefilled once (no cache hits), in one chunk.
    cfg = EngineConfig.create(
        a.model_dir,
        pp_size=1,
        dtype=a.dtype,
        quantization=a.quantization,
        kv_cache_gb=2.0,
        enable_prefix_caching=False,
        chunked_prefill_size=max(512, a.context),
        kernel_choice="off" if a.linear_kernel else "invariant",  # a kernel named: that one
    )
    warm_up = 3
    timed = range(warm_up, warm_up + a.steps)  # the engine's steps
    modules = range(timed.stop, timed.stop + a.steps)  # the layers as modules: timed, then profiled
    executor = StepTimes(cfg, a.batch, profiled=range(modules.stop, modules.stop + a.steps))
    (runner,) = executor.runners
    one_call = runner.model.decode_step

    def after_step() -> None:
        if len(executor.times) == timed.stop:
            runner.model.decode_step = None

    executor.after_step = after_step
    gen = torch.Generator().manual_seed(0)
    vocab = cfg.model_config.vocab_size
    prompts = [torch.randint(10, vocab, (a.context,), generator=gen).tolist() for _ in range(a.batch)]
    # The early prompts decode while the later ones prefill (up to max_batched_tokens a step): those
    # steps are not of the whole batch, so each request generates enough for 2 * steps after them.
    prefill_steps = -(-a.batch * a.context // cfg.max_batched_tokens)
    params = SamplingParams(max_tokens=2 + prefill_steps + warm_up + 3 * a.steps, temperature=0.0, ignore_eos=True)
    OfflineEngine(cfg, executor).generate(prompts, params)
    step_s = statistics.median(executor.times[timed.start : timed.stop])
    modules_s = statistics.median(executor.times[modules.start : modules.stop])
    prof = executor.profile
    assert prof is not None and executor.profiled_all, "too few decode steps of the whole batch to profile"
    groups: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        groups[group_of(ev.key)] += ev.self_cpu_time_total / 1e6 / a.steps
        ops[ev.key] += ev.self_cpu_time_total / 1e6 / a.steps
    profiled = sum(groups.values())
    # What no op accounts for in the unprofiled module-by-module step is Python: module calls and metadata.
    result = {
        "benchmark": "profile_step",
        "model_dir": a.model_dir,
        "dtype": a.dtype,
        "quantization": a.quantization,
        "batch": a.batch,
        "context": a.context,
        "threads": a.threads,
        "step_ms": step_s * 1e3,
        "one_call_layers": one_call is not None,
        "modules_step_ms": modules_s * 1e3,
        "ms_per_group": {g: v * 1e3 for g, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "python_and_dispatch_ms": max(0.0, modules_s - profiled) * 1e3,
        "top_ops_ms": {k: v * 1e3 for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:15]},
    }
    print(json.dumps(result, indent=2))
    out = ROOT / "benchmarks/results" / (f"profile_step_{a.tag}.json" if a.tag else "profile_step.json")
    write_result(out, result, a)


if __name__ == "__main__":
    main()
