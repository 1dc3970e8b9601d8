"""The kernel chooser's table on this machine (engine/model/kernel_choice.py): every float linear shape
of three model shapes, timed with each candidate kernel at the chooser's row counts, and what each
mode picks. The CPU's model and flags are in the result's `machine` (AMX or not, AVX-512 or AVX2).

    .venv/bin/python -m benchmarks kernel-choice           # about a minute on 2 cores

Writes benchmarks/results/kernel_choice.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.record import write_result
from ppserve.engine.model import cpu_kernels, kernel_choice
from ppserve.engine.model.amx import amx
from ppserve.engine.model.kernel_choice import ROWS, KernelChooser
from ppserve.engine.model.linear import chosen_kernels

ROOT = Path(__file__).resolve().parent.parent

# (out, in, gated) of each model's fused linears: q/k/v, o, gate/up, down, the head.
SHAPES = {
    "smollm2": [(960, 576, False), (576, 576, False), (3072, 576, True), (576, 1536, False), (49152, 576, False)],
    "small": [(1536, 768, False), (768, 768, False), (4096, 768, True), (768, 2048, False), (32000, 768, False)],
    "qwen2.5-0.5b": [(1152, 896, False), (896, 896, False), (9728, 896, True), (896, 4864, False)],
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/kernel_choice.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    timed: dict[str, dict[str, list[float]]] = {}
    real = kernel_choice.time_kernels

    def recording(run: Any, rows: Any = ROWS) -> dict[str, list[float]]:
        times = real(run, rows)
        timed[current] = {k: [round(t * 1e3, 4) for t in v] for k, v in times.items()}
        return times

    kernel_choice.time_kernels = recording
    report: dict[str, Any] = {"rows": list(ROWS), "library": cpu_kernels.library_name(), "amx": amx()}
    models: dict[str, Any] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in (torch.float32, torch.bfloat16):
            for model, shapes in SHAPES.items():
                # a table of its own per model: a shape two models share is timed for each
                chooser = KernelChooser(Path(tmp) / f"{model}-{dtype}.json", "fastest")
                rows = []
                for out, inp, gated in shapes:
                    current = f"{model} {dtype} {out}x{inp}{' gated' if gated else ''}"
                    w = torch.randn(out, inp).to(dtype)
                    invariant = chosen_kernels(KernelChooser(Path(tmp) / f"inv-{model}.json"), w, None, gated)
                    fastest = chosen_kernels(chooser, w, None, gated)
                    rows.append({
                        "shape": current, "ms": timed.get(current), "fastest": fastest, "invariant": invariant,
                    })  # fmt: skip
                    print(f"{current}: fastest {fastest}, invariant {invariant}, ms {timed.get(current)}", flush=True)
                models[f"{model} {str(dtype).removeprefix('torch.')}"] = rows
    report["models"] = models
    report["seconds"] = round(time.perf_counter() - start, 1)
    write_result(args.out, {"benchmark": "kernel_choice", **report}, args)
