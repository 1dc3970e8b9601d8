"""Speculative decoding benchmark: ppserve with drafts, without them, and llama-server's n-gram lookup.

The demo model's weights in float32 (ppserve reads benchmarks/harness/peers_setup.py's float checkpoint,
llama-server its F32 GGUF conversion: the same numbers). Four workloads, each NUM_REQUESTS chat
requests, greedy: (a) code editing (a 60-line function to rewrite with a small change), (b) answers
that quote a passage of the prompt, (c) JSON extraction with a schema (a grammar: ppserve drafts
its forced tokens too), (d) open-ended chat. Each is run at batch 1 (one request after another)
and as NUM_REQUESTS concurrent streams; output tokens per second are compared side by side, every
engine on the same machine in one run. ppserve with and without drafts are served at the same time
and take turns (request by request at batch 1, round by round for the streams, the first of them
alternating), so that the machine's drift between sequential runs does not enter their ratio.
ppserve at PP=2 runs with and without drafts too (in the same way), for the stages' busy share.
llama-server runs each n-gram --spec-type (and none), at batch 1 unless --llama-modes says streams
too.

    .venv/bin/python -m benchmarks speculative                       # all engines (about 50 minutes)
    .venv/bin/python -m benchmarks speculative --engines ppserve-spec,ppserve-off --workloads a,d
    .venv/bin/python -m benchmarks speculative --engines ppserve-spec,ppserve-off,ppserve-pp2-spec,ppserve-pp2-off \
        --carry benchmarks/results/speculative.json        # ppserve again, llama-server's figures kept

Writes benchmarks/results/speculative.json; server logs go to build/peers/logs/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.harness.peer_servers import MODEL_NAME, free_port, healthy, interrupt, kill_tree
from benchmarks.harness.peers_setup import LLAMA_SERVER, LOGS, gguf, setup_llama_server, smollm2_hf_dir
from benchmarks.harness.record import read_result, write_result

ROOT = Path(__file__).resolve().parent.parent
LLAMA_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")
# ppserve-control-a and -b: two servers without drafts, side by side like the others: the ratio of
# two identical engines, what the spec/off ratios cannot tell from the machine's noise.
PPSERVE = (
    "ppserve-spec",
    "ppserve-off",
    "ppserve-pp2-spec",
    "ppserve-pp2-off",
    "ppserve-control-a",
    "ppserve-control-b",
)
ENGINES = (*PPSERVE, *(f"llama-{t}" for t in LLAMA_TYPES))
Job = tuple[str, dict[str, Any]]  # a prompt and the request's extra fields
Chunk = tuple[list[dict[str, Any]], float]  # results timed together: one request, or a round of streams
Results = dict[str, dict[str, Any]]  # engine -> "workload/mode" -> what was measured
WORDS = "river stone lamp orange cloud signal harbor meadow copper thread window garden engine lantern".split()


def code_prompt(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A 60-line function, and the request to rewrite it with one variable renamed."""
    name, var = rng.choice(WORDS), rng.choice(WORDS)
    lines = [
        f"def process_{name}(records, limit=10):",
        f'    """Summarise the {name} records."""',
        f"    {var}_total = 0",
    ]
    for i in range(19):
        field = rng.choice(WORDS)
        lines += [
            f"    for item in records[{i}::20]:",
            f"        if item.get('{field}') is not None and {var}_total < limit * {i + 1}:",
            f"            {var}_total += int(item['{field}']) % {rng.randint(3, 97)}",
        ]
    lines += [f"    return {var}_total"]
    text = "\n".join(lines)
    new = rng.choice([w for w in WORDS if w != var])
    ask = (
        f"Rewrite this Python function, renaming the variable {var}_total to {new}_total. Reply with the code only.\n\n"
    )
    return ask + text, {}


def quote_prompt(rng: random.Random) -> tuple[str, dict[str, Any]]:
    topic = rng.choice(WORDS)
    sentences = [
        f"The {topic} festival began in the year {rng.randint(1700, 1990)} in a small town by the sea.",
        f"Every spring, people bring {rng.choice(WORDS)} lanterns and walk along the {rng.choice(WORDS)} road.",
        f"The oldest {topic} in the town is kept in a museum near the {rng.choice(WORDS)} market.",
        f"Visitors say the {topic} smells of {rng.choice(WORDS)} and salt after the rain.",
        f"In {rng.randint(1991, 2020)} the festival was moved to the {rng.choice(WORDS)} square.",
    ]
    passage = " ".join(sentences * 2)
    return f"Passage: {passage}\n\nQuote, word for word, every sentence of the passage that mentions the {topic}.", {}


SCHEMA = {
    "type": "object",
    "properties": {
        "full_name": {"type": "string", "maxLength": 40},
        "home_city": {"type": "string", "maxLength": 30},
        "occupation": {"type": "string", "maxLength": 30},
        "age_in_years": {"type": "integer", "minimum": 0, "maximum": 120},
        "favourite_things": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["full_name", "home_city", "occupation", "age_in_years", "favourite_things"],
    "additionalProperties": False,
}


def json_prompt(rng: random.Random) -> tuple[str, dict[str, Any]]:
    first, city = (
        rng.choice(["Ada", "Bruno", "Chloe", "Dmitri", "Elena"]),
        rng.choice(["Lyon", "Porto", "Oslo", "Quito"]),
    )
    things = rng.sample(WORDS, 3)
    text = (
        f"{first} {rng.choice(WORDS).title()} is a {rng.randint(20, 70)}-year-old {rng.choice(WORDS)} maker from "
        f"{city}. {first} loves {things[0]}, {things[1]} and {things[2]}."
    )
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    return f"Extract the person described below as JSON.\n\n{text}", {"response_format": fmt}


def chat_prompt(rng: random.Random) -> tuple[str, dict[str, Any]]:
    return f"Tell me a short story about a {rng.choice(WORDS)} and a {rng.choice(WORDS)}.", {}


WORKLOADS = {"a": code_prompt, "b": quote_prompt, "c": json_prompt, "d": chat_prompt}
NAMES = {"a": "code editing", "b": "quoting QA", "c": "JSON extraction", "d": "open chat"}


def command(name: str, port: int, model_dir: Path) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port)]
    if name.startswith("ppserve"):
        pp = "2" if "-pp2" in name else "1"
        mode = "ngram" if name.endswith("-spec") else "off"
        cmd = [str(Path(sys.executable).parent / "ppserve"), "serve", "--model", str(model_dir), "--pp-size", pp]
        cmd += ["--quantization", "none", "--dtype", "float32", "--max-model-len", "4096", "--speculative", mode]
        cmd += ["--no-enable-prefix-caching", "--log-level", "warning", "--served-model-name", MODEL_NAME]
        return [*cmd, *common]
    spec = name.removeprefix("llama-")
    cmd = [str(LLAMA_SERVER), "-m", str(gguf(model_dir, "float32")), "-t", str(os.cpu_count()), "-np", "16"]
    cmd += ["-c", str(16 * 4096), "--no-cache-prompt", "--cache-ram", "0", "--alias", MODEL_NAME]
    return [*cmd, *([] if spec == "none" else ["--spec-type", spec]), *common]


@contextlib.contextmanager
def served(name: str, model_dir: Path) -> Iterator[str]:
    port = free_port()
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"spec-{name}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            command(name, port, model_dir), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start: see {log}")
            time.sleep(1)
        yield url
    finally:
        kill_tree(proc)


async def one(session: aiohttp.ClientSession, url: str, prompt: str, extra: dict[str, Any], n: int) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0}
    body["speculative_usage"] = True  # ppserve's acceptance counts (other servers ignore the field)
    async with session.post(url + "/v1/chat/completions", json={**body, **extra}) as r:
        data = await r.json()
    if "choices" not in data:
        raise RuntimeError(f"{url}: {data}")
    usage, timings = data["usage"], data.get("timings", {})
    spec = usage.get("speculative") or {}
    return {
        "tokens": usage["completion_tokens"],
        "text": data["choices"][0]["message"]["content"] or "",
        "draft_tokens": spec.get("draft_tokens", timings.get("draft_n", 0)),
        "accepted_tokens": spec.get("accepted_tokens", timings.get("draft_n_accepted", 0)),
    }


def busy(url: str) -> list[float]:
    """ppserve's stages' busy share over its recent window (/metrics)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return [float(v) for v in re.findall(r'^ppserve_stage_busy_fraction\{stage="\d+"\} (\S+)$', text, re.M)]


def summary(chunks: list[Chunk]) -> dict[str, Any]:
    """Output tokens per second over timed chunks of results (a request, or a round of streams)."""
    results = [r for rs, _ in chunks for r in rs]
    tokens, seconds = sum(r["tokens"] for r in results), sum(s for _, s in chunks)
    drafted, kept = sum(r["draft_tokens"] for r in results), sum(r["accepted_tokens"] for r in results)
    out = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "draft_tokens": drafted}
    out |= {"accepted_tokens": kept, "acceptance_rate": kept / drafted if drafted else None}
    out["texts"] = [r["text"][:200] for r in results[:2]]
    return out


async def timed(session: aiohttp.ClientSession, url: str, jobs: list[Job], n: int, concurrent: bool) -> Chunk:
    start = time.perf_counter()
    if concurrent:
        results = list(await asyncio.gather(*(one(session, url, p, e, n) for p, e in jobs)))
    else:
        results = [await one(session, url, p, e, n) for p, e in jobs]
    return results, time.perf_counter() - start


async def run(urls: dict[str, str], jobs: list[Job], n: int, concurrent: bool, rounds: int) -> dict[str, Any]:
    """The jobs on each engine of `urls` (served side by side), taking turns so that the machine's
    drift falls on every engine alike: at batch 1 request by request, as streams round by round
    (`rounds` each); which engine goes first alternates."""
    chunks: dict[str, list[Chunk]] = {name: [] for name in urls}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        for url in urls.values():
            await one(session, url, jobs[0][0], jobs[0][1], 8)  # warm up (grammar compiles, caches)
        turns = [jobs] * rounds if concurrent else [[job] for job in jobs]
        busy_rounds: dict[str, list[list[float]]] = {name: [] for name in urls}
        for i, turn in enumerate(turns):
            for name in list(urls)[:: 1 if i % 2 == 0 else -1]:
                chunks[name].append(await timed(session, urls[name], turn, n, concurrent))
                if concurrent and name.startswith("ppserve"):  # right after its own round, not the other's
                    busy_rounds[name].append(busy(urls[name]))
    out = {name: summary(c) for name, c in chunks.items()}
    if concurrent:
        for name, c in chunks.items():
            out[name]["round_tokens_per_s"] = [sum(r["tokens"] for r in rs) / s for rs, s in c]
            if busy_rounds[name]:  # each stage's median over the rounds
                out[name]["stage_busy"] = [statistics.median(b) for b in zip(*busy_rounds[name], strict=True)]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--workloads", default="a,b,c,d")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--modes", default="batch1,streams", help="batch1,streams: what to run (default both)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the streams per engine (default 3)")
    p.add_argument("--llama-modes", default="batch1", help="batch1,streams: llama-server's runs (default batch1)")
    p.add_argument("--llama-workloads", default="a,b,c,d", help="llama-server's workloads (default all)")
    p.add_argument(
        "--carry", help="an earlier result file: its engines this run leaves out are kept, with their commit"
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/speculative.json"))
    return p.parse_args(argv)


def groups(engines: list[str]) -> list[list[str]]:
    """The engines in the order given, ppserve's with the same name but for the last part (-spec and
    -off, or the control's -a and -b) as one group, served side by side."""
    out: dict[str, list[str]] = {}
    for name in engines:
        key = name.rsplit("-", 1)[0] if name.startswith("ppserve") else name
        out.setdefault(key, []).append(name)
    return list(out.values())


def measure(args: argparse.Namespace, group: list[str], urls: dict[str, str], data: dict[str, list[Job]]) -> Results:
    """Every workload and mode that applies to the group's engines, run on them side by side."""
    results: Results = {name: {} for name in group}
    for w in data:
        for mode, concurrent in (("batch1", False), ("streams", True)):
            if mode not in args.modes.split(","):
                continue
            if "-pp2" in group[0] and mode == "batch1":
                continue  # PP=2 is here for the stages' busy share under load
            if group[0].startswith("llama") and (
                mode not in args.llama_modes.split(",") or w not in args.llama_workloads
            ):
                continue
            try:
                measured = asyncio.run(run(urls, data[w], args.max_tokens, concurrent, args.rounds))
            except RuntimeError as e:  # (llama-server refuses a schema with --spec-type)
                for name in group:
                    results[name][f"{w}/{mode}"] = {"error": str(e)[:300]}
                print(f"{'+'.join(group):18} {w} {mode:8} failed: {e}", flush=True)
                continue
            for name, r in measured.items():
                results[name][f"{w}/{mode}"] = r
                print(f"{name:18} {w} {mode:8} {r['tokens_per_s']:7.1f} tok/s  accepted {r['accepted_tokens']}/"
                      f"{r['draft_tokens']}", flush=True)  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> None:
    import signal

    signal.signal(signal.SIGTERM, interrupt)
    args = parse_args(argv)
    engines, workloads = args.engines.split(","), args.workloads.split(",")
    model_dir = smollm2_hf_dir()
    if any(e.startswith("llama") for e in engines):
        setup_llama_server()
    data = {w: [WORKLOADS[w](random.Random(1000 * i + ord(w))) for i in range(args.num_requests)] for w in workloads}
    results, carried = carry(args.carry, engines)
    for group in groups(engines):
        with contextlib.ExitStack() as stack:
            urls = {name: stack.enter_context(served(name, model_dir)) for name in group}
            results |= measure(args, group, urls, data)
        report(args, results, carried)  # after each group: a run cut short keeps what it measured


def carry(path: str | None, engines: list[str]) -> tuple[Results, dict[str, str]]:
    """The figures of the engines this run does not measure, from an earlier result file, and the
    commit each was measured at (llama-server's do not change with ppserve's code)."""
    if path is None:
        return {}, {}
    earlier = read_result(path)
    kept = {e: r for e, r in earlier["results"].items() if e not in engines}
    return kept, {e: earlier.get("carried", {}).get(e, earlier["commit"]) for e in kept}


def report(args: argparse.Namespace, results: Results, carried: dict[str, str]) -> None:
    ratios: dict[str, Any] = {}
    workloads = sorted({key.split("/")[0] for r in results.values() for key in r})  # carried ones too
    for w in workloads:
        for mode in ("batch1", "streams"):
            key = f"{w}/{mode}"
            have = {e: r[key]["tokens_per_s"] for e, r in results.items() if "tokens_per_s" in r.get(key, {})}
            for a, b, label in (("spec", "off", "spec/off"), ("control-b", "control-a", "control b/a")):
                if f"ppserve-{a}" in have and f"ppserve-{b}" in have:
                    ratios[f"{key}: {label}"] = have[f"ppserve-{a}"] / have[f"ppserve-{b}"]
            llamas = {e: v for e, v in have.items() if e.startswith("llama") and e != "llama-none"}
            if "ppserve-spec" in have and llamas:
                best = max(llamas, key=llamas.__getitem__)
                ratios[f"{key}: spec/{best}"] = have["ppserve-spec"] / llamas[best]
    for k, v in ratios.items():
        print(f"{k:40} {v:.2f}x")
    out = {"benchmark": "speculative decoding", "workloads": {w: NAMES[w] for w in workloads}}
    out |= {"results": results, "ratios": ratios, "carried": carried}
    print("wrote", write_result(args.out, out, args))
