"""The one-call decode step (engine/model/decode_step.py) against the same layers run as modules.

For each shape a random float32 checkpoint (scripts/make_tiny_checkpoint.py), and for each batch
size decode steps timed inside the engine's loop (scripts/step_times.py, one stage: the layers,
the logits and sampling), with the one call on and off in alternating rounds on the same loaded
model. Reports the median step of each side and their ratio per round, and the ratio of medians.

    python scripts/bench_decode_step.py [--shapes smollm2,qwen3-0.6b] [--batches 1,32] [--rounds 3]

Writes benchmarks/results/decode_step.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_record import write_result  # noqa: E402
from step_times import StepTimes  # noqa: E402

from ppserve.engine.config import EngineConfig  # noqa: E402
from ppserve.engine.offline import OfflineEngine  # noqa: E402
from ppserve.scheduler.sampling_params import SamplingParams  # noqa: E402

# make_tiny_checkpoint.py's arguments per shape.
SHAPES = {
    "smollm2": "--arch llama --hidden-size 576 --layers 30 --heads 9 --kv-heads 3 --intermediate-size 1536 "
    "--vocab-size 49152 --tie",  # SmolLM2-135M's shape
    "qwen3-0.6b": "--arch qwen3 --hidden-size 1024 --layers 28 --heads 16 --kv-heads 8 --head-dim 128 "
    "--intermediate-size 3072 --vocab-size 151936 --tie",  # Qwen3-0.6B's shape (q/k norms)
}


def step_ms(executor: StepTimes, cfg: EngineConfig, batch: int, context: int, steps: int) -> float:
    """The median decode step of `steps` for `batch` requests of `context` prompt tokens."""
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(10, cfg.model_config.vocab_size, (context,), generator=gen).tolist() for _ in range(batch)]
    warm_up = 2
    prefill_steps = -(-batch * context // cfg.max_batched_tokens)
    params = SamplingParams(max_tokens=2 + prefill_steps + warm_up + steps, temperature=0.0, ignore_eos=True)
    executor.batch, executor.times = batch, []
    OfflineEngine(cfg, executor).generate(prompts, params)
    return statistics.median(executor.times[warm_up : warm_up + steps]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="smollm2,qwen3-0.6b")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    batches = [int(b) for b in a.batches.split(",")]
    results: dict[str, dict[str, object]] = {}
    for shape in a.shapes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            make = [sys.executable, str(ROOT / "scripts/make_tiny_checkpoint.py"), "--out", tmp, *SHAPES[shape].split()]
            subprocess.run(make, check=True, capture_output=True)
            cfg = EngineConfig.create(
                tmp, pp_size=1, kv_cache_gb=2.0, enable_prefix_caching=False, chunked_prefill_size=4096
            )
            executor = StepTimes(cfg, batches[0])
            (runner,) = executor.runners
            one_call = runner.model.decode_step
            assert one_call is not None, f"{shape}: the one-call step does not apply"
            for batch in batches:
                rounds = []
                for _ in range(a.rounds):
                    ms = {}
                    for side, step in (("one_call", one_call), ("modules", None)):
                        runner.model.decode_step = step
                        ms[side] = step_ms(executor, cfg, batch, a.context, a.steps)
                    rounds.append({**ms, "ratio": ms["one_call"] / ms["modules"]})
                    print(shape, batch, rounds[-1], flush=True)
                runner.model.decode_step = one_call
                medians = {side: statistics.median(r[side] for r in rounds) for side in ("one_call", "modules")}
                results[f"{shape} batch {batch}"] = {
                    "step_ms_median": medians,
                    "ratio_of_medians": medians["one_call"] / medians["modules"],
                    "rounds": rounds,
                }
    result = {
        "benchmark": "decode_step",
        "shapes": {s: SHAPES[s] for s in a.shapes.split(",")},
        "context": a.context,
        "threads": a.threads,
        "results": results,
    }
    write_result(ROOT / "benchmarks/results/decode_step.json", result, a)


if __name__ == "__main__":
    main()
