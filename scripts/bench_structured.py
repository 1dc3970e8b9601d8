"""What a JSON schema costs: constrained against unconstrained chat requests, side by side.

On the demo model (or --model), at each PP size: bursts of --requests concurrent chat requests,
once with a JSON schema (response_format's json_schema, compiled and cached before the rounds)
and once without, in alternating rounds. Reports output tokens/s, TTFT p50 and their ratios
(constrained / unconstrained; targets >= 0.95 and <= 1.10), and, in-process, the grammar's
compile time (first and cached) and the time to compute one token's mask per request at
--requests streams.

    python scripts/bench_structured.py [--model PATH] [--pp 1 2] [--requests 32] [--rounds 3]

Writes benchmarks/results/structured.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_grammar_engines import REPLY, SCHEMA  # noqa: E402
from bench_record import RESULTS, write_result  # noqa: E402

from ppserve.engine.async_engine import AsyncEngine  # noqa: E402
from ppserve.engine.config import EngineConfig  # noqa: E402
from ppserve.engine.model.grammar import Grammars, build_grammar  # noqa: E402
from ppserve.scheduler.sampling_params import SamplingParams  # noqa: E402
from ppserve.server.demo import demo_model  # noqa: E402

TOPICS = ["a chef", "a pilot", "a poet", "a farmer", "a nurse", "a coder", "a judge", "a singer"]


async def burst(
    engine: AsyncEngine, prompts: list[list[int]], params: list[SamplingParams], counts: list[int] | None = None
) -> dict[str, float]:
    """All requests at once: output tokens/s over the burst, and the median time to first token.
    `counts`, if given, gets each request's number of output tokens."""
    start = time.perf_counter()
    ttft: list[float] = []

    async def one(prompt: list[int], p: SamplingParams) -> int:
        n = 0
        async for out in engine.generate(prompt, p):
            if n == 0 and out.token_ids:
                ttft.append(time.perf_counter() - start)
            n += len(out.token_ids)
        return n

    each = await asyncio.gather(*(one(pr, p) for pr, p in zip(prompts, params, strict=True)))
    if counts is not None:
        counts[:] = each
    wall = time.perf_counter() - start
    return {"tokens": sum(each), "tok_s": sum(each) / wall, "ttft_p50_s": statistics.median(ttft)}


async def run_pp(model: Path, pp: int, args: argparse.Namespace, grammar: str) -> dict[str, Any]:
    config = EngineConfig.create(model, pp_size=pp)
    async with AsyncEngine(config) as engine:
        tok = engine.tokenizer
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as a person."}])
            for i in range(args.requests)
        ]
        constrained = [
            SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=i, grammar=grammar)
            for i in range(args.requests)
        ]
        await engine.check_grammar(grammar)  # cached before the rounds: they measure a cached grammar
        # Warm-up (the last stage compiles the grammar once too), which also says how long each
        # constrained reply is (seeded: the same every round). The unconstrained requests then
        # generate exactly as many tokens, so both kinds of burst do the same work but the masks.
        counts: list[int] = []
        await burst(engine, prompts, constrained, counts)
        free = [SamplingParams(max_tokens=n, temperature=0.8, seed=i, ignore_eos=True) for i, n in enumerate(counts)]
        rounds: dict[str, list[dict[str, float]]] = {"unconstrained": [], "constrained": []}
        for r in range(args.rounds):
            order = ["unconstrained", "constrained"] if r % 2 == 0 else ["constrained", "unconstrained"]
            for kind in order:
                rounds[kind].append(await burst(engine, prompts, free if kind == "unconstrained" else constrained))
    med = {
        k: {m: statistics.median(x[m] for x in v) for m in ("tok_s", "ttft_p50_s", "tokens")} for k, v in rounds.items()
    }
    return {
        "pp": pp,
        "rounds": rounds,
        "median": med,
        "throughput_ratio": med["constrained"]["tok_s"] / med["unconstrained"]["tok_s"],
        "ttft_ratio": med["constrained"]["ttft_p50_s"] / med["unconstrained"]["ttft_p50_s"],
    }


def grammar_costs(model: Path, grammar: str, streams: int) -> dict[str, float]:
    """In-process: compile time (fresh Grammars, then cached) and one token's mask per request at
    `streams` requests, each matcher walking a schema-valid reply token by token."""
    from ppserve.engine.model.tokenizer import Tokenizer

    tok = Tokenizer(model)
    vocab = EngineConfig.create(model).model_config.vocab_size
    grammars = Grammars(tok.hf, vocab)
    t = time.perf_counter()
    grammars.check(grammar)
    first = time.perf_counter() - t
    t = time.perf_counter()
    grammars.check(grammar)
    cached = time.perf_counter() - t
    reply = json.dumps(REPLY)
    ids = tok.encode(reply, add_special_tokens=False)
    matchers = [grammars.matcher(grammar) for _ in range(streams)]
    times = []
    for token in ids:
        t = time.perf_counter()
        grammars.masks(matchers)
        times.append((time.perf_counter() - t) / streams)
        for m in matchers:
            m.consume_token(token)
    return {
        "compile_first_ms": first * 1e3,
        "compile_cached_ms": cached * 1e3,
        "mask_per_request_us_p50": statistics.median(times) * 1e6,
        "mask_per_request_us_max": max(times) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the demo model")
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "structured.json")
    args = parser.parse_args()
    model = args.model or demo_model()
    grammar = build_grammar("json", SCHEMA)
    report: dict[str, Any] = {"benchmark": "structured outputs", "schema": SCHEMA}
    report["grammar"] = grammar_costs(model, grammar, args.requests)
    print(json.dumps(report["grammar"], indent=1))
    report["runs"] = []
    for pp in args.pp:
        result = asyncio.run(run_pp(model, pp, args, grammar))
        report["runs"].append(result)
        print(
            f"PP={pp}: constrained/unconstrained throughput {result['throughput_ratio']:.3f}, "
            f"TTFT {result['ttft_ratio']:.3f}  {json.dumps(result['median'])}"
        )
    print(write_result(args.out, report, args))


if __name__ == "__main__":
    main()
