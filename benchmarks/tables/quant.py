"""The tables of the quantized-weights benchmarks (benchmarks/quant.py,
benchmarks/quant_quality.py); rendered by `python -m benchmarks tables`."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.tables.format import Result, markdown, num


def table_quant_kernels(r: Sequence[Result]) -> list[str]:
    """ms per pass through every layer's linears and the head, per kind and row count."""
    d = r[0]
    ms = d["ms"]
    rows_m = list(ms["float32"])
    labels = {
        "float32": "float32, ppserve's GEMM (the engine's)",
        "float32-onednn": "float32, packed for oneDNN",
        # A run with both bfloat16 kinds had ppserve's bfloat16 GEMM as the engine's.
        "bfloat16": "bfloat16, ppserve's GEMM (the engine's)"
        if "bfloat16-onednn" in ms
        else "bfloat16, packed for oneDNN (the engine's)",
        "bfloat16-onednn": "bfloat16, packed for oneDNN",
        "int8": "int8, blocks of 32, ppserve's kernel",
        "int4": "int4, groups of 32, ppserve's kernel",
        "int8-torch": "int8 per row, torch's `_weight_int8pack_mm`",
        "int4-torch": "int4, groups of 32, torch's `_weight_int4pack_mm_for_cpu`",
    }
    rows = []
    for kind, label in labels.items():
        if kind not in ms:  # a result from before a kind was measured
            continue
        cells = [label]
        for m in rows_m:
            t = ms[kind][m]["layers_ms"] + ms[kind][m]["head_ms"]
            base = ms["float32"][m]["layers_ms"] + ms["float32"][m]["head_ms"]
            cells.append(f"{num(t)} ms" + ("" if kind == "float32" else f" ({num(t / base, 2)}x)"))
        rows.append(cells)
    return markdown(["weights (float32 activations)", *(f"M = {m}" for m in rows_m)], rows)


def table_quant_perplexity(r: Sequence[Result]) -> list[str]:
    d = r[0]
    scored = d["tokens"]["scored"]
    tokens = d["token_logprob_difference"]

    def per_token(key: str) -> str:  # against float32: the mean (what moves perplexity) and the mean size
        t = tokens[key]
        return f"{t['mean']:+.4f} ± {t['standard_error']:.4f} / {t['mean_abs']:.4f}"

    rows = [
        [
            "llama.cpp (`llama-perplexity`), the Q4_1 GGUF",
            num(d["llama_cpp"]["perplexity"], 4),
            "—",
            per_token("llama_cpp_vs_ppserve_none"),
        ],
        [
            "ppserve, kept quantized (`--quantization auto`)",
            num(d["ppserve_auto"]["perplexity"], 4),
            f"{num(100 * d['relative_difference']['ppserve_auto_vs_llama_cpp'], 3)}% from llama.cpp",
            per_token("ppserve_auto_vs_ppserve_none"),
        ],
        [
            "ppserve, dequantized to float32 (`--quantization none`)",
            num(d["ppserve_none"]["perplexity"], 4),
            f"{num(100 * d['relative_difference']['ppserve_none_vs_transformers'], 4)}% from transformers",
            "—",
        ],
        ["transformers, dequantized to float32", num(d["transformers"]["perplexity"], 4), "—", "—"],
    ]
    header = ["engine", f"perplexity ({scored} tokens)", "difference", "per token vs float32: mean ± s.e. / mean size"]
    return markdown(header, rows)
