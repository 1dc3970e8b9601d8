"""Embeddings benchmark: POST /v1/embeddings against the same inputs through /v1/completions with
max_tokens 1, on one server (the demo model unless --model, 2 stages).

The pooled path runs each input as a prefill whose last row the last stage returns instead of
sampling from it; a one-token completion runs the same prefill and samples (the lm_head over the
vocabulary, the sampler, detokenizing). The pooled path must be no slower. Each round sends the
256 inputs of 64 tokens (random token ids, seeded; the same every round) as one request to each
endpoint, alternating which goes first; the prefix cache is off so no round reuses another's KV.
Reported: seconds per request (median over rounds) and inputs per second, side by side as a ratio.

    .venv/bin/python -m benchmarks embeddings                     # demo model, PP=2, 5 rounds
    .venv/bin/python -m benchmarks embeddings --quick             # tiny model, 2 rounds: a check

Writes benchmarks/results/embeddings.json (`--out`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.record import RESULTS, write_result
from benchmarks.harness.testbed import LiveServer
from ppserve.server.demo import demo_model, tiny_random_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint or GGUF (default: the demo model)")
    parser.add_argument("--pp-size", type=int, default=2)
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per input")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny random model, 2 rounds")
    parser.add_argument("--out", type=Path, default=RESULTS / "embeddings.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 2
    model = Path(args.model) if args.model else tiny_random_checkpoint() if args.quick else demo_model()
    times: dict[str, list[float]] = {"embeddings": [], "completions": []}
    flags = [
        "--pp-size",
        str(args.pp_size),
        "--no-enable-prefix-caching",
        "--max-requests-per-client",
        str(args.inputs),
    ]
    server = LiveServer(model, *flags, timeout_s=600)
    try:
        vocab = json.loads(server.request("GET", "/tokenizer_info")[2])["vocab_size"]
        rng = random.Random(0)
        inputs = [[rng.randrange(10, vocab) for _ in range(args.tokens)] for _ in range(args.inputs)]
        bodies = {
            "embeddings": ("/v1/embeddings", {"input": inputs}),
            "completions": ("/v1/completions", {"prompt": inputs, "max_tokens": 1, "temperature": 0}),
        }

        def timed(name: str) -> float:
            path, body = bodies[name]
            start = time.perf_counter()
            status, _, raw = server.request("POST", path, body)
            seconds = time.perf_counter() - start
            answer = json.loads(raw)
            assert status == 200, answer
            key = "data" if name == "embeddings" else "choices"
            assert len(answer[key]) == args.inputs, answer
            return seconds

        timed("embeddings")  # warm-up: kernels, first allocations
        timed("completions")
        for r in range(args.rounds):
            order = ["embeddings", "completions"] if r % 2 == 0 else ["completions", "embeddings"]
            for name in order:
                times[name].append(timed(name))
                print(f"round {r}: {name} {times[name][-1]:.2f} s", flush=True)
    finally:
        assert server.stop() == 0, "".join(server.output[-20:])
    results: dict[str, Any] = {}
    for name, ts in times.items():
        median = statistics.median(ts)
        results[name] = {"seconds": ts, "median_s": median, "inputs_per_s": args.inputs / median}
    ratio = results["completions"]["median_s"] / results["embeddings"]["median_s"]
    results["speedup_embeddings_vs_completions"] = ratio
    print(f"embeddings {results['embeddings']['median_s']:.2f} s, completions(max_tokens 1) "
          f"{results['completions']['median_s']:.2f} s: embeddings {ratio:.2f}x as fast")  # fmt: skip
    write_result(args.out, {"model": str(model), **results}, args)
