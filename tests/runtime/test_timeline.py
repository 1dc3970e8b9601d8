"""The pipeline timeline of a live server with synthetic stages: /debug/timeline as a Chrome
trace, chunk and fit metrics, and the Gantt chart script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import ROOT, LiveServer

pytestmark = pytest.mark.slow


def test_debug_timeline_metrics_and_plot(llama_dir: Path, tmp_path: Path) -> None:
    server = LiveServer(
        llama_dir,
        "--pp-size", "2", "--kv-cache-gb", "0.02", "--chunked-prefill-size", "256", "--enable-dynamic-chunking",
        "--synthetic-latency", "2e-8,2e-5,0.001",
    )  # fmt: skip
    try:
        code, _, raw = server.request("POST", "/v1/completions", {"prompt": [9] * 1500, "max_tokens": 4})
        assert code == 200, raw
        assert server.request("GET", "/debug/timeline", headers={"Authorization": ""})[0] == 401
        code, _, raw = server.request("GET", "/debug/timeline")
        assert code == 200
        trace = json.loads(raw)
        events = trace["traceEvents"]
        names = {e["args"]["name"] for e in events if e["ph"] == "M"}
        assert names == {"ppserve (synthetic stages)", "stage 0", "stage 1"}
        spans = [e for e in events if e["ph"] == "X"]
        prefill = sorted((e for e in spans if e["cat"] == "prefill" and e["tid"] == 0), key=lambda e: e["ts"])
        assert sum(e["args"]["tokens"] for e in prefill) >= 1500 and len(prefill) >= 6
        assert {e["tid"] for e in spans} == {0, 1} and all(e["dur"] > 0 for e in spans)
        assert any(e["cat"] == "decode" for e in spans)

        m = server.metrics()
        assert m["ppserve_prefill_chunk_tokens_count"] >= len(prefill)
        assert m['ppserve_prefill_latency_coefficient{term="a"}'] > 0  # profiled at start-up

        saved = tmp_path / "trace.json"
        saved.write_text(json.dumps(trace))
        png = tmp_path / "timeline.png"
        cmd = [sys.executable, "-m", "benchmarks", "plot-timeline", "--trace", str(saved), "--out", str(png)]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=120)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        assert server.stop() == 0
