"""Multi-node benchmark, side by side in one run; writes benchmarks/results/multinode.json.

PP=4 in one network namespace (one host, shm) against PP=4 over four namespaces, one stage
each, with the cluster key, `--tensor-transport auto` (gloo between nodes; also zmq, whose
activations travel with their header, CURVE-encrypted):
  - "bridge": the kernel's veth pairs and bridge;
  - "link +D ms": every packet between nodes held D ms each way by a switch in user space
    (tests/tun_switch.py: kernel netem is missing here), for D = 0, 1 and 5.
Then whether Ray costs anything on the data path, in alternating rounds on four namespaces:
`--nnodes` alone, `--nnodes` beside an idle Ray cluster (one Ray node per namespace,
tests/ray_cluster.py: its daemons on the same cores), and the stages as Ray actors
(`--executor ray --placement-strategy STRICT_SPREAD`, same transport); medians over the rounds,
and the CPU the idle Ray daemons take.
For each: decode tokens/s of one stream and of 16 concurrent streams (both greedy, prefill
excluded), and the median per-hop latency of the single stream's decode micro-batches, from
the stages' own timings (the machine has one clock): from the end of stage i's compute to the
start of stage i+1's.

    sudo .venv/bin/python -m benchmarks multinode [--quick]

Needs root (network namespaces). All stages share this machine's cores, so the figures show
what the network adds, not what four machines would do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.record import write_result
from benchmarks.harness.testbed import Cluster, RayCluster, TunSwitch, Unavailable, ray_env
from ppserve.engine.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent

# Small enough that a decode step is a few ms, so what the network adds shows.
SPEC = TinySpec(arch="llama", hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=768)
HTTP = 8000
PORT = 29500

# Runs inside node 0's namespace: measures against the server there, prints one JSON object.
CLIENT = r"""
import asyncio, json, statistics, sys, time
import aiohttp

URL, STREAMS, TOKENS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

async def stream(session, i, tokens, stamps):
    body = {"model": "m", "prompt": f"request {i} " + "word " * 24, "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    async with session.post(URL + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                assert "error" not in line, line
                stamps.append(time.perf_counter())

async def decode_rate(session, streams, tokens):
    stamps = [[] for _ in range(streams)]
    await asyncio.gather(*(stream(session, i, tokens, stamps[i]) for i in range(streams)))
    start = max(s[0] for s in stamps)  # every stream decoding from here on
    after = sum(1 for s in stamps for t in s if t > start)
    return after / (max(s[-1] for s in stamps) - start)

async def main():
    async with aiohttp.ClientSession() as session:
        await decode_rate(session, 2, 8)  # warm-up
        t0 = time.time()
        single = await decode_rate(session, 1, TOKENS)
        # Hops of the single stream: one micro-batch in flight, so no queueing in the figures.
        async with session.get(URL + f"/debug/pipeline?since={t0}") as resp:
            intervals = (await resp.json())["intervals"]
        batch = await decode_rate(session, STREAMS, TOKENS)
    print(json.dumps({"single": single, "batch": batch, "intervals": intervals}))

asyncio.run(main())
"""


def hops(intervals: list[dict[str, Any]], pp: int) -> list[float]:
    """Median ms per hop of decode micro-batches: stage i end -> stage i+1 start, i < pp - 1."""
    by_mb: dict[int, dict[int, dict[str, Any]]] = {}
    for i in intervals:
        if i["kind"] == "decode":
            by_mb.setdefault(i["mb_id"], {})[i["stage"]] = i
    gaps: list[list[float]] = [[] for _ in range(pp - 1)]
    for stages in by_mb.values():
        if len(stages) == pp:
            for s in range(pp - 1):
                gaps[s].append(stages[s + 1]["start"] - stages[s]["end"])
    return [round(statistics.median(g) * 1e3, 3) if g else float("nan") for g in gaps]


def run(
    cluster: Cluster,
    model: Path,
    key: Path,
    nodes: int,
    streams: int,
    tokens: int,
    transport: str,
    ray: RayCluster | None = None,
) -> dict[str, Any]:
    """Serve PP=4 over `nodes` namespaces (1: a single host; with `ray`, its nodes), measure from
    node 0, stop."""
    base = [sys.executable, "-m", "ppserve.server.cli", "serve", "--model", str(model), "--pp-size", "4"]
    base += ["--tensor-transport", transport]
    base += ["--served-model-name", "m", "--no-playground", "--log-level", "warning", "--kv-cache-gb", "0.25"]
    host = "127.0.0.1" if nodes == 1 else cluster.addr(0)
    procs = []
    for rank in range(1 if ray else nodes):
        argv = [*base, "--host", host, "--port", str(HTTP)]
        if ray:
            argv += ["--executor", "ray", "--ray-address", ray.address, "--placement-strategy", "STRICT_SPREAD"]
            argv += ["--cluster-key-file", str(key)]
        elif nodes > 1:
            argv += ["--nnodes", str(nodes), "--node-rank", str(rank), "--dist-init-addr", f"{cluster.addr(0)}:{PORT}"]
            argv += ["--cluster-key-file", str(key)]
        out = subprocess.PIPE
        env = ray_env() if ray else None
        procs.append(cluster.popen(rank, argv, stdout=out, stderr=subprocess.STDOUT, text=True, env=env))
    try:
        _wait_serving(procs[0])
        url = f"http://{host}:{HTTP}"
        client = subprocess.run(
            ["ip", "netns", "exec", cluster.nodes[0], sys.executable, "-c", CLIENT, url, str(streams), str(tokens)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if client.returncode != 0:
            node0 = procs[0].stdout.read() if procs[0].poll() is not None and procs[0].stdout else ""
            raise RuntimeError(f"the client failed:\n{client.stderr[-3000:]}\n{node0[-3000:]}")
        result = json.loads(client.stdout)
        return {
            "single_stream_tok_s": round(result["single"], 1),
            "batch_tok_s": round(result["batch"], 1),
            "hop_ms": hops(result["intervals"], 4),
        }
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def ray_rounds(model: Path, key: Path, streams: int, tokens: int, rounds: int) -> dict[str, Any]:
    """--nnodes, --nnodes beside an idle Ray cluster, and --executor ray, each once a round, the
    order reversed every other round; per setup the median of each figure over the rounds."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in RAY_SETUPS}
    idle_cores: list[float] = []
    for r in range(rounds):
        cluster = Cluster.create(4)
        ray: RayCluster | None = None
        try:
            for name in RAY_SETUPS if r % 2 == 0 else RAY_SETUPS[::-1]:
                if name != "nnodes" and ray is None:
                    ray = RayCluster.start(cluster, nodes=range(4))
                    idle_cores.append(_cores_used(ray, 5.0))
                if name == "nnodes" and ray is not None:
                    ray.stop()
                    ray = None
                runs[name].append(run(cluster, model, key, 4, streams, tokens, "auto", ray if name == "ray" else None))
                print(f"ray round {r}: {name:>24}: {runs[name][-1]}", flush=True)
        finally:
            if ray is not None:
                ray.stop()
            cluster.close()
    medians = {
        name: {
            "single_stream_tok_s": round(statistics.median(x["single_stream_tok_s"] for x in xs), 1),
            "batch_tok_s": round(statistics.median(x["batch_tok_s"] for x in xs), 1),
            "hop_ms": [round(statistics.median(h), 3) for h in zip(*(x["hop_ms"] for x in xs), strict=True)],
        }
        for name, xs in runs.items()
    }
    return {
        "rounds": rounds,
        "runs": runs,
        "medians": medians,
        "idle_ray_cores": round(statistics.median(idle_cores), 3),  # of the machine's cores, Ray's daemons idle
    }


RAY_SETUPS = ("nnodes", "nnodes beside idle Ray", "ray")


def _cores_used(ray: RayCluster, seconds: float) -> float:
    """CPU the Ray cluster's processes use over `seconds` (in cores: 1.0 = one core busy)."""

    def ticks() -> int:
        total = 0
        for pid in [p for node in range(4) for p in ray.pids(node)]:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total

    before = ticks()
    time.sleep(seconds)
    return (ticks() - before) / os.sysconf("SC_CLK_TCK") / seconds


def _wait_serving(proc: subprocess.Popen[str], timeout_s: float = 180.0) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        if "ppserve: serving" in line:
            return
        if time.monotonic() > deadline:
            break
    raise RuntimeError(f"node 0 did not start (exit code {proc.poll()})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer tokens")
    parser.add_argument("--ray-rounds", type=int, default=3, help="rounds of the Ray comparison (0: none)")
    args = parser.parse_args(argv)
    streams, tokens = 16, (32 if args.quick else 96)
    work = Path(tempfile.mkdtemp(prefix="ppserve-bench-"))
    model = make_tiny_checkpoint(work / "model", SPEC)
    key = work / "cluster.key"
    key.write_text(os.urandom(24).hex())
    results: dict[str, Any] = {}
    try:
        # (name, nodes, one-way delay in ms through the user-space switch (None: the kernel's
        # bridge), tensor transport)
        setups: list[tuple[str, int, float | None, str]] = [
            ("one namespace", 1, None, "auto"),
            ("bridge", 4, None, "auto"),
        ]
        setups += [(f"link +{d} ms", 4, float(d), "auto") for d in (0, 1, 5)]
        setups += [("bridge, zmq", 4, None, "zmq"), ("link +5 ms, zmq", 4, 5.0, "zmq")]
        if only := os.environ.get("BENCH_ONLY"):  # setups by name, separated by ";" (and the baseline)
            setups = [s for s in setups if s[0] in (*only.split(";"), "one namespace")]
        for name, nodes, delay_ms, transport in setups:
            cluster = Cluster.create(4, wired=delay_ms is None)
            addrs = [cluster.addr(i) for i in range(4)]
            switch = None if delay_ms is None else TunSwitch(cluster.nodes, addrs, delay_ms / 1e3)
            try:
                results[name] = run(cluster, model, key, nodes, streams, tokens, transport)
            finally:
                if switch is not None:
                    switch.close()
                cluster.close()
            print(f"{name:>14}: {results[name]}", flush=True)
    except Unavailable as e:
        sys.exit(f"bench_multinode: {e}")
    ray = ray_rounds(model, key, streams, tokens, args.ray_rounds) if args.ray_rounds else None
    one = results["one namespace"]
    for r in results.values():
        r["single_ratio"] = round(r["single_stream_tok_s"] / one["single_stream_tok_s"], 3)
        r["batch_ratio"] = round(r["batch_tok_s"] / one["batch_tok_s"], 3)
    out = {
        "benchmark": "multinode",
        "model": {"hidden_size": SPEC.hidden_size, "layers": SPEC.num_layers, "pp_size": 4},
        "streams": streams,
        "tokens_per_stream": tokens,
        "results": results,
        **({"ray": ray} if ray else {}),
    }
    path = ROOT / "benchmarks" / "results" / "multinode.json"
    write_result(path, out, args)
    print(json.dumps(results, indent=2))
    print(f"wrote {path}")
