"""The tables of the structured-output benchmarks (benchmarks/structured.py, and
grammar_engines.json, from an earlier study); rendered by `python -m benchmarks tables`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.tables.format import Result, bold, markdown, num


def table_structured(r: Sequence[Result]) -> list[str]:
    """Constrained against unconstrained bursts, per setting: tokens/s, TTFT, and their ratios. The
    first result's in-process and HTTP columns, then any further result's in-process ones (a
    longer run) labelled with their rounds."""
    d = r[0]
    # (column, medians, median of the rounds' paired throughput ratios or None)
    columns: list[tuple[str, dict[str, Any], float | None]] = [
        (f"demo (int4), PP={run['pp']}, in-process", run["median"], run.get("paired_throughput_ratio"))
        for run in d["runs"]
    ]
    http = d.get("http") or {}
    for name, key in (("ppserve", "ppserve-pp1"), ("vLLM", "vllm")):
        if key in http:
            paired = http[key]["constrained_over_unconstrained"].get("paired_tok_s")
            columns.append((f"{name}, float32, HTTP", http[key]["median"], paired))
    for longer in r[1:]:
        rounds = longer["settings"]["rounds"]
        for run in longer["runs"]:
            name = f"demo (int4), PP={run['pp']}, in-process, {rounds} rounds"
            columns.append((name, run["median"], run.get("paired_throughput_ratio")))

    def ratio(m: dict[str, Any], key: str) -> float:
        return float(m["constrained"][key] / m["unconstrained"][key])

    def optional(m: dict[str, Any], key: str) -> str:  # (not measured over HTTP, nor by older runs)
        return num(ratio(m, key), 3) if key in m["constrained"] else ""

    ratios = [(ratio(m, "tok_s"), ratio(m, "ttft_p50_s")) for _, m, _ in columns]
    rows = [
        ["output tokens/s, unconstrained", *(num(m["unconstrained"]["tok_s"], 0) for _, m, _ in columns)],
        ["output tokens/s, JSON schema", *(num(m["constrained"]["tok_s"], 0) for _, m, _ in columns)],
        ["ratio (target >= 0.95)", *(bold(num(t, 3), t >= 0.95) for t, _ in ratios)],
        ["ratio of each round's two bursts, median", *(num(p, 3) if p is not None else "" for _, _, p in columns)],
        ["TTFT p50 ratio (target <= 1.10)", *(bold(num(f, 3), f <= 1.10) for _, f in ratios)],
        ["CPU time per output token (all processes), ratio", *(optional(m, "cpu_ms_per_token") for _, m, _ in columns)],
        ["last stage's decode step, median, ratio", *(optional(m, "last_stage_decode_ms") for _, m, _ in columns)],
    ]
    g = d["grammar"]
    lines = markdown(["", *(name for name, _, _ in columns)], rows)
    lines += [
        "",
        f"The schema compiled in {num(g['compile_first_ms'], 2)} ms the first time, "
        f"{num(g['compile_cached_ms'] * 1000, 0)} µs from the cache. Along the model's own replies a mask "
        f"took {num(g['mask_us_p50'], 1)} µs at the median, {num(g['mask_us_p90'], 0)} µs at p90 and "
        f"{num(g['mask_us_p99'], 0)} µs at p99 (mean {num(g['mask_us_mean'], 1)} µs): "
        f"{num(g['masks_ms_per_step_mean'], 2)} ms of masks per step at {d['settings']['requests']} streams.",
    ]
    return lines


def table_grammar_engines(r: Sequence[Result]) -> list[str]:
    """llguidance against xgrammar: install size, compile time, mask time."""
    d = r[0]
    engines = ("llguidance", "xgrammar")

    def installed(e: str) -> str:
        sizes = d[e]["installed_mb"]
        return " + ".join(f"{name} {num(mb, 1)}" for name, mb in sizes.items())

    def requirements(e: str) -> str:
        return ", ".join(x.split(";")[0].split(">")[0] for x in d[e]["requires"]) or "none"

    def masks(e: str) -> str:
        return f"{num(d[e]['mask_us_p50'], 1)} / {num(d[e]['mask_us_max'], 0)}"

    rows = [
        ["version", *(d[e]["version"] for e in engines)],
        ["installed, MB (with its heavy dependencies)", *(installed(e) for e in engines)],
        [
            "other requirements",
            *(", ".join(x.split(";")[0].split(">")[0] for x in d[e]["requires"]) or "none" for e in engines),
        ],
        ["compile the schema, ms", *(num(d[e]["compile_ms"], 1) for e in engines)],
        ["tokenizer set-up, ms (once per model)", *(num(d[e]["tokenizer_setup_ms"], 0) for e in engines)],
        [
            "mask per request and token, µs: p50 / max",
            *(f"{num(d[e]['mask_us_p50'], 1)} / {num(d[e]['mask_us_max'], 0)}" for e in engines),
        ],
    ]
    return markdown(["", *engines], rows)
