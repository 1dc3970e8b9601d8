"""Render the documentation's benchmark tables from the results JSONs.

A table in README.md or docs/*.md sits between two markers that name it:

    <!-- bench-table: peers_smollm2 -->
    | ... the table, and a line saying what it was measured at ... |
    <!-- /bench-table -->

    .venv/bin/python -m benchmarks tables              # rewrite every marked table from its JSON
    .venv/bin/python -m benchmarks tables --check      # exit 1, naming each table that differs

tests/repo/test_bench_tables.py runs the check. Run this after a benchmark, then read the prose around
each table: it quotes some of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.tables.format import Result, bold, markdown, num, thousands, us_or_ms
from benchmarks.tables.models import table_big_model, table_big_model_speed, table_gguf_load
from benchmarks.tables.peers import (
    AVX2_COLUMNS,
    TARGET_COLUMNS,
    sources,
    table_ab_throughput,
    table_peers_avx2,
    table_peers_quantized,
    table_peers_smollm2,
    table_peers_targets,
)
from benchmarks.tables.quant import table_quant_kernels, table_quant_perplexity
from benchmarks.tables.speculative import table_speculative, table_speculative_pp2
from benchmarks.tables.structured import table_grammar_engines, table_structured

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = re.compile(r"<!-- bench-table: (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /bench-table -->", re.DOTALL)


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


# --- formatting -------------------------------------------------------------------------------


def provenance_line(names: Sequence[str], results: Sequence[Result], doc_dir: Path, root: Path) -> str:
    """One line under the table: the commit, the machine and the JSON of each result."""
    parts = []
    for name, r in zip(names, results, strict=True):
        link = f"[`{name}`]({os.path.relpath(root / 'benchmarks' / 'results' / name, doc_dir)})"
        commit = r.get("commit")
        if not commit:
            parts.append(f"{link}: commit not recorded (an older result)")
            continue
        m = r.get("machine", {})
        machine = ", ".join(
            str(x)
            for x in (
                f"{m['cpus']} cores" if m.get("cpus") else None,
                m.get("cpu_model"),
                f"torch {m['torch']}" if m.get("torch") else None,
            )
            if x
        )
        dirty = ", with uncommitted changes" if r.get("dirty") else ""
        parts.append(f"{link}: commit `{commit[:12]}`{dirty}" + (f" ({machine})" if machine else ""))
    return "Measured at: " + "; ".join(parts) + "."


# --- the tables -------------------------------------------------------------------------------


def table_profile_step(results: Sequence[Result]) -> list[str]:
    groups = [
        ("GEMMs (all linear layers, logits)", ["gemm"]),
        ("attention", ["attention"]),
        ("KV gather", ["kv gather"]),
        ("norms, RoPE, activation", ["norm, rope, activation"]),
        ("KV write", ["kv write"]),
        ("sampling", ["sampling"]),
        ("other ops", ["other ops", "embedding"]),
    ]
    rows = [
        [label] + [f"{num(sum(r['ms_per_group'].get(k, 0.0) for k in keys))} ms" for r in results]
        for label, keys in groups
    ]
    rows.append(
        ["what no op accounts for (Python, dispatch)"] + [f"{num(r['python_and_dispatch_ms'])} ms" for r in results]
    )
    # The rows above add up to the step with the layers run as modules; the engine's step runs a
    # decode step's layers in one call where it can (engine/model/decode_step.py).
    rows.append(["step, the layers as modules"] + [f"{num(r['modules_step_ms'])} ms" for r in results])
    engine = [r["step_ms"] if r["one_call_layers"] else r["modules_step_ms"] for r in results]
    rows.append(["**step, the engine's** (one call where it applies)"] + [bold(f"{num(ms)} ms") for ms in engine])
    header = ["per step", "float32, F.linear + SDPA", "float32, now", "bfloat16, now"]
    header.append(f"realistic shape, batch {results[3]['batch']}, {results[3]['dtype']}")
    return markdown(header, rows)


def table_model(results: Sequence[Result]) -> list[str]:
    d = results[0]
    res = d["results"]
    pre, b1, b16 = res["prefill_1x512"], res["decode_batch1"], res["decode_batch16"]
    header = [
        f"measurement ({num(d['model']['params'] / 1e6)}M-param {d['model']['dtype']} Llama, {d['threads']} threads)"
    ]
    rows = [
        [
            "prefill 1 x 512 tokens",
            f"{num(pre['ppserve_s'] * 1e3, 0)} ms",
            f"{num(pre['transformers_s'] * 1e3, 0)} ms",
            num(pre["ratio"], 2),
        ],
        [
            "decode, batch 1",
            f"{num(b1['ppserve_tokens_per_s'])} tok/s",
            f"{num(b1['transformers_tokens_per_s'])} tok/s",
            num(b1["ratio"], 2),
        ],
        [
            "decode, batch 16",
            f"{num(b16['ppserve_tokens_per_s'], 0)} tok/s",
            f"{num(b16['transformers_tokens_per_s'], 0)} tok/s",
            num(b16["ratio"], 2),
        ],
    ]
    return markdown([*header, "ppserve", "transformers", "ratio"], rows)


def table_pipeline(results: Sequence[Result]) -> list[str]:
    d = results[0]
    dec, over = d["decode_64_concurrent"], d["overhead_pp4_near_zero_compute"]
    n = dec["requests"]
    rows = [
        [
            f"decode, {n} concurrent requests, {num(dec['model_params_m'], 0)}M-param Llama: PP=1 (1 thread)",
            f"{num(dec['pp1_tokens_per_s'], 0)} tok/s",
        ],
        [
            "the same, PP=2 (1 thread per stage)",
            f"{num(dec['pp2_tokens_per_s'], 0)} tok/s (ratio {num(dec['ratio_pp2_over_pp1'], 2)})",
        ],
        ["micro-batches per second through PP=4, near-zero compute", num(over["micro_batches_per_s"], 0)],
        [
            "stage-to-stage hop (compute end to next compute start) / raw ZeroMQ round trip",
            f"{us_or_ms(over['hop_us_median'])} / {us_or_ms(over['raw_zmq_round_trip_us'])}",
        ],
    ]
    lines = markdown([f"measurement ({d.get('machine', {}).get('cpus', 2)}-core CPU)", "figure"], rows)
    channels = d["channel_round_trip_us"]
    sizes = list(next(iter(channels.values())))
    size_names = {"1024": "1 KB", "1048576": "1 MB", "67108864": "64 MB"}
    lines.append("")
    lines += markdown(
        ["tensor channel round trip", *(size_names.get(s, f"{s} B") for s in sizes)],
        [[kind, *(us_or_ms(rt[s]) for s in sizes)] for kind, rt in channels.items()],
    )
    return lines


MULTINODE_LABELS = {
    "one namespace": "one namespace",
    "bridge": "four namespaces, bridge",
    "link +0 ms": "user-space link, +0 ms",
    "link +1 ms": "user-space link, +1 ms",
    "link +5 ms": "user-space link, +5 ms",
    "bridge, zmq": "bridge, `--tensor-transport zmq`",
    "link +5 ms, zmq": "user-space link +5 ms, `zmq`",
}


def table_multinode(results: Sequence[Result]) -> list[str]:
    d = results[0]
    cpus = d.get("machine", {}).get("cpus", 2)
    header = [f"PP={d['model']['pp_size']}, {cpus}-core CPU", "1 stream, tok/s", f"{d['streams']} streams, tok/s"]
    rows = _node_rows(d["results"], MULTINODE_LABELS, d["results"]["one namespace"])
    return markdown([*header, "hops 0→1 / 1→2 / 2→3, ms"], rows)


RAY_LABELS = {
    "nnodes": "`--nnodes`",
    "nnodes beside idle Ray": "`--nnodes`, an idle Ray cluster beside",
    "ray": "`--executor ray` (STRICT_SPREAD)",
}


def table_multinode_ray(results: Sequence[Result]) -> list[str]:
    d = results[0]["ray"]
    header = [f"PP=4 over 4 namespaces, medians of {d['rounds']} rounds", "1 stream, tok/s", "16 streams, tok/s"]
    return markdown([*header, "hops, ms"], _node_rows(d["medians"], RAY_LABELS, d["medians"]["nnodes"]))


def _node_rows(runs: dict[str, Any], labels: dict[str, str], base: dict[str, Any]) -> list[list[str]]:
    """A row per setup: tok/s of one stream and of many (each with its ratio to `base`), and hops."""
    return [
        [
            labels.get(name, name),
            *(f"{num(r[k])} ({num(r[k] / base[k], 2)})" for k in ("single_stream_tok_s", "batch_tok_s")),
            " / ".join(num(h, 2) for h in r["hop_ms"]),
        ]
        for name, r in runs.items()
    ]


def table_pd(results: Sequence[Result]) -> list[str]:
    d = results[0]
    c, p = d["colocated"], d["pd"]
    handover = d["ratios"]["handover_s"]
    rows = [
        [
            "inter-token latency of the streams, p50 / p99",
            f"{num(c['itl_p50_ms'])} / {num(c['itl_p99_ms'])} ms",
            f"{num(p['itl_p50_ms'])} / {num(p['itl_p99_ms'])} ms",
        ],
        [
            "decode tokens while the long prompts arrive",
            thousands(c["decode_tokens_in_window"]),
            thousands(p["decode_tokens_in_window"]),
        ],
        [
            "time to first token of a long prompt, under load",
            f"{num(c['long_ttft_median_s'], 2)} s",
            f"{num(p['long_ttft_median_s'], 2)} s",
        ],
        ["the same on an idle deployment", f"{num(c['idle_ttft_s'], 2)} s", f"{num(p['idle_ttft_s'], 2)} s"],
        [
            "the prefill engine alone, idle (so the handover adds)",
            "",
            f"{num(p['prefill_engine_alone_idle_ttft_s'], 2)} s ({'+' if handover >= 0 else ''}{num(handover, 3)} s)",
        ],
    ]
    cpus = d.get("machine", {}).get("cpus", 2)
    return markdown([f"{cpus}-core CPU", "colocated (PP=2)", "PD (1 + 1)"], rows)


def table_serving(results: Sequence[Result]) -> list[str]:
    d = results[0]
    h, i = d["modes"]["http"], d["modes"]["in-process"]

    def pcts(m: dict[str, float], stat: str) -> str:
        return " / ".join(num(m[f"{stat}_ms_p{q}"], 0) for q in (50, 90, 99)) + " ms"

    rate = (d.get("settings") or d.get("config") or {}).get("request_rate", "inf")
    rows = [
        [
            "output tokens/s",
            num(h["output_token_throughput"], 0),
            num(i["output_token_throughput"], 0),
            bold(num(d["ratio_http_over_inprocess_tok_s"], 2)),
        ],
        [
            "requests/s",
            num(h["request_throughput"]),
            num(i["request_throughput"]),
            num(h["request_throughput"] / i["request_throughput"], 2),
        ],
        ["TTFT p50 / p90 / p99", pcts(h, "ttft"), pcts(i, "ttft"), ""],
        ["inter-token p50 / p90 / p99", pcts(h, "itl"), pcts(i, "itl"), ""],
    ]
    arrival = "all at once" if str(rate) == "inf" else f"Poisson, {rate} req/s"
    return markdown([arrival, "HTTP (SSE)", "in-process", "ratio"], rows)


def _chunk_rows(d: Result, pp: int, prompt: int) -> dict[str, float]:
    out = {}
    for r in d["rows"]:
        if r["backend"] == "synthetic" and r["pp"] == pp and r["prompt_tokens"] == prompt:
            key = f"fixed {r['chunk']}" if r["mode"] == "fixed" else f"s={r['smooth']}"
            out[key] = r["ttft_s"]
    return out


def table_chunking(results: Sequence[Result]) -> list[str]:
    d = results[0]
    prompts = sorted({r["prompt_tokens"] for r in d["rows"] if r["backend"] == "synthetic" and r["pp"] == 4})
    columns = ["fixed 1024", "fixed 2048", "fixed 4096", "fixed 8192", "s=0.5", "s=0.75", "s=1.0"]
    rows = []
    for prompt in prompts:
        ttft = _chunk_rows(d, 4, prompt)
        best = min(ttft.values())
        rows.append(
            [
                f"{prompt // 1024}K",
                *(bold(f"{num(ttft[c], 3)} s", ttft[c] == best) if c in ttft else "" for c in columns),
            ]
        )
    header = ["prompt", *columns[:4], "dynamic s=0.5", "s=0.75", "s=1.0"]
    return markdown(header, rows)


def table_chunking_scaling(results: Sequence[Result]) -> list[str]:
    d = results[0]
    summary = d["summary"]
    eff, eff_best = summary["strong_scaling_efficiency"], summary["strong_scaling_efficiency_vs_best_pp1"]
    stages = sorted(eff, key=int)
    prompt = max(r["prompt_tokens"] for r in d["rows"] if r["backend"] == "synthetic")
    ttft = {
        str(r["pp"]): r["ttft_s"]
        for r in d["rows"]
        if r["backend"] == "synthetic" and r["prompt_tokens"] == prompt and r["smooth"] == 0.75
    }
    best = summary[f"synthetic pp1 {prompt}"]["best_fixed"]
    rows = [
        ["TTFT", *(f"{num(ttft[s], 2)} s" for s in stages)],
        ["efficiency (PP=1 with the same chunks)", *(bold(num(eff[s], 2), s == "4") for s in stages)],
        [
            f"efficiency (PP=1 at its best: fixed {best['chunk']}, {num(best['ttft_s'], 2)} s)",
            *(num(eff_best[s], 2) for s in stages),
        ],
    ]
    return markdown(["stages", *stages], rows)


def table_prefix_cache(results: Sequence[Result]) -> list[str]:
    d = results[0]
    mt, ns = d["workloads"]["multi_turn"], d["workloads"]["no_sharing"]

    def tokens_k(v: float) -> str:
        return f"{num(v / 1000)}K"

    def pct(v: float) -> str:
        return f"{num(v * 100, 0)}%" if v else "0"

    def both(w: dict[str, Any], fn: Callable[[dict[str, float]], str]) -> list[str]:
        return [fn(w["on"]), fn(w["off"])]

    def tput(m: dict[str, float]) -> str:
        return num(m["total_token_throughput"], 0)

    def ttft(m: dict[str, float]) -> str:
        return f"{num(m['ttft_ms_p50'], 0)} / {num(m['ttft_ms_p90'], 0)} ms"

    def itl(m: dict[str, float]) -> str:
        return f"{num(m['itl_ms_p50'], 0)} ms"

    def cached(m: dict[str, float]) -> str:
        return pct(m["cached_tokens"] / m["prompt_tokens"])

    def computed(m: dict[str, float]) -> str:
        return tokens_k(m["stage0_computed_tokens"])

    mr, nr = mt["ratios"], ns["ratios"]
    rows = [
        [
            "tokens/s (prompt + output)",
            *both(mt, tput),
            bold(f"{num(mr['total_token_throughput_on_over_off'], 2)}x"),
            *both(ns, tput),
            bold(num(nr["total_token_throughput_on_over_off"], 3)),
        ],
        [
            "TTFT p50 / p90",
            *both(mt, ttft),
            bold(f"{num(mr['ttft_ms_p50_off_over_on'])}x / {num(mr['ttft_ms_p90_off_over_on'])}x"),
            *both(ns, ttft),
            f"{num(nr['ttft_ms_p50_off_over_on'], 2)} / {num(nr['ttft_ms_p90_off_over_on'], 2)}",
        ],
        ["inter-token p50", *both(mt, itl), "", *both(ns, itl), ""],
        ["prompt tokens found cached", *both(mt, cached), "", *both(ns, cached), ""],
        [
            "tokens each stage computed",
            *both(mt, computed),
            f"{num(mr['stage0_computed_tokens_off_over_on'])}x fewer",
            *both(ns, computed),
            num(nr["stage0_computed_tokens_off_over_on"], 2),
        ],
    ]
    header = ["", "multi-turn on", "multi-turn off", "ratio", "no sharing on", "no sharing off", "ratio"]
    return markdown(header, rows)


def table_plan_diff(results: Sequence[Result]) -> list[str]:
    """Plan bytes and a stage's per-step decode + metadata time, whole tables against diffs."""
    rows = []
    for r in results[0]["results"]:
        b, ms = r["plan_bytes"], r["stage_decode_and_metadata_ms"]
        rows.append(
            [
                f"{r['requests']} x {r['context'] // 1024}K",
                thousands(b["old_mean"]),
                f"{thousands(b['new_mean'])} (max {thousands(b['new_max'])})",
                f"{num(ms['old'], 2)} ms",
                f"{num(ms['new'], 2)} ms",
                f"{num(r['host_schedule_ms'], 2)} ms",
            ]
        )
    header = ["requests x context", "plan bytes, whole tables", "plan bytes, diffs", "stage, before", "stage, now"]
    return markdown([*header, "host schedule()"], rows)


@dataclass(frozen=True)
class Table:
    sources: tuple[str, ...]  # result files under benchmarks/results, in the order `render` takes them
    render: Callable[[Sequence[Result]], list[str]]


TABLES: dict[str, Table] = {
    "gguf_load": Table(("gguf_load.json",), table_gguf_load),
    "quant_kernels": Table(("quant_kernels.json",), table_quant_kernels),
    "quant_perplexity": Table(("quant_perplexity.json",), table_quant_perplexity),
    "peers_smollm2": Table(("peers_smollm2.json", "peers_smollm2_q4_1.json"), table_peers_smollm2),
    "peers_quantized": Table(("peers_smollm2_q4_1.json",), table_peers_quantized),
    "peers_targets": Table(sources(TARGET_COLUMNS), table_peers_targets),
    "peers_avx2": Table(sources(AVX2_COLUMNS), table_peers_avx2),
    "profile_step": Table(
        (
            "profile_step_small_plain.json",
            "profile_step_small.json",
            "profile_step_small_bf16.json",
            "profile_step_realistic.json",
        ),
        table_profile_step,
    ),
    "model": Table(("model.json",), table_model),
    "pipeline": Table(("pipeline.json",), table_pipeline),
    "multinode": Table(("multinode.json",), table_multinode),
    "multinode_ray": Table(("multinode.json",), table_multinode_ray),
    "pd": Table(("pd.json",), table_pd),
    "serving": Table(("serving.json",), table_serving),
    "chunking": Table(("chunking.json",), table_chunking),
    "chunking_scaling": Table(("chunking.json",), table_chunking_scaling),
    "prefix_cache": Table(("prefix_cache.json",), table_prefix_cache),
    "plan_diff": Table(("plan_diff.json",), table_plan_diff),
    "ab_throughput": Table(("ab_throughput.json",), table_ab_throughput),
    "structured": Table(("structured.json", "structured_rounds40.json"), table_structured),
    "grammar_engines": Table(("grammar_engines.json",), table_grammar_engines),
    "big_model": Table(("big_model.json",), table_big_model),
    "big_model_speed": Table(("big_model.json",), table_big_model_speed),
    "speculative": Table(("speculative.json",), table_speculative),
    "speculative_pp2": Table(("speculative.json",), table_speculative_pp2),
}


def render(name: str, doc: Path, root: Path = ROOT) -> str:
    """The body between the markers of table `name` in `doc`: the table, a blank line, its provenance."""
    table = TABLES[name]
    results = [json.loads((root / "benchmarks" / "results" / s).read_text()) for s in table.sources]
    lines = table.render(results)
    lines += ["", provenance_line(table.sources, results, doc.parent, root)]
    return "\n".join(lines) + "\n"


def refresh(text: str, doc: Path, root: Path = ROOT) -> str:
    """`text` with every marked table rendered afresh. An unknown name is an error."""

    def one(m: re.Match[str]) -> str:
        name = m["name"]
        if name not in TABLES:
            raise KeyError(f"{doc.name}: unknown benchmark table {name!r} (known: {', '.join(TABLES)})")
        return f"<!-- bench-table: {name} -->\n{render(name, doc, root)}<!-- /bench-table -->"

    return MARKER.sub(one, text)


def stale(root: Path = ROOT) -> list[str]:
    """The marked tables whose text differs from what their JSONs say, as `file: name`."""
    out = []
    for doc in doc_files(root):
        text = doc.read_text()
        for m in MARKER.finditer(text):
            if m["name"] not in TABLES or m["body"] != render(m["name"], doc, root):
                out.append(f"{doc.relative_to(root)}: {m['name']}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs from its JSON")
    args = p.parse_args(argv)
    if args.check:
        bad = stale()
        for line in bad:
            print(f"differs from its JSON: {line} (run python -m benchmarks tables)")
        return 1 if bad else 0
    for doc in doc_files():
        text = doc.read_text()
        new = refresh(text, doc)
        if new != text:
            doc.write_text(new)
            print(f"rewrote {doc.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
