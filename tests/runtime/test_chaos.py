"""Chaos: stages killed and paused under load, and the host paused. Every request completes with
exactly the tokens of a fault-free run, and nothing leaks."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from helpers import alive, random_prompt
from live_server import LiveServer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("watch_loops")]  # event loops checked (conftest.py)

NUM_REQUESTS = 64
MAX_TOKENS = 160
SEED = 20261130  # the faults' moments and victims (fixed, so a failure can be replayed)


async def _stream(session: aiohttp.ClientSession, server: LiveServer, ids: list[int], progress: list[int]) -> list[int]:
    """One streaming greedy /generate request; its token ids."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    tokens: list[int] = []
    async with session.post(server.url + "/generate", json=body, headers=server.headers) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event  # a pause, never an error
            tokens += event["token_ids"]
            progress[0] += len(event["token_ids"])
    return tokens


async def _run(server: LiveServer, prompts: list[list[int]], progress: list[int]) -> list[list[int]]:
    timeout = aiohttp.ClientTimeout(total=300)  # a guard against a hang
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*[_stream(session, server, p, progress) for p in prompts])


def _shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()} if Path("/dev/shm").is_dir() else set()


async def _until(predicate: Any, what: str, timeout_s: float = 120.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)
    assert predicate(), what


def test_chaos_kills_and_pauses_lose_nothing(llama_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    prompts = [random_prompt(rng, rng.randint(8, 96)) for _ in range(NUM_REQUESTS)]
    shm_before = _shm_segments()
    scratch = tmp_path / "tmp"  # the server's TMPDIR: where its socket files live
    scratch.mkdir()
    flags = ("--pp-size", "3", "--kv-cache-gb", "0.05", "--max-stage-restarts", "5")
    server = LiveServer(llama_dir, *flags, env={"TMPDIR": str(scratch)})
    assert any(p.name.startswith("ppserve-") for p in scratch.iterdir())  # the socket directory is there
    health: list[str] = []  # every /health status seen while the faults run
    killed: list[int] = []
    try:
        reference = asyncio.run(_run(server, prompts, [0]))
        assert all(len(t) == MAX_TOKENS for t in reference)

        async def chaos() -> list[list[int]]:
            progress = [0]
            run = asyncio.ensure_future(_run(server, prompts, progress))
            total = NUM_REQUESTS * MAX_TOKENS
            # Three kills and one pause, each at a random point of the run, on a random stage.
            moments = sorted(rng.uniform(0.05, 0.85) * total for _ in range(4))
            faults = ["kill", "kill", "kill", "stop"]
            rng.shuffle(faults)
            for at, fault in zip(moments, faults, strict=True):
                await _until(lambda at=at: progress[0] >= at or run.done(), "progress")
                await _until(lambda: _health(server) == "ok", "a healthy pipeline before the next fault")
                victim = rng.choice(server.stage_pids())
                if fault == "kill":
                    os.kill(victim, signal.SIGKILL)
                    killed.append(victim)
                    await _until(lambda: _record(server, health) == "recovering", "/health to say it is recovering")
                    await _until(lambda: _record(server, health) == "ok", "the pipeline to heal")
                else:
                    os.kill(victim, signal.SIGSTOP)  # shorter than --stage-timeout: a pause, not a death
                    await asyncio.sleep(5.0)  # the length of the fault itself
                    os.kill(victim, signal.SIGCONT)
            return await run

        results = asyncio.run(chaos())
        for i, (got, want) in enumerate(zip(results, reference, strict=True)):
            assert got == want, f"request {i} differs after the faults"
        m = server.metrics()
        assert sum(v for k, v in m.items() if k.startswith("ppserve_stage_restarts_total")) == len(killed) == 3
        assert m["ppserve_preemptions_total"] >= 1
        assert m["ppserve_kv_blocks_used"] == 0  # no KV block leaked
        current = server.stage_pids()
        assert len(current) == 3 and not set(current) & set(killed)
        assert not any(alive(p) for p in killed)  # replaced processes are gone, not orphaned
    finally:
        for pid in server.stage_pids():
            os.kill(pid, signal.SIGCONT)  # never leave a stopped process behind
        assert server.stop() == 0, "".join(server.output)
    assert not any(alive(p) for p in current)
    assert not list(scratch.iterdir()), "socket files left behind"
    assert _shm_segments() <= shm_before, "shared memory left behind"


def _health(server: LiveServer) -> str:
    status, _, body = server.request("GET", "/health")
    return str(json.loads(body)["status"]) if status in (200, 503) else f"http {status}"


def _record(server: LiveServer, seen: list[str]) -> str:
    status = _health(server)
    seen.append(status)
    return status


def test_paused_host_does_not_blame_its_stages(llama_dir: Path) -> None:
    """Pausing the host (not a stage) for longer than a heartbeat gap must not look like a stage
    failure: no stage is replaced and the stream that was running completes."""
    server = LiveServer(llama_dir, "--pp-size", "2", "--kv-cache-gb", "0.02", "--stage-timeout", "1")
    try:
        out: list[bytes] = []
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_tokens": 600, "ignore_eos": True}, "stream": True}
        thread = threading.Thread(target=lambda: out.append(server.request("POST", "/generate", body)[2]))
        thread.start()
        server.wait_until(lambda: server.metrics()["ppserve_requests_running"] == 1, what="the request to run")
        server.proc.send_signal(signal.SIGSTOP)
        threading.Event().wait(3.0)  # the length of the pause itself, three times the stage timeout
        server.proc.send_signal(signal.SIGCONT)
        thread.join(60)
        assert not thread.is_alive()
        events = [json.loads(line[6:]) for line in out[0].split(b"\n\n") if line.startswith(b"data: {")]
        assert events[-1]["finish_reason"] == "length" and sum(len(e["token_ids"]) for e in events) == 600
        assert server.request("GET", "/health")[0] == 200
        m = server.metrics()
        assert not any(v for k, v in m.items() if k.startswith("ppserve_stage_restarts_total"))
        assert "stalled" in "".join(server.output)  # the host noticed it was the one paused
    finally:
        assert server.stop() == 0, "".join(server.output)
