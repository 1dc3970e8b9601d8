"""A bystander's stream while hostile requests arrive: its rate against its rate alone, its longest
pause, what the hostile requests were answered, and how much the server's processes grew.

    .venv/bin/python -m benchmarks hostile [--model PATH] [--pp-size 2] [--seconds 20]

The attacks are those of issue 51's attack run: 8 concurrent prompt-scoring requests with n=12
(echo, logprobs, max_tokens 0) on a 100-token prompt, once in the phase, and beside it the 96
single requests that are the work n=12 made before a prompt was scored once; grammars past the
compile budget (a 2,700-rule chain, `a{1000000}`, ten distinct `(a{1000}){k}`, 300 `(a+)+`
patternProperties); one 16 MiB body of `9e307`; and one websocket asking for 3,000 requests.
Writes benchmarks/results/hostile.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.harness.record import RESULTS, write_result

ROOT = Path(__file__).resolve().parent.parent

Attack = Callable[[aiohttp.ClientSession, str, asyncio.Event, dict[str, Any]], Awaitable[None]]

COMP = "/v1/completions"
PROMPT = "The history of pipeline parallelism in serving large language models begins " * 8


@contextlib.contextmanager
def served(args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    cmd = [sys.executable, "-m", "ppserve.server.cli", "serve", "--port", "0", "--pp-size", str(args.pp_size)]
    cmd += ["--log-level", "warning"] + (["--model", args.model] if args.model else [])
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if match := re.search(r"at (http://\S+)", line):
                break
        else:
            raise RuntimeError("ppserve serve did not start")
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield match.group(1), proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def tree_rss_mib(pid: int) -> float:
    """Resident memory of `pid` and its descendants (the stages, the grammar and template workers)."""
    pids, total = [pid], 0
    while pids:
        p = pids.pop()
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * 4096
            for task in Path(f"/proc/{p}/task").iterdir():
                with contextlib.suppress(OSError):
                    pids += [int(c) for c in (task / "children").read_text().split()]
    return total / 2**20


async def bystander(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> tuple[float, float]:
    """(tokens per second, longest pause between tokens in seconds) of greedy streams run back to
    back until `stop`."""
    body = {"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "temperature": 0, "stream": True}
    tokens, start, longest = 0, time.monotonic(), 0.0
    while not stop.is_set():
        async with session.post(url + COMP, json=body) as resp:
            last = time.monotonic()
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    now = time.monotonic()
                    tokens, longest, last = tokens + 1, max(longest, now - last), now
                if stop.is_set():
                    break
    return tokens / (time.monotonic() - start), longest


def scoring(n: int, requests: int) -> Attack:
    """`requests` concurrent prompt-scoring requests with `n` choices each, once in the phase."""

    async def attack(session: aiohttp.ClientSession, url: str, stop: asyncio.Event, out: dict[str, Any]) -> None:
        body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0, "n": n}
        t = time.monotonic()

        async def one() -> int:
            async with session.post(url + COMP, json=body) as resp:
                await resp.read()
                return resp.status

        statuses = await asyncio.gather(*(one() for _ in range(requests)))
        out.update(ok=statuses.count(200), answered_in_s=round(time.monotonic() - t, 2))
        await stop.wait()

    return attack


async def grammars(session: aiohttp.ClientSession, url: str, stop: asyncio.Event, out: dict[str, Any]) -> None:
    chain = "start: a0\n" + "\n".join(f"a{i}: a{i + 1}" for i in range(2700)) + '\na2700: "x"'
    pattern = {"type": "object", "patternProperties": {f"^(a+)+{i}$": {"type": "string"} for i in range(300)}}
    hostile: list[dict[str, Any]] = [{"grammar": chain}, {"regex": "a{1000000}"}, {"json": pattern}]
    hostile += [{"regex": f"(a{{1000}}){{{k}}}"} for k in range(100000, 100010)]
    for constraint in hostile:
        t = time.monotonic()
        body = {"prompt": "hi", "max_tokens": 4, "structured_outputs": constraint}
        async with session.post(url + COMP, json=body) as resp:
            answer = await resp.json()
        out.setdefault("answers", []).append(
            {"status": resp.status, "seconds": round(time.monotonic() - t, 2), "message": answer["error"]["message"]}
        )
    await stop.wait()


async def big_body(session: aiohttp.ClientSession, url: str, stop: asyncio.Event, out: dict[str, Any]) -> None:
    junk = b"[" + b"9e307," * (16 * 2**20 // 6 - 20) + b"1]"
    body = b'{"prompt": "hi", "max_tokens": 2, "junk": ' + junk + b"}"
    t = time.monotonic()
    headers = {"Content-Type": "application/json"}
    async with session.post(url + COMP, data=body, headers=headers) as resp:
        await resp.read()
        out.update(status=resp.status, seconds=round(time.monotonic() - t, 2), body_mib=round(len(body) / 2**20, 1))
    await stop.wait()


async def websocket(session: aiohttp.ClientSession, url: str, stop: asyncio.Event, out: dict[str, Any]) -> None:
    async with session.ws_connect(url + "/ws") as ws:
        params = {"max_tokens": 64, "ignore_eos": True}
        for i in range(3000):
            await ws.send_json({"type": "generate", "id": str(i), "text": "hello", "sampling_params": params})
        counts: dict[str, int] = {}
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                event = await ws.receive_json(timeout=0.5)
                counts[event["type"]] = counts.get(event["type"], 0) + 1
        out.update(events=counts)


ATTACKS: dict[str, Attack] = {
    "echo_n12_x8": scoring(12, 8),
    "echo_n1_x96": scoring(1, 96),
    "grammars": grammars,
    "body_16mib_9e307": big_body,
    "websocket_3000": websocket,
}


async def run(args: argparse.Namespace, url: str, pid: int) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        report: dict[str, Any] = {}
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(args.seconds, stop.set)
        alone, alone_gap = await bystander(session, url, stop)
        report["alone"] = {"tok_s": round(alone, 1), "longest_gap_s": round(alone_gap, 3)}
        for name, attack in ATTACKS.items():
            rss = tree_rss_mib(pid)
            stop, out = asyncio.Event(), dict[str, Any]()
            asyncio.get_running_loop().call_later(args.seconds, stop.set)
            (rate, gap), _ = await asyncio.gather(bystander(session, url, stop), attack(session, url, stop, out))
            report[name] = {
                "bystander_tok_s": round(rate, 1),
                "bystander_ratio": round(rate / alone, 3),
                "longest_gap_s": round(gap, 3),
                "rss_growth_mib": round(tree_rss_mib(pid) - rss, 1),
                **out,
            }
            print(name, json.dumps(report[name])[:300], flush=True)
        return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the demo model")
    p.add_argument("--pp-size", type=int, default=2)
    p.add_argument("--seconds", type=float, default=30.0, help="each phase's length")
    args = p.parse_args(argv)
    with served(args) as (url, pid):
        report = asyncio.run(run(args, url, pid))
    print(write_result(RESULTS / "hostile.json", report, args))
