"""Prefix-cache benchmark: ppserve with `--enable-prefix-caching` against `--no-enable-prefix-caching`.

Each round starts the server twice, one after the other (caching on, then off; the order rotates
by round), and runs the same two workloads against each, after a warm-up request:

- multi_turn: 16 conversations x 6 turns, all conversations at once, each taking its turns in
  order. Every conversation opens with the same system prompt (~1500 tokens of random words);
  each turn adds a user message (50-100 tokens, seeded) after the server's previous reply, so
  the prompt grows and most of it was seen before: the case prefix caching is for.
- no_sharing: the same 16 x 6 requests, in the same pattern and with the same prompt lengths,
  but every prompt is fresh random text from its first token: nothing can hit. It measures what
  caching costs when it does not help (target: throughput on/off within 2%).

Requests stream /v1/chat/completions (temperature 0, ignore_eos, max_tokens 32). Reported per
workload, for on and off (medians over rounds) and side by side as ratios: throughput ((prompt +
completion) tokens / wall time, and completion tokens / wall time), TTFT p50/p90 (to the first
chunk carrying a token), the hit rate from `usage.prompt_tokens_details.cached_tokens` and from
the /metrics counters, and the tokens each stage computed. Also: whether greedy replies agree
between on and off, and the CPU other processes used meanwhile (`other_cpu_s`: load slows a run).

    .venv/bin/python -m benchmarks prefix-cache                        # small shape, PP=2, 1 round
    .venv/bin/python -m benchmarks prefix-cache --rounds 3 --shape realistic --kv-cache-gb 2
    .venv/bin/python -m benchmarks prefix-cache --quick                # tiny model, 4 x 2 turns: a check

Writes benchmarks/results/prefix_cache.json (`--out`); server logs go to build/peers/logs/. On 2
cores the defaults take about 5 minutes per round (estimated; more under other load), --quick 30 s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import string
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import serving as bs
from benchmarks.harness import peer_servers as peers
from benchmarks.harness.peers_setup import SHAPES, checkpoint
from benchmarks.harness.record import write_result
from ppserve.engine.model.tokenizer import Tokenizer
from ppserve.scheduler.request import Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.scheduler.scheduler import Scheduler, SchedulerConfig
from ppserve.server.demo import TINY_SPEC, tiny_random_checkpoint
from ppserve.transport.messages import Sampled, StepResult

ROOT = Path(__file__).resolve().parent.parent

STALL_S = 300  # a stream silent this long: the server is stuck (the request fails)
MAX_MODEL_LEN = 4096  # a 6-turn conversation on a 2K system prompt needs ~3K; every shape allows 4K
WORKLOADS = ("multi_turn", "no_sharing")
Messages = list[dict[str, str]]


@dataclass
class Reply:
    record: bs.Record  # timings, completion tokens, error
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0


def random_text(rng: random.Random, n_tokens: int, tok: Tokenizer) -> str:
    """About n_tokens tokens (by the served model's own tokenizer) of random lowercase words."""
    words: list[str] = []
    while True:
        words += ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(n_tokens // 4 + 8)]
        ids = tok.encode(" ".join(words), add_special_tokens=False)
        if len(ids) >= n_tokens:
            return tok.decode(ids[:n_tokens])


# ---- client ------------------------------------------------------------------------------------


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a server-sent-event stream (`data: [DONE]` ends it)."""
    async for line in resp.content:
        if line.startswith(b"data:") and (data := line[5:].strip()) != b"[DONE]":
            yield msgspec.json.decode(data)


async def chat(session: aiohttp.ClientSession, url: str, messages: Messages, max_tokens: int) -> Reply:
    body = {"model": peers.MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    reply, text = Reply(bs.Record()), []
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                reply.record.finish(0, f"HTTP {resp.status}: {(await resp.text())[:200]}")
                return reply
            async for event in sse_events(resp):
                if "error" in event:
                    reply.record.finish(0, str(event["error"])[:200])
                    return reply
                for choice in event.get("choices") or []:
                    # The first chunk only opens the message (its delta has the role, no token): it
                    # comes before any prefill, so TTFT counts from the first chunk after it. A
                    # token chunk's text may be empty (half a UTF-8 character): it still counts.
                    if "role" not in choice["delta"]:
                        reply.record.chunks.append(time.perf_counter())
                        text.append(choice["delta"].get("content") or "")
                if usage := event.get("usage"):
                    reply.prompt_tokens = usage["prompt_tokens"]
                    reply.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                    reply.record.output_tokens = usage["completion_tokens"]
    except (TimeoutError, aiohttp.ClientError) as e:
        reply.record.finish(0, repr(e))
        return reply
    reply.text = "".join(text)
    reply.record.finish(reply.record.output_tokens or len(reply.record.chunks))
    return reply


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """/metrics as {name or name[label values]: value}."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return {s.name + "".join(f"[{v}]" for v in s.labels.values()): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


# ---- one server --------------------------------------------------------------------------------

Prompter = Callable[[int, int, list[Reply]], Messages]  # (conversation, turn, replies so far) -> messages


async def workload(
    session: aiohttp.ClientSession, server: peers.Server, args: argparse.Namespace, prompter: Prompter
) -> tuple[dict[str, Any], list[list[Messages]], list[list[Reply]]]:
    """All conversations at once, each one's turns in order; the figures, and what was sent and got."""
    sent: list[list[Messages]] = [[] for _ in range(args.conversations)]

    async def conversation(c: int) -> list[Reply]:
        replies: list[Reply] = []
        for t in range(args.turns):
            if replies and replies[-1].record.error is not None:  # the next turn would need its reply
                replies.append(Reply(bs.Record().finish(0, "not sent: an earlier turn failed")))
                continue
            sent[c].append(prompter(c, t, replies))
            replies.append(await chat(session, server.url, sent[c][-1], args.max_tokens))
        return replies

    tree, me = [server.proc.pid, *peers.descendants(server.proc.pid)], [os.getpid()]
    before, cpu, client, busy = await scrape(session, server.url), bs.cpu_s(tree), bs.cpu_s(me), bs.machine_busy_s()
    start = time.perf_counter()
    replies = await asyncio.gather(*[conversation(c) for c in range(args.conversations)])
    duration = time.perf_counter() - start
    cpu, client, busy = bs.cpu_s(tree) - cpu, bs.cpu_s(me) - client, bs.machine_busy_s() - busy
    after = await scrape(session, server.url)

    flat = [r for conv in replies for r in conv]
    out = bs.summarize([bs.Job([], args.max_tokens, 0.0) for _ in flat], [r.record for r in flat], duration)
    del out["_samples"]
    ok = [r for r in flat if r.record.error is None]
    prompt, cached = sum(r.prompt_tokens for r in ok), sum(r.cached_tokens for r in ok)
    completion = sum(r.record.output_tokens for r in ok)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    queries = delta["ppserve_prefix_cache_queries_total"]
    out |= {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "total_token_throughput": (prompt + completion) / duration,
        "hit_rate_usage": cached / prompt if prompt else 0.0,
        "hit_rate_metrics": delta["ppserve_prefix_cache_hits_total"] / queries if queries else 0.0,
        "prefix_cache_blocks_at_end": after["ppserve_prefix_cache_blocks"],
        "prefix_cache_evictions": delta["ppserve_prefix_cache_evictions_total"],
        "preemptions": delta["ppserve_preemptions_total"],
        "kv_blocks_total": after["ppserve_kv_blocks_total"],  # per stage, of --block-size tokens (default 16)
        "server_cpu_s": cpu,
        "other_cpu_s": busy - cpu - client,
    }
    for stage in range(args.pp_size):  # with caching, a hit is a token no stage computes
        out[f"stage{stage}_computed_tokens"] = delta[f"ppserve_stage_computed_tokens_total[{stage}]"]
    return out, sent, replies


async def bench_server(
    server: peers.Server, args: argparse.Namespace, prompts: dict[str, Prompter], tok: Tokenizer
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Warm-up, then each workload; the figures, and the multi-turn replies (greedy: on and off
    should agree)."""
    connector = aiohttp.TCPConnector(limit=0)  # no cap: all conversations are in flight at once
    timeout = aiohttp.ClientTimeout(total=None, sock_read=STALL_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # First-call costs (kernels, allocator) before timing; its text is shared with nothing.
        warm = [{"role": "user", "content": random_text(random.Random(f"{args.seed}-warm"), 256, tok)}]
        if (error := (await chat(session, server.url, warm, args.max_tokens)).record.error) is not None:
            raise RuntimeError(f"warm-up request failed: {error}")
        results: dict[str, dict[str, Any]] = {}
        texts: list[str] = []
        for name in WORKLOADS:
            results[name], sent, replies = await workload(session, server, args, prompts[name])
            if results[name]["failed"]:  # figures of a server that fails requests would mislead
                raise RuntimeError(f"{name}: {results[name]['failed']} requests failed: {results[name]['errors']}")
            if name == "multi_turn":
                texts = [r.text for conv in replies for r in conv]
                if "no_sharing" not in prompts:  # the first run sets the no-sharing prompt lengths
                    prompts["no_sharing"] = no_sharing(sent, args, tok)
        return results, texts


# ---- workloads ---------------------------------------------------------------------------------


def multi_turn(args: argparse.Namespace, tok: Tokenizer, system: str) -> Prompter:
    def user(c: int, t: int) -> str:  # seeded by place: the same text whatever else changes
        rng = random.Random(f"{args.seed}-user-{c}-{t}")
        return random_text(rng, rng.randint(*args.user_tokens), tok)

    users = [[user(c, t) for t in range(args.turns)] for c in range(args.conversations)]

    def prompt(c: int, t: int, replies: list[Reply]) -> Messages:
        messages = [{"role": "system", "content": system}]
        for k in range(t):
            messages += [{"role": "user", "content": users[c][k]}, {"role": "assistant", "content": replies[k].text}]
        return [*messages, {"role": "user", "content": users[c][t]}]

    return prompt


def no_sharing(sent: list[list[Messages]], args: argparse.Namespace, tok: Tokenizer) -> Prompter:
    """Prompts as long as the multi-turn ones (by the chat template's own count), fresh random
    text from the first token, the same for every server and round."""
    overhead = len(tok.apply_chat_template([{"role": "user", "content": ""}]))

    def fresh(c: int, t: int) -> Messages:
        n = len(tok.apply_chat_template(sent[c][t])) - overhead
        return [{"role": "user", "content": random_text(random.Random(f"{args.seed}-fresh-{c}-{t}"), n, tok)}]

    prompts = [[fresh(c, t) for t in range(len(conv))] for c, conv in enumerate(sent)]
    return lambda c, t, _: prompts[c][t]


# ---- the host's share ---------------------------------------------------------------------------


def scheduler_seconds(prompts: list[list[int]], args: argparse.Namespace, caching: bool) -> float:
    """Seconds the scheduler alone (all of caching's work is there: hashing, lookups,
    registering) takes to plan these requests to the end, results fed back at once; best of 5."""
    best = float("inf")
    for _ in range(5):
        cfg = SchedulerConfig(num_blocks=1 << 16, block_size=16, pp_size=args.pp_size, enable_prefix_caching=caching)
        s = Scheduler(cfg)
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        start = time.perf_counter()
        for i, ids in enumerate(prompts):
            s.add(Request(str(i), ids, params))
        while s.has_work:
            while (plan := s.schedule()) is not None:
                s.update(StepResult(plan.mb_id, [Sampled(c.request_id, 7) for c in plan.chunks if c.sample], []))
        best = min(best, time.perf_counter() - start)
    return best


def host_overhead(prompts: Prompter, args: argparse.Namespace, tok: Tokenizer, wall_s: float) -> dict[str, float]:
    """What caching adds to the scheduler's work for the no-sharing requests, against the wall
    time their run took with caching off: the overhead without the run-to-run noise."""
    ids = [tok.apply_chat_template(prompts(c, t, [])) for c in range(args.conversations) for t in range(args.turns)]
    on, off = scheduler_seconds(ids, args, True), scheduler_seconds(ids, args, False)
    return {"scheduler_s_on": on, "scheduler_s_off": off, "fraction_of_run": (on - off) / wall_s}


# ---- report ------------------------------------------------------------------------------------

ROWS = {  # key: table label, and its ratio: on/off where higher is better, off/on where lower is
    "total_token_throughput": ("total tok/s", "on_over_off"),
    "output_token_throughput": ("output tok/s", "on_over_off"),
    "ttft_ms_p50": ("TTFT p50 (ms)", "off_over_on"),
    "ttft_ms_p90": ("TTFT p90 (ms)", "off_over_on"),
    "hit_rate_usage": ("hit rate (usage)", None),
    "hit_rate_metrics": ("hit rate (/metrics)", None),
    "stage0_computed_tokens": ("stage 0 tokens", "off_over_on"),
}


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, extra: dict[str, Any]) -> dict[str, Any]:
    workloads: dict[str, Any] = {}
    for name in WORKLOADS:
        on, off = (bs.median_summary([r[name] for r in runs[m]]) for m in ("on", "off"))
        pairs = {f"{k}_{kind}": (on[k], off[k]) if kind == "on_over_off" else (off[k], on[k])
                 for k, (_, kind) in ROWS.items() if kind}  # fmt: skip
        workloads[name] = {"on": on, "off": off, "ratios": {k: a / b if b else None for k, (a, b) in pairs.items()}}
    return {
        "benchmark": "prefix_cache",
        **extra,
        "machine": {"loadavg_at_end": os.getloadavg()},  # beside what write_result records
        "workloads": workloads,
        "rounds": runs,  # every round's figures, each workload's errors among them
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"{'':20s}" + "".join(f"{f'{w} {m}':>17s}" for w in WORKLOADS for m in ("on", "off", "ratio")))
    for key, (label, kind) in ROWS.items():
        cells = []
        for w in (result["workloads"][name] for name in WORKLOADS):
            ratio, fmt = w["ratios"].get(f"{key}_{kind}"), ".3f" if "rate" in key else ".1f"
            ratio = "" if ratio is None else f"{ratio:.3f}"
            cells += [f"{w['on'][key]:17{fmt}}", f"{w['off'][key]:17{fmt}}", f"{ratio:>17s}"]
        print(f"{label:20s}" + "".join(cells))
    ratio = result["workloads"]["no_sharing"]["ratios"]["total_token_throughput_on_over_off"]
    print(f"no sharing, throughput on/off: {ratio:.3f} (target: within 2% of 1)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a check: tiny model, 4 conversations x 2 turns")
    p.add_argument("--shape", choices=["tiny", *sorted(SHAPES)], default=None, help="default small (--quick: tiny)")
    p.add_argument("--pp-size", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="per stage; the small shape holds ~130K tokens")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=1500, help="the shared system prompt's length")
    p.add_argument("--user-tokens", type=bs.parse_range, default=(50, 100), help="each user message, LO:HI")
    p.add_argument("--max-tokens", type=int, default=32, help="each reply (ignore_eos: exactly this many)")
    p.add_argument("--rounds", type=int, default=1, help="each starts both servers; figures are medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ppserve-args", default="", help='extra `ppserve serve` flags, e.g. "--block-size 32"')
    p.add_argument("--start-timeout", type=float, default=900, help="seconds a server may take to come up")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/prefix_cache.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.system_tokens = 4, 2, 300
    args.shape = args.shape or ("tiny" if args.quick else "small")
    return args


def progress(run: str, result: dict[str, dict[str, Any]]) -> None:
    for name, w in result.items():
        others = w["other_cpu_s"] / w["duration_s"]  # cores, on average; much of it slows the run
        warn = f"; warning: other processes used {others:.2f} cores" if others > 0.25 else ""
        print(f"{run} {name}: {w['total_token_throughput']:.0f} tok/s, TTFT p50 {w['ttft_ms_p50']:.0f} ms, "
              f"hit rate {w['hit_rate_usage']:.2f}{warn}")  # fmt: skip
        # Preempted requests recompute their prompts, and evicted conversations lose their hits:
        # either would measure a cache too small for the workload, not caching itself.
        if w["preemptions"] or (name == "multi_turn" and w["prefix_cache_evictions"]):
            print(f"  warning: the KV cache is too small ({w['preemptions']:.0f} preemptions, "
                  f"{w['prefix_cache_evictions']:.0f} evictions): raise --kv-cache-gb")  # fmt: skip


def measure(argv: list[str] | None) -> None:
    args = parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # each unwinds the `with`: the server stops
        signal.signal(sig, peers.interrupt)
    t0 = time.monotonic()
    model_dir = tiny_random_checkpoint() if args.shape == "tiny" else checkpoint(args.shape)
    tok = Tokenizer(model_dir)
    system = random_text(random.Random(f"{args.seed}-system"), args.system_tokens, tok)
    prompts: dict[str, Prompter] = {"multi_turn": multi_turn(args, tok, system)}
    common = f"--kv-cache-gb {args.kv_cache_gb} --max-model-len {MAX_MODEL_LEN}"
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    replies: dict[str, list[str]] = {}
    for r in range(args.rounds):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):  # drift in speed hits both alike
            flags = f"{common} --{'' if mode == 'on' else 'no-'}enable-prefix-caching {args.ppserve_args}"
            ns = argparse.Namespace(
                shape=args.shape, dtype=args.dtype, ppserve_args=flags, start_timeout=args.start_timeout
            )
            # One server at a time: with 2 cores, two would slow each other down.
            with peers.serve(f"ppserve-pp{args.pp_size}", model_dir, ns) as server:
                result, texts = uvloop.run(bench_server(server, args, prompts, tok))
            runs[mode].append(result)
            replies.setdefault(mode, texts)
            progress(f"round {r + 1} caching {mode}", result)
    same = [a == b for a, b in zip(replies["on"], replies["off"], strict=True)]  # first round of each
    wall_off = statistics.median(r["no_sharing"]["duration_s"] for r in runs["off"])
    host = host_overhead(prompts["no_sharing"], args, tok, wall_off)
    extra = {"host_overhead_no_sharing": host,
             "model_dir": str(model_dir), "model_shape": SHAPES.get(args.shape, str(TINY_SPEC)),
             "system_prompt_tokens": len(tok.encode(system, add_special_tokens=False)),
             "server_flags": f"{common} {args.ppserve_args}".strip(),  # and --[no-]enable-prefix-caching
             "greedy_replies_identical_fraction": sum(same) / len(same),
             "wall_s": round(time.monotonic() - t0)}  # fmt: skip
    result = report(runs, args, extra)
    out = write_result(args.out, result, args)
    print_table(result)
    print(f"scheduler, no-sharing requests: {host['scheduler_s_on'] * 1e3:.1f} ms with caching, "
          f"{host['scheduler_s_off'] * 1e3:.1f} ms without: {host['fraction_of_run']:.2%} of the run")  # fmt: skip
    print(f"greedy multi-turn replies identical on vs off: {extra['greedy_replies_identical_fraction']:.0%}")
    print(f"wrote {out} in {extra['wall_s']} s")


def main(argv: list[str] | None = None) -> None:
    try:
        measure(argv)
    except (KeyboardInterrupt, RuntimeError) as e:  # a signal, a server that did not start, failed requests
        sys.exit(f"{'interrupted' if isinstance(e, KeyboardInterrupt) else f'error: {e}'} (no server is left running)")
