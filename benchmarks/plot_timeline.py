"""Draw a pipeline timeline as a Gantt chart: one row per stage, one bar per micro-batch, each
stage's bubble fraction in the legend.

    .venv/bin/python -m benchmarks plot-timeline --url http://127.0.0.1:8000 --out timeline.png [--api-key KEY]
    .venv/bin/python -m benchmarks plot-timeline --trace saved_trace.json --out timeline.png

The input is the Chrome trace JSON that `GET /debug/timeline` returns (also opens in Perfetto).
Needs matplotlib (`scripts/venv.sh bench`).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ppserve.engine.runtime.timeline import Interval, bubble_fractions, intervals_from_trace

COLORS = {"prefill": "tab:blue", "decode": "tab:green", "mixed": "tab:orange", "unknown": "tab:gray"}


def plot_timeline(intervals: Sequence[Interval], pp_size: int, out: Path, title: str = "ppserve pipeline") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min(i.start for i in intervals)
    bubbles = bubble_fractions(intervals, pp_size)
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * pp_size))
    for i in intervals:
        ax.broken_barh(
            [((i.start - t0) * 1e3, (i.end - i.start) * 1e3)],
            (i.stage - 0.4, 0.8),
            facecolors=COLORS.get(i.kind, "tab:gray"),
            edgecolors="white",
            linewidth=0.3,
        )
    ax.set_yticks(range(pp_size), [f"stage {s}" for s in range(pp_size)])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    kinds = sorted({i.kind for i in intervals})
    handles = [Patch(color=COLORS.get(k, "tab:gray"), label=k) for k in kinds]
    handles += [Patch(color="white", label=f"stage {s}: bubble {b:.1%}") for s, b in enumerate(bubbles)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _load(args: argparse.Namespace) -> dict[str, Any]:
    if args.trace:
        trace: dict[str, Any] = json.loads(Path(args.trace).read_text())
        return trace
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    req = urllib.request.Request(args.url.rstrip("/") + "/debug/timeline", headers=headers)
    with urllib.request.urlopen(req, timeout=30) as resp:
        trace = json.loads(resp.read())
    return trace


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="a running server")
    source.add_argument("--trace", help="a saved Chrome trace JSON")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--out", default="timeline.png")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    trace = _load(args)
    intervals = intervals_from_trace(trace)
    if not intervals:
        sys.exit("the timeline is empty: send some requests first")
    label = next((e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"), "ppserve")
    plot_timeline(intervals, max(i.stage for i in intervals) + 1, Path(args.out), args.title or label)
    print(f"wrote {args.out}")
