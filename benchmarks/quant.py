"""Weight-only quantized GEMMs against the packed float linears, on a model's own layer shapes.

For each row count M (1: batch-1 decode, 32: 32 streams decoding, 256 and 1024: prefill), times
one pass through every linear of every layer (q/k/v, o, gate/up, down: 30 layers of SmolLM2's
shapes by default, so that the weights do not fit in the caches, as in a real step), and the
head, for:
- float32 and bfloat16 as the engine runs them (engine/model/linear.py: ppserve's GEMM where it is
  built, bfloat16's where the CPU has AVX-512 BF16), and both packed for oneDNN;
- int8 and int4 in blocks of 32 through engine/model/quantized.py's QuantLinear with a float32
  model's activations, by each of its CPU kernels: ppserve's (int8 activations and integer dot
  products, engine/model/cpu_gemm.cpp) and torch's (`_weight_int8pack_mm` with one scale per
  row, `_weight_int4pack_mm_for_cpu`; activations converted to bfloat16 and back).

    .venv/bin/python -m benchmarks quant [--hidden 576 --intermediate 1536 --layers 30 ...]

Writes benchmarks/results/quant_kernels.json: milliseconds per pass (median of --repeats rounds,
the kinds alternating within each), and each quantized kernel's time relative to the float linears.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.harness.record import write_result
from ppserve.engine.model import cpu_kernels
from ppserve.engine.model.linear import Linear
from ppserve.engine.model.quantized import GROUP, QuantLinear, QuantWeight, quantize_int8

ROOT = Path(__file__).resolve().parent.parent

CPU = torch.device("cpu")
# The float linears as the engine runs them (ppserve's GEMM where it is built), and through oneDNN's
# packed weights, as the engine ran them before.
FLOAT_KINDS = ["float32", "bfloat16", "float32-onednn", "bfloat16-onednn"]


def int4_weight(w: torch.Tensor) -> QuantWeight:
    """w in int4 groups of 32: asymmetric, min to max over each group (as Q4_1 does)."""
    out, inp = w.shape
    groups = w.view(out, inp // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).view(out, inp)
    return QuantWeight(4, q, scale, lo + 8 * scale)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rows", default="1,32,256,1024", help="row counts M to time")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    head_dim = a.hidden // a.heads
    qkv = (a.heads + 2 * a.kv_heads) * head_dim
    shapes = [(qkv, a.hidden), (a.hidden, a.heads * head_dim), (2 * a.intermediate, a.hidden)]
    shapes += [(a.hidden, a.intermediate)]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.05 for _ in range(a.layers) for n, k in shapes]
    head = torch.randn(a.vocab, a.hidden, generator=gen) * 0.05

    def make(kind: str, w: torch.Tensor) -> torch.nn.Module:
        if kind in FLOAT_KINDS:
            dtype, _, kernel = kind.partition("-")
            return Linear(w.to(getattr(torch, dtype)), None, kernel or None)
        bits, _, kernel = kind.partition("-")
        qw = quantize_int8(w) if bits == "int8" else int4_weight(w)
        return QuantLinear(qw, None, torch.float32, CPU, kernel or "ppserve")

    rows = [int(r) for r in a.rows.split(",")]
    quantized = ("int8", "int4", "int8-torch", "int4-torch")  # bare: ppserve's kernel
    kinds = [*FLOAT_KINDS, *quantized]
    for name in ("float32", "bfloat16"):
        if not cpu_kernels.float_gemm_available(CPU, getattr(torch, name)):
            kinds.remove(f"{name}-onednn")  # the engine's is oneDNN's already
    models = {kind: ([make(kind, w) for w in weights], make(kind, head)) for kind in kinds}
    results: dict[str, dict[str, dict[str, float]]] = {kind: {} for kind in kinds}
    for m in rows:
        xs = {
            dtype: {k: torch.randn(m, k, generator=gen).to(dtype) for k in {k for _, k in shapes}}
            for dtype in (torch.float32, torch.bfloat16)
        }
        times: dict[str, dict[str, list[float]]] = {kind: {"layers_ms": [], "head_ms": []} for kind in kinds}
        with torch.inference_mode():
            for r in range(a.repeats + 1):  # kinds alternate within each round; the first is a warm-up
                for kind in kinds:
                    layers, head_layer = models[kind]
                    x = xs[torch.bfloat16 if kind.startswith("bfloat16") else torch.float32]
                    layers_ms = timed(lambda: [lin(x[lin.in_features]) for lin in layers])  # noqa: B023
                    head_ms = timed(lambda: head_layer(x[a.hidden]))  # noqa: B023
                    if r:
                        times[kind]["layers_ms"].append(layers_ms)
                        times[kind]["head_ms"].append(head_ms)
        for kind in kinds:
            results[kind][str(m)] = {k: statistics.median(v) for k, v in times[kind].items()}
            t = results[kind][str(m)]
            print(f"{kind:14s} M={m:4d}: layers {t['layers_ms']:8.2f} ms, head {t['head_ms']:7.2f} ms", flush=True)
    pairs = [(q, f) for q in quantized for f in ("float32", "bfloat16")] + [
        ("int8", "int8-torch"),
        ("int4", "int4-torch"),
    ]
    pairs += [(f, f"{f}-onednn") for f in ("float32", "bfloat16") if f"{f}-onednn" in kinds]
    ratios = {
        f"{q}_vs_{f}": {
            m: (results[q][m]["layers_ms"] + results[q][m]["head_ms"])
            / (results[f][m]["layers_ms"] + results[f][m]["head_ms"])
            for m in results[q]
        }
        for q, f in pairs
    }
    out = ROOT / "benchmarks/results/quant_kernels.json"
    shape = {"hidden": a.hidden, "intermediate": a.intermediate, "layers": a.layers, "heads": a.heads}
    shape |= {"kv_heads": a.kv_heads, "vocab": a.vocab}
    record = {"benchmark": "quant_kernels", "shape": shape, "threads": a.threads, "ms": results}
    write_result(out, record | {"time_ratio": ratios}, a)
