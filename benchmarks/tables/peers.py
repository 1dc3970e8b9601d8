"""The tables of runs against other engines (benchmarks/peers.py) and against an earlier
commit of this one (benchmarks/ab.py); rendered by `python -m benchmarks tables`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from benchmarks.tables.format import Result, bold, markdown, num

QUANTIZED_ORDER = ["ppserve-pp1-q4_1", "ppserve-pp2-q4_1", "llama-server-q4_1", "llama-server-q4_1-fa-off"]
PEER_ORDER = ["ppserve-pp1", "vllm", "ppserve-pp2", "vllm-pp2", "llama-server", "llama-server-fa-off", *QUANTIZED_ORDER]
# Who a ppserve row is measured against: vLLM on the float weights, llama-server (llama.cpp's
# default flags) on the Q4_1 GGUF, which vLLM does not run.
RIVAL = {
    "ppserve-pp1": "vllm",
    "ppserve-pp2": "vllm-pp2",
    "ppserve-pp1-q4_1": "llama-server-q4_1",
    "ppserve-pp2-q4_1": "llama-server-q4_1",
}
LOWER_IS_BETTER = {"ttft_ms_p50", "itl_ms_p50", "batch1_itl_ms_p50"}


def peers_table(labels: dict[str, str], tok_digits: int) -> Callable[[Sequence[Result]], list[str]]:
    """Engines of one or more peers JSONs (later files add engines). A ppserve burst figure is bold
    where it beats vLLM's at the same pipeline size."""

    def render(results: Sequence[Result]) -> list[str]:
        engines: dict[str, dict[str, float]] = {}
        for r in results:
            engines.update(r["engines"])
        formats: list[tuple[str, Callable[[float], str], bool]] = [
            ("output_tok_s", lambda v: num(v, tok_digits), True),
            ("ttft_ms_p50", lambda v: f"{num(v / 1000, 2)} s", True),
            ("itl_ms_p50", lambda v: f"{num(v)} ms", True),
            ("batch1_tok_s", lambda v: num(v), False),
            ("batch1_itl_ms_p50", lambda v: f"{num(v)} ms", False),
        ]
        rows = []
        for name in (n for n in PEER_ORDER if n in engines and n in labels):
            e, rival = engines[name], engines.get(RIVAL.get(name, ""))
            cells = [labels[name]]
            for key, fmt, burst in formats:
                better = rival is not None and (e[key] < rival[key] if key in LOWER_IS_BETTER else e[key] > rival[key])
                cells.append(bold(fmt(e[key]), burst and better))
            rows.append(cells)
        header = ["engine", "output tok/s", "TTFT p50", "ITL p50", "batch-1 tok/s", "batch-1 ITL p50"]
        return markdown(header, rows)

    return render


VLLM = "vLLM, 2 threads"
table_peers_smollm2 = peers_table(
    {
        "ppserve-pp1": "ppserve, PP=1",
        "vllm": VLLM,
        "ppserve-pp2": "ppserve, PP=2",
        "vllm-pp2": "vLLM, PP=2 (a core per stage)",
        "llama-server": "llama-server, F32 GGUF",
        "llama-server-fa-off": "llama-server, F32 GGUF, flash attention off",
        "ppserve-pp1-q4_1": "ppserve, PP=1, the Q4_1 GGUF (int4)",
        "ppserve-pp2-q4_1": "ppserve, PP=2, the Q4_1 GGUF (int4)",
        "llama-server-q4_1": "llama-server, the Q4_1 GGUF itself",
        "llama-server-q4_1-fa-off": "llama-server, the Q4_1 GGUF, flash attention off",
    },
    1,
)


def table_peers_quantized(results: Sequence[Result]) -> list[str]:
    """The engines that compute with the Q4_1 GGUF's weights, against llama-server on it (llama.cpp's
    default flags): batch-1 time per output token (ITL p50) and the burst's output tokens/s, with
    their ratios. A ppserve ratio is bold where it is at least as good; "—" where a run lacks the
    engine the ratio needs."""
    r = results[0]
    engines, ref = r["engines"], r["engines"].get("llama-server-q4_1")
    labels = {
        "ppserve-pp1-q4_1": "ppserve, PP=1 (int4 linears)",
        "ppserve-pp2-q4_1": "ppserve, PP=2 (int4 linears)",
        "llama-server-q4_1": "llama-server",
        "llama-server-q4_1-fa-off": "llama-server, flash attention off",
    }

    def ratio(e: dict[str, float], key: str, lower_is_better: bool, ours: bool) -> str:
        if ref is None or not ref[key]:
            return "—"
        v = e[key] / ref[key]
        return bold(f"{num(v, 2)}x", ours and (v <= 1 if lower_is_better else v >= 1))

    rows = []
    for name in (n for n in QUANTIZED_ORDER if n in engines):
        e, ours = engines[name], name.startswith("ppserve")
        batch1 = [f"{num(e['batch1_itl_ms_p50'])} ms", ratio(e, "batch1_itl_ms_p50", True, ours)]
        rows.append([labels[name], *batch1, num(e["output_tok_s"]), ratio(e, "output_tok_s", False, ours)])
    streams = r.get("settings", {}).get("num_requests")
    burst = f"{streams}-stream output tok/s" if streams else "burst output tok/s"
    header = ["Q4_1 GGUF", "batch-1 ms/token", "÷ llama-server", burst, "÷ llama-server"]
    return markdown(header, rows)


# Columns of a targets table: a label, and the peers JSONs of one shape and dtype (later files add
# engines: the Q4_1 engines run apart from the float ones, as ten servers at once do not fit in
# memory). benchmarks/peers.py writes them with --tag smollm2, smollm2_q4_1, smollm2_bf16, small, ...
Columns = dict[str, tuple[str, ...]]
# A row: its label, ppserve's engine, the peer's, the figure, and the ratio ours / peer the target
# allows (at most, for a figure where lower is better; else at least).
TargetRow = tuple[str, str, str, str, float]


def sources(columns: Columns) -> tuple[str, ...]:
    return tuple(name for names in columns.values() for name in names)


def targets_table(columns: Columns, rows: Sequence[TargetRow]) -> Callable[[Sequence[Result]], list[str]]:
    """Ratios ppserve / peer, one column per shape and dtype; bold where the target is met, "—"
    where the column's runs have no such engine. llama-server is taken at its better flags (flash
    attention on or off) for each figure."""

    def render(results: Sequence[Result]) -> list[str]:
        found: list[dict[str, dict[str, float]]] = []  # each column's engines, from its JSONs in turn
        it = iter(results)
        for names in columns.values():
            engines: dict[str, dict[str, float]] = {}
            for _ in names:
                engines.update(next(it)["engines"])
            found.append(engines)

        def value(engines: dict[str, dict[str, float]], engine: str, key: str) -> float | None:
            if engine == "llama-server" or engine == "llama-server-q4_1":  # the better of its flags
                lower = key in LOWER_IS_BETTER
                seen = [e[key] for n, e in engines.items() if n in (engine, f"{engine}-fa-off")]
                return (min(seen) if lower else max(seen)) if seen else None
            e = engines.get(engine)
            return None if e is None else float(e[key])

        def row(label: str, ours: str, peer: str, key: str, limit: float) -> list[str]:
            cells = [label]
            for engines in found:
                a, b = value(engines, ours, key), value(engines, peer, key)
                if a is None or b is None:
                    cells.append("—")
                    continue
                met = a / b <= limit if key in LOWER_IS_BETTER else a / b >= limit
                cells.append(bold(num(a / b, 2), met))
            return cells

        return markdown(["target", *columns], [row(*r) for r in rows])

    return render


TARGET_COLUMNS: Columns = {
    "SmolLM2-135M, float32": ("peers_smollm2.json", "peers_smollm2_q4_1.json"),
    "SmolLM2-135M, bfloat16": ("peers_smollm2_bf16.json",),
    "small, float32": ("peers_small.json",),
    "small, bfloat16": ("peers_small_bf16.json",),
    "0.5B shape, float32": ("peers_realistic.json",),
    "0.5B shape, bfloat16": ("peers_realistic_bf16.json",),
}
table_peers_targets = targets_table(
    TARGET_COLUMNS,
    [
        ("PP=1 output tokens/s ≥ 1.05x vLLM", "ppserve-pp1", "vllm", "output_tok_s", 1.05),
        ("PP=1 ITL p50 ≤ vLLM's", "ppserve-pp1", "vllm", "itl_ms_p50", 1.0),
        ("PP=2 output tokens/s ≥ vLLM PP=2", "ppserve-pp2", "vllm-pp2", "output_tok_s", 1.0),
        ("batch-1 time per token ≤ llama-server's", "ppserve-pp1", "llama-server", "batch1_itl_ms_p50", 1.0),
        (
            "Q4_1, batch-1 time per token ≤ 1.5x llama-server's",
            "ppserve-pp1-q4_1",
            "llama-server-q4_1",
            "batch1_itl_ms_p50",
            1.5,
        ),
        ("Q4_1, output tokens/s ≥ llama-server's", "ppserve-pp1-q4_1", "llama-server-q4_1", "output_tok_s", 1.0),
    ],
)

# The same columns on a CPU with AVX2 alone: each run's JSON tagged _avx2 (benchmarks/peers.py --tag
# small_avx2, ...; SmolLM2's float32 one is smollm2_f32_avx2, as smollm2_avx2 is an earlier run's).
AVX2_COLUMNS: Columns = {
    label: tuple(
        "peers_smollm2_f32_avx2.json" if name == "peers_smollm2.json" else name.replace(".json", "_avx2.json")
        for name in names
    )
    for label, names in TARGET_COLUMNS.items()
}
table_peers_avx2 = targets_table(
    AVX2_COLUMNS,
    [
        ("PP=1 output tokens/s ≥ 1.2x vLLM", "ppserve-pp1", "vllm", "output_tok_s", 1.2),
        ("PP=1 TTFT p50 ≤ vLLM's", "ppserve-pp1", "vllm", "ttft_ms_p50", 1.0),
        ("batch-1 time per token ≤ 0.9x llama-server's", "ppserve-pp1", "llama-server", "batch1_itl_ms_p50", 0.9),
        (
            "Q4_1, batch-1 time per token ≤ 0.9x llama-server's",
            "ppserve-pp1-q4_1",
            "llama-server-q4_1",
            "batch1_itl_ms_p50",
            0.9,
        ),
    ],
)


def table_ab_throughput(results: Sequence[Result]) -> list[str]:
    """This checkout (B) against the base commit (A): medians over alternating rounds."""
    r = results[0]
    rows = []
    for key, side in sorted(r["results"].items()):
        a, b, ratio = side["A"], side["B"], side["ratio_b_over_a"]["output_token_throughput"]
        per_round = ", ".join(num(x, 2) for x in side["ratio_b_over_a_per_round"]["output_token_throughput"])
        rows.append(
            [
                f"PP={key.removeprefix('pp')}",
                num(a["output_token_throughput"]),
                num(b["output_token_throughput"]),
                bold(num(ratio, 2), ratio >= 1),
                per_round,
                f"{num(a['itl_ms_p50'])} / {num(b['itl_ms_p50'])} ms",
            ]
        )
    base = r["base"]["commit"][:12]
    header = [
        "pipeline",
        f"output tok/s, base `{base}`",
        "output tok/s, this",
        "ratio",
        "per round",
        "ITL p50 base / this",
    ]
    return markdown(header, rows)
