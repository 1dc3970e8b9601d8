"""How long the demo model's GGUF takes to load: the first start (prepare, dequantize, cache), a
cached start, and the same weights as a safetensors directory; transformers' own GGUF loader for
comparison. Each case runs in a fresh process (imports included), in a private cache directory.

    .venv/bin/python scripts/bench_gguf_load.py [--rounds 3]

Writes benchmarks/results/gguf_load.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_record import write_result  # noqa: E402
from peers_setup import smollm2_hf_dir  # noqa: E402

from ppserve.server.demo import DEMO_MODEL, demo_model  # noqa: E402

# Loading as a PP=1 engine does: the config (preparing a GGUF), the tokenizer, the stage's weights.
ENGINE_LOAD = """import sys, time
t = time.perf_counter()
import torch
torch.set_num_threads(2)
from ppserve.engine.config import EngineConfig
from ppserve.engine.runtime.stage_runner import StageRunner
from ppserve.engine.model.tokenizer import Tokenizer
config = EngineConfig.create(sys.argv[1], num_kv_blocks=64, quantization=sys.argv[2])
Tokenizer(config.model)
StageRunner(config, 0)
print(time.perf_counter() - t)
"""
HF_LOAD = """import sys, time
from pathlib import Path
t = time.perf_counter()
import torch
torch.set_num_threads(2)
from transformers import AutoModelForCausalLM, AutoTokenizer
p = Path(sys.argv[1])
AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
print(time.perf_counter() - t)
"""


def timed(code: str, model: Path, cache: Path, quantization: str = "none") -> float:
    env = {**os.environ, "PPSERVE_CACHE_DIR": str(cache)}
    cmd = [sys.executable, "-c", code, str(model), quantization]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/gguf_load.json"))
    args = p.parse_args()
    gguf, hf_dir = demo_model(), smollm2_hf_dir()
    cases = ["gguf_first", "gguf_cached", "gguf_quantized", "safetensors", "transformers_gguf"]
    times: dict[str, list[float]] = {case: [] for case in cases}
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp)
            times["gguf_first"].append(timed(ENGINE_LOAD, gguf, cache))
            times["gguf_cached"].append(timed(ENGINE_LOAD, gguf, cache))
            times["gguf_quantized"].append(timed(ENGINE_LOAD, gguf, cache, "auto"))
            times["safetensors"].append(timed(ENGINE_LOAD, hf_dir, cache))
            times["transformers_gguf"].append(timed(HF_LOAD, gguf, cache))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    report = {
        "benchmark": "gguf_load",
        "model": f"{DEMO_MODEL} Q4_1 GGUF, PP=1 (config, tokenizer, weights): to float32, or kept quantized",
        "rounds": args.rounds,
        "seconds": times,
        "median_s": medians,
        "cached_start_adds_s": medians["gguf_cached"] - medians["safetensors"],
        "first_vs_transformers": medians["transformers_gguf"] / medians["gguf_first"],
    }
    write_result(args.out, report, args)
    print(json.dumps({k: report[k] for k in ("median_s", "cached_start_adds_s", "first_vs_transformers")}, indent=2))


if __name__ == "__main__":
    main()
