"""Rerun the benchmarks that need neither the peers (.venv-peers: vLLM, llama-server) nor root,
each writing its JSON under benchmarks/results/, then render the documentation's tables.

    .venv/bin/python -m benchmarks all               # all of them, one after another (about 45 minutes on 2 cores)
    .venv/bin/python -m benchmarks all pd serving    # only those (names: see RUNS)

The rest: `peers` (peers*.json), `quant-quality` (quant_perplexity.json) and `sudo ... multinode`
(multinode.json); docs/benchmarks.md gives their commands. Run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = ROOT / ".venv" / "bin" / "python"

# Each run: the `python -m benchmarks` command lines it takes, in order.
RUNS: dict[str, list[str]] = {
    "chunking": ["chunking"],  # ~5 min; also chunking.png, timeline.png
    "model": ["model --threads 2 --reps 5"],  # ~2 min
    "pd": ["pd"],  # ~2 min
    "pipeline": ["pipeline"],  # ~4 min
    "serving": [  # ~4 min + ~3 min
        "serving --num-requests 128 --input-len 64:256 --output-len 32:128 --rounds 5",
        "serving --num-requests 128 --input-len 64:256 --output-len 32:128 --rounds 3 --request-rate 8 --tag poisson",
    ],
    "prefix-cache": ["prefix-cache --rounds 3"],  # ~17 min
    "quant": ["quant"],  # ~2 min (quant_perplexity.json: peers)
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", metavar="NAME", help=f"which (default: all): {', '.join(RUNS)}")
    args = p.parse_args(argv)
    names = [n.replace("_", "-") for n in args.names] or list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        p.error(f"unknown benchmark {unknown[0]!r} (known: {' '.join(RUNS)})")
    subprocess.run([str(ROOT / "scripts" / "venv.sh"), "test,bench"], check=True)
    for name in names:
        print(f"== {name} ({time.strftime('%H:%M:%S', time.gmtime())})", flush=True)
        for cmd in RUNS[name]:
            subprocess.run([str(PY), "-m", "benchmarks", *cmd.split()], cwd=ROOT, check=True)
    subprocess.run([str(PY), "-m", "benchmarks", "tables"], cwd=ROOT, check=True)
    return 0
