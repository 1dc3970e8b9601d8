"""The table of the speculative decoding benchmark (benchmarks/speculative.py); rendered by
`python -m benchmarks tables`."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.tables.format import Result, bold, markdown, num

MODES = (("batch1", "batch 1"), ("streams", "16 streams"))


def table_speculative(r: Sequence[Result]) -> list[str]:
    """Per workload and mode: ppserve's output tokens/s with drafts and without, their ratio (bold
    where it meets the issue's target), the fraction of drafts kept, llama-server's best lookup
    type (with its commit where the run carried it from an earlier one), and ppserve with drafts over it."""
    d = r[0]
    res, carried = d["results"], d.get("carried", {})
    rows = []
    for w, name in d["workloads"].items():
        for mode, label in MODES:
            key = f"{w}/{mode}"
            if key not in res.get("ppserve-spec", {}) or key not in res.get("ppserve-off", {}):
                continue
            spec, off = res["ppserve-spec"][key], res["ppserve-off"][key]
            ratio = spec["tokens_per_s"] / off["tokens_per_s"]
            target = 1.5 if mode == "batch1" and w != "d" else 0.97
            kept = f"{num(100 * spec['accepted_tokens'] / spec['draft_tokens'], 0)}%" if spec["draft_tokens"] else "-"
            llamas = {
                e: v[key]["tokens_per_s"]
                for e, v in res.items()
                if e.startswith("llama-") and "tokens_per_s" in v.get(key, {})
            }
            lookups = {e: v for e, v in llamas.items() if e != "llama-none"}
            best = max(lookups, key=lookups.__getitem__) if lookups else None
            rows.append(
                [
                    f"({w}) {name}, {label}",
                    num(spec["tokens_per_s"]),
                    num(off["tokens_per_s"]),
                    bold(f"{num(ratio, 2)}x", ratio >= target),
                    kept,
                    f"{num(lookups[best])} ({best.removeprefix('llama-')}{_at(carried.get(best))})" if best else "",
                    f"{num(spec['tokens_per_s'] / lookups[best], 2)}x" if best else "",
                ]
            )
    for key, a in res.get("ppserve-control-a", {}).items():  # two servers without drafts: the noise
        if "tokens_per_s" in a and "tokens_per_s" in (b := res.get("ppserve-control-b", {}).get(key, {})):
            w, mode = key.split("/")
            ratio = f"{num(b['tokens_per_s'] / a['tokens_per_s'], 2)}x"
            label = f"control: ({w}) {d['workloads'][w]}, {dict(MODES)[mode]}, off / off"
            rows.append([label, num(b["tokens_per_s"]), num(a["tokens_per_s"]), ratio, "-", "", ""])
    header = ["workload", "ppserve, drafts", "ppserve, off", "drafts / off", "drafts kept"]
    header += ["llama-server, best lookup", "ppserve drafts / best lookup"]
    return markdown(header, rows)


def _at(commit: str | None) -> str:
    return f", at {commit[:7]}" if commit else ""


def table_speculative_pp2(r: Sequence[Result]) -> list[str]:
    """PP=2, 16 streams: tokens/s and each stage's busy share, with drafts and without."""
    res = r[0]["results"]
    rows = []
    for w, name in r[0]["workloads"].items():
        key = f"{w}/streams"
        if key not in res.get("ppserve-pp2-spec", {}) or key not in res.get("ppserve-pp2-off", {}):
            continue
        spec, off = res["ppserve-pp2-spec"][key], res["ppserve-pp2-off"][key]
        busy = [" / ".join(f"{num(100 * b, 0)}%" for b in x["stage_busy"]) for x in (spec, off)]
        rows.append([f"({w}) {name}", num(spec["tokens_per_s"]), num(off["tokens_per_s"]), *busy])
    header = ["PP=2, 16 streams", "tokens/s, drafts", "tokens/s, off", "stages busy, drafts", "stages busy, off"]
    return markdown(header, rows)
