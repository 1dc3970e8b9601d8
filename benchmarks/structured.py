"""What a JSON schema costs: constrained against unconstrained chat requests, side by side.

On the demo model (or --model), at each PP size: bursts of --requests concurrent chat requests,
once with a JSON schema (response_format's json_schema, compiled and cached before the rounds)
and once without, in alternating rounds. Reports output tokens/s, TTFT p50 and their ratios
(constrained / unconstrained; targets >= 0.95 and <= 1.10), the throughput ratio of each round's
two bursts (their median: the machine's speed drifts between rounds), the CPU time per output
token of every process (the work a schema adds; it leaves out time the machine gives to other
tenants, though it still grows when they slow its cores), and, in-process, the grammar's
compile time (first and cached) and the time to compute one token's mask, along the replies the
model itself gave in the constrained bursts (all --requests streams, each at its own state).

    python -m benchmarks structured [--model PATH] [--pp 1 2] [--requests 32] [--rounds 7]
    python -m benchmarks structured --vllm DIR       # and against vLLM's CPU build

With --vllm DIR (a Hugging Face directory of the same model, float32 as in benchmarks/peers.py,
whose peers' venv it uses), ppserve (PP=1) and vLLM also serve the same requests over HTTP, in turn,
each engine constrained by response_format's json_schema and unconstrained.

Writes benchmarks/results/structured.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.record import RESULTS, write_result
from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.config import EngineConfig
from ppserve.engine.model.grammar import Grammars, build_grammar
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.server.demo import demo_model

ROOT = Path(__file__).resolve().parent.parent

# The schema the benchmark constrains to (the earlier grammar-engine study's, grammar_engines.json).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "employed"],
    "additionalProperties": False,
}
Replies = list[list[int]]  # each request's output token ids
TOPICS = ["a chef", "a pilot", "a poet", "a farmer", "a nurse", "a coder", "a judge", "a singer"]


async def burst(
    engine: AsyncEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    replies: Replies | None = None,
) -> dict[str, float]:
    """All requests at once: output tokens/s over the burst, the median time to first token, and
    the last stage's median decode step (its layers and sampling: the pipeline's bottleneck, and
    where the masks cost). `replies`, if given, gets each request's output token ids."""
    start, wall_start, cpu_start = time.perf_counter(), time.time(), cpu_seconds()
    ttft: list[float] = []

    async def one(prompt: list[int], p: SamplingParams) -> list[int]:
        ids: list[int] = []
        async for out in engine.generate(prompt, p):
            if not ids and out.token_ids:
                ttft.append(time.perf_counter() - start)
            ids += out.token_ids
        return ids

    each = await asyncio.gather(*(one(pr, p) for pr, p in zip(prompts, params, strict=True)))
    if replies is not None:
        replies[:] = each
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
    tokens = sum(len(ids) for ids in each)
    last = engine.config.pp_size - 1
    steps = [i.end - i.start for i in engine.timeline.since(wall_start) if i.stage == last and i.kind == "decode"]
    return {
        "tokens": tokens,
        "tok_s": tokens / wall,
        "ttft_p50_s": statistics.median(ttft),
        "cpu_ms_per_token": cpu * 1e3 / tokens,
        "last_stage_decode_ms": statistics.median(steps) * 1e3 if steps else float("nan"),  # none: 1-token replies
    }


def cpu_seconds() -> float:
    """CPU time (user and system) of this process and every process below it (the stages): the
    work a burst costs, without the time the machine gave to other tenants meanwhile."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError):  # (a process that ended meanwhile)
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
    return total


async def run_pp(model: Path, pp: int, args: argparse.Namespace, grammar: str) -> tuple[dict[str, Any], Replies]:
    """One PP size's rounds, and the constrained replies (token ids: seeded, the same every round)."""
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
        # Warm-up (the last stage compiles the grammar once too, and its lexer's states grow with
        # use), which also says how long each
        # constrained reply is (seeded: the same every round). The unconstrained requests then
        # generate exactly as many tokens, so both kinds of burst do the same work but the masks.
        replies: Replies = []
        for _ in range(2):  # llguidance builds its lexer's states as they are first met: warm them
            await burst(engine, prompts, constrained, replies)
        free = [
            SamplingParams(max_tokens=len(ids), temperature=0.8, seed=i, ignore_eos=True)
            for i, ids in enumerate(replies)
        ]
        rounds: dict[str, list[dict[str, float]]] = {"unconstrained": [], "constrained": []}
        for r in range(args.rounds):
            order = ["unconstrained", "constrained"] if r % 2 == 0 else ["constrained", "unconstrained"]
            for kind in order:
                rounds[kind].append(await burst(engine, prompts, free if kind == "unconstrained" else constrained))
    metrics = ("tok_s", "ttft_p50_s", "tokens", "cpu_ms_per_token", "last_stage_decode_ms")
    med = {k: {m: statistics.median(x[m] for x in v) for m in metrics} for k, v in rounds.items()}
    c, u = med["constrained"], med["unconstrained"]
    return {
        "pp": pp,
        "rounds": rounds,
        "median": med,
        "throughput_ratio": c["tok_s"] / u["tok_s"],
        "paired_throughput_ratio": _paired(rounds),
        "cpu_per_token_ratio": c["cpu_ms_per_token"] / u["cpu_ms_per_token"],
        "ttft_ratio": c["ttft_p50_s"] / u["ttft_p50_s"],
        "last_stage_decode_ratio": c["last_stage_decode_ms"] / u["last_stage_decode_ms"],
    }, replies


def grammar_costs(model: Path, grammar: str, replies: Replies) -> dict[str, float]:
    """In-process: compile time (fresh Grammars, then cached), and what a mask costs along the
    model's own replies (the last PP size's run; seeded, so the same at every size): all of them
    in step, as the last stage computes them, each mask timed."""
    from ppserve.engine.model.tokenizer import Tokenizer

    config = EngineConfig.create(model)  # a GGUF file's tokenizer is in its converted directory
    grammars = Grammars(Tokenizer(config.model).hf, config.model_config.vocab_size)
    t = time.perf_counter()
    grammars.check(grammar)
    first = time.perf_counter() - t
    t = time.perf_counter()
    grammars.check(grammar)
    cached = time.perf_counter() - t
    matchers = [grammars.matcher(grammar) for _ in replies]
    times: list[float] = []  # seconds per mask
    step_totals: list[float] = []  # seconds of masks per step, over every stream still running
    for step in range(1, max(map(len, replies))):  # the first mask is the grammar's, cached
        total = 0.0
        for m, ids in zip(matchers, replies, strict=True):
            if step < len(ids):
                m.consume_token(ids[step - 1])
                t = time.perf_counter()
                grammars.masks([m])
                times.append(time.perf_counter() - t)
                total += times[-1]
        step_totals.append(total)
    q = statistics.quantiles(times, n=100)
    return {
        "compile_first_ms": first * 1e3,
        "compile_cached_ms": cached * 1e3,
        "mask_us_p50": q[49] * 1e6,
        "mask_us_p90": q[89] * 1e6,
        "mask_us_p99": q[98] * 1e6,
        "mask_us_mean": statistics.mean(times) * 1e6,
        "masks_ms_per_step_mean": statistics.mean(step_totals) * 1e3,
    }


async def http_burst(
    url: str, prompts: list[str], schema: dict[str, Any] | None, counts: list[int] | None, max_tokens: int
) -> dict[str, float]:
    """A burst of chat requests over HTTP (streamed, to time the first token): with `schema`,
    constrained by response_format; else each generates counts[i] tokens (ignore_eos)."""
    import aiohttp

    start = time.perf_counter()
    ttft: list[float] = []

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        body: dict[str, Any] = {
            "model": "peer",
            "messages": [{"role": "user", "content": prompts[i]}],
            "temperature": 0.8,
            "seed": i,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if schema is not None:
            fmt = {"name": "person", "schema": schema, "strict": True}
            body |= {"response_format": {"type": "json_schema", "json_schema": fmt}, "max_tokens": max_tokens}
        else:
            assert counts is not None
            body |= {"max_tokens": counts[i], "ignore_eos": True}
        tokens, first = 0, True
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if first and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    ttft.append(time.perf_counter() - start)
                    first = False
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return tokens

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        each = await asyncio.gather(*(one(session, i) for i in range(len(prompts))))
    if counts is not None and schema is not None:
        counts[:] = each
    wall = time.perf_counter() - start
    return {"tokens": sum(each), "tok_s": sum(each) / wall, "ttft_p50_s": statistics.median(ttft)}


def against_vllm(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """ppserve PP=1 and vLLM on the same chat requests over HTTP, each constrained and not."""
    from benchmarks.harness import peer_servers

    peers_args = argparse.Namespace(dtype="float32", ppserve_args="", vllm_no_preload=False, start_timeout=600)
    prompts = [f"Describe {TOPICS[i % len(TOPICS)]} as a person." for i in range(args.requests)]
    out: dict[str, Any] = {}
    for name in ("ppserve-pp1", "vllm"):
        with peer_servers.serve(name, model_dir, peers_args) as server:
            counts: list[int] = [0] * args.requests
            asyncio.run(http_burst(server.url, prompts, SCHEMA, counts, args.max_tokens))  # warm-up, lengths
            rounds: dict[str, list[dict[str, float]]] = {"unconstrained": [], "constrained": []}
            for r in range(args.rounds):
                for kind in ["unconstrained", "constrained"][:: 1 if r % 2 == 0 else -1]:
                    schema = SCHEMA if kind == "constrained" else None
                    burst_ = http_burst(server.url, prompts, schema, None if schema else counts, args.max_tokens)
                    rounds[kind].append(asyncio.run(burst_))
        med = {k: {m: statistics.median(x[m] for x in v) for m in ("tok_s", "ttft_p50_s")} for k, v in rounds.items()}
        out[name] = {"rounds": rounds, "median": med, "constrained_over_unconstrained": _ratios(med, rounds)}
        print(name, json.dumps(out[name]["median"]), json.dumps(out[name]["constrained_over_unconstrained"]))
    p, v = out["ppserve-pp1"]["median"], out["vllm"]["median"]
    out["ppserve_over_vllm"] = {
        kind: {"tok_s": p[kind]["tok_s"] / v[kind]["tok_s"], "ttft": p[kind]["ttft_p50_s"] / v[kind]["ttft_p50_s"]}
        for kind in p
    }
    print("ppserve / vLLM", json.dumps(out["ppserve_over_vllm"]))
    return out


def _ratios(med: dict[str, dict[str, float]], rounds: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    c, u = med["constrained"], med["unconstrained"]
    paired = _paired(rounds)
    return {"tok_s": c["tok_s"] / u["tok_s"], "paired_tok_s": paired, "ttft": c["ttft_p50_s"] / u["ttft_p50_s"]}


def _paired(rounds: dict[str, list[dict[str, float]]]) -> float:
    """The median throughput ratio of each round's constrained burst to the unconstrained one next
    to it: the machine's speed drifts between rounds (by 20% and more) far more than within one."""
    pairs = zip(rounds["constrained"], rounds["unconstrained"], strict=True)
    return statistics.median(a["tok_s"] / b["tok_s"] for a, b in pairs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the demo model")
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--vllm", type=Path, default=None, help="also against vLLM, on this checkpoint")
    parser.add_argument("--out", type=Path, default=RESULTS / "structured.json")
    args = parser.parse_args(argv)
    model = args.model or demo_model()
    grammar = build_grammar("json", SCHEMA)
    report: dict[str, Any] = {"benchmark": "structured outputs", "schema": SCHEMA}
    report["runs"] = []
    for pp in args.pp:
        result, replies = asyncio.run(run_pp(model, pp, args, grammar))
        report["runs"].append(result)
        print(
            f"PP={pp}: constrained/unconstrained throughput {result['throughput_ratio']:.3f} "
            f"(paired rounds {result['paired_throughput_ratio']:.3f}), "
            f"CPU time per token {result['cpu_per_token_ratio']:.3f}, "
            f"last stage's decode step {result['last_stage_decode_ratio']:.3f}, "
            f"TTFT {result['ttft_ratio']:.3f}  {json.dumps(result['median'])}"
        )
    report["grammar"] = grammar_costs(model, grammar, replies)
    print(json.dumps(report["grammar"], indent=1))
    if args.vllm is not None:
        report["http"] = against_vllm(args.vllm, args)
    print(write_result(args.out, report, args))
