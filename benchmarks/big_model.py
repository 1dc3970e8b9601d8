"""A model bigger than one node: the 8B Q4_K_M test model on four 2.5 GiB nodes; writes
benchmarks/results/big_model.json.

The model is benchmarks/make_big_gguf.py's (written first if it is not there). Four network
namespaces on this machine stand for four nodes (tests/netns.py: 198.18.0.0/15 addresses, veth
pairs on a bridge); each node's `ppserve serve --nnodes 4 --pp-size 4` runs in a memory cgroup of
its own capped at 2.5 GiB (cgroup v1's memory.limit_in_bytes, or v2's memory.max), so each holds
one stage: a quarter of the layers, memory-mapped from the file, and its KV cache. Measured:
- per node: when its stage process appeared and when it last used CPU before the cluster served
  (sampled every 0.1 s from the nodes' start: joining, loading, warming its channels), its CPU
  seconds until then; the resident memory of its processes (stage, and node process) and its
  cgroup's usage and peak, after loading and after the runs, beside the engine's own estimate
  (engine/runtime/memory_check.py); each stage reads its layers' tensors from the mapped file and
  repacks them while loading, and the first request's time is recorded apart (`first_request_s`);
- decode tokens/s of 1 and of 8 concurrent greedy streams (prefill excluded), and the same at
  PP=1 on one namespace without a cap, side by side (`*_ratio`: PP=4 over PP=1);
- the greedy tokens of a short prompt at PP=4 against PP=1 uncapped (`greedy_equal`);
- the same model at PP=1 under one 2.5 GiB cap: refused in one line before it loads, an exit
  (status 1), not an OOM kill.

    sudo .venv/bin/python -m benchmarks big-model [--tokens 16] [--streams 8]

Needs root (namespaces, cgroups) and nsenter. The nodes share this machine's cores, so the rates
show that it works and what the pipeline costs, not what four machines would do. Before each
capped run the model file's pages are dropped from the page cache, so that each node's reads are
charged to its own cgroup.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.record import write_result
from benchmarks.harness.testbed import Cluster, Node, Unavailable
from benchmarks.make_big_gguf import default_path, write

ROOT = Path(__file__).resolve().parent.parent

CAP = int(2.5 * 2**30)
NODES = 4
HTTP, PORT = 8000, 29500
PROMPT = "the pipeline stage of the model"
STAGE = "ppserve-stage-"
MAX_RUNNING = 16

# Runs inside node 0's namespace: greedy tokens of PROMPT, then decode rates; prints one JSON object.
CLIENT = r"""
import asyncio, json, sys, time
import aiohttp

URL, PROMPT, STREAMS, TOKENS, MEASURE = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]

async def stream(session, i, tokens, stamps):
    body = {"model": "m", "prompt": f"{PROMPT} {i}", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
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
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 8, "ignore_eos": True}}
        start = time.perf_counter()  # the first request: the weights' pages are read as it runs
        async with session.post(URL + "/generate", json=body) as resp:
            assert resp.status == 200, await resp.text()
            greedy = (await resp.json())["token_ids"]
        out = {"greedy": greedy, "first_request_s": round(time.perf_counter() - start, 2)}
        if MEASURE == "1":
            out["single"] = await decode_rate(session, 1, TOKENS)
            out["batch"] = await decode_rate(session, STREAMS, TOKENS)
    print(json.dumps(out))

asyncio.run(main())
"""


class MemoryCgroups:
    """Memory cgroups of this run, one per name, each capped at `limit` bytes (no swap beyond it);
    `close()` moves any process left in them out and removes them."""

    def __init__(self, names: list[str], limit: int) -> None:
        v1 = Path("/sys/fs/cgroup/memory")
        v2 = Path("/sys/fs/cgroup")
        if (v1 / "memory.limit_in_bytes").is_file():
            self.v2, base = False, v1
        elif "memory" in _read(v2 / "cgroup.controllers").split():
            self.v2, base = True, v2
            if "memory" not in _read(v2 / "cgroup.subtree_control").split():
                (v2 / "cgroup.subtree_control").write_text("+memory")
        else:
            raise Unavailable("no memory cgroup controller (v1 or v2) here")
        self.paths: dict[str, Path] = {}
        try:
            for name in names:
                path = base / f"ppserve-bench-{os.getpid()}-{name}"
                path.mkdir()
                self.paths[name] = path
                if self.v2:
                    (path / "memory.max").write_text(str(limit))
                    with contextlib.suppress(OSError):
                        (path / "memory.swap.max").write_text("0")
                else:
                    (path / "memory.limit_in_bytes").write_text(str(limit))
                    with contextlib.suppress(OSError):  # only where swap is accounted
                        (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
        except OSError as e:
            self.close()
            raise Unavailable(f"cannot create memory cgroups under {base}: {e}") from e

    def argv(self, name: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside cgroup `name`: a shell joins it, then becomes the command."""
        return ["sh", "-c", f'echo $$ > {self.paths[name] / "cgroup.procs"} && exec "$@"', "sh", *argv]

    def usage(self, name: str) -> dict[str, Any]:
        path = self.paths[name]
        if self.v2:
            usage, peak = _read(path / "memory.current"), _read(path / "memory.peak")
            events = _read(path / "memory.events")
        else:
            usage, peak = _read(path / "memory.usage_in_bytes"), _read(path / "memory.max_usage_in_bytes")
            events = _read(path / "memory.oom_control")
        kills = [int(line.split()[1]) for line in events.splitlines() if line.startswith("oom_kill ")]
        return {"usage_gib": _gib(usage), "peak_gib": _gib(peak), "oom_kills": kills[0] if kills else None}

    def close(self) -> None:
        for path in self.paths.values():
            for _ in range(100):
                with contextlib.suppress(OSError):
                    for pid in _read(path / "cgroup.procs").split():
                        (path.parent / "cgroup.procs").write_text(pid)
                try:
                    path.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
        self.paths = {}


class CappedCluster(Cluster):
    """Namespaces whose nodes each start in a cgroup of their own, entered with nsenter (the network
    namespace only): `ip netns exec` mounts a sysfs of its own, without the cgroup tree, where
    neither the cgroup could be joined nor the engine read its limit."""

    groups: MemoryCgroups | None = None

    def popen(self, node: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        if self.groups is None:
            return super().popen(node, argv, **kwargs)
        inside = ["nsenter", f"--net=/var/run/netns/{self.nodes[node]}", "--", *argv]
        proc = subprocess.Popen(self.groups.argv(f"n{node}", inside), **kwargs)
        self.procs.append(proc)
        return proc


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _gib(text: str | int) -> float | None:
    try:
        return round(int(text) / 2**30, 3)
    except ValueError:
        return None


def drop_cached(path: Path) -> None:
    """Drop the file's clean pages from the page cache: pages stay charged to the cgroup that read
    them first, so a capped node must read its own."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _proc(pid: int | str) -> tuple[str, int, float, int]:
    """(name, parent pid, CPU seconds, resident bytes) of a process."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return name, int(fields[1]), cpu, rss


def ns_pids(cluster: Cluster, node: int) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", cluster.nodes[node]], capture_output=True, text=True).stdout.split()


def resident(cluster: Cluster, node: int) -> dict[str, float]:
    """Resident GiB of the node's processes: its stage process(es), and the rest (node process, shell)."""
    stage, other = 0, 0
    for pid in ns_pids(cluster, node):
        with contextlib.suppress(OSError, ValueError, IndexError):
            name, _, _, rss = _proc(pid)
            if name.startswith(STAGE):
                stage += rss
            else:
                other += rss
    return {"stage_rss_gib": round(stage / 2**30, 3), "node_rss_gib": round(other / 2**30, 3)}


class LoadWatch:
    """For each node, the last moment its stage process used CPU (sampled every 0.1 s), until
    `stop()`: while the cluster starts, a stage only joins, loads and warms up its channels."""

    def __init__(self, cluster: Cluster, nodes: int) -> None:
        self.cluster, self.start = cluster, time.monotonic()
        self.started: dict[int, float] = {}  # when the node's stage process was first seen
        self.last_busy: dict[int, float] = {}
        self._cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(nodes,), daemon=True)
        self._thread.start()

    def _run(self, nodes: int) -> None:
        while not self._stop.wait(0.1):
            now = time.monotonic() - self.start
            for node in range(nodes):
                pids = ns_pids(self.cluster, node)
                cpu, seen = 0.0, False
                for pid in pids:
                    with contextlib.suppress(OSError, ValueError, IndexError):
                        name, _, used, _ = _proc(pid)
                        if name.startswith(STAGE):
                            cpu, seen = cpu + used, True
                if seen:
                    self.started.setdefault(node, round(now, 2))
                if cpu > self._cpu.get(node, 0.0) + 0.01:
                    self.last_busy[node] = round(now, 2)
                self._cpu[node] = max(cpu, self._cpu.get(node, 0.0))

    def stop(self) -> dict[int, dict[str, float | None]]:
        """Per node: stage_started_s, loaded_s (its last busy moment), stage_cpu_s (until now)."""
        self._stop.set()
        self._thread.join(timeout=5)
        return {
            node: {
                "stage_started_s": self.started.get(node),
                "loaded_s": self.last_busy.get(node),
                "stage_cpu_s": round(self._cpu[node], 2) if node in self._cpu else None,
            }
            for node in range(len(self.cluster.nodes))
        }


def serve_argv(model: Path, pp: int, args: argparse.Namespace) -> list[str]:
    argv = [sys.executable, "-m", "ppserve.server.cli", "serve", "--model", str(model), "--pp-size", str(pp)]
    argv += ["--served-model-name", "m", "--no-playground", "--log-level", "warning"]
    return [*argv, "--port", str(HTTP), *engine_flags(args)]


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--kv-cache-gb", str(args.kv_cache_gb), "--max-batched-tokens", str(args.max_batched_tokens)]
    flags += ["--max-running-requests", str(MAX_RUNNING)]
    return flags + (["--dtype", args.dtype] if args.dtype else [])


def estimate(model: Path, args: argparse.Namespace, stage: int) -> dict[str, float]:
    """What the engine's memory check estimates for the stage (engine/runtime/memory_check.py), GiB."""
    from ppserve.engine.config import EngineConfig
    from ppserve.engine.runtime.memory_check import stage_needs

    settings: dict[str, Any] = {"max_batched_tokens": args.max_batched_tokens, "max_running_requests": MAX_RUNNING}
    if args.dtype:
        settings["dtype"] = args.dtype
    config = EngineConfig.create(model, pp_size=NODES, kv_cache_gb=args.kv_cache_gb, **settings)
    needs = stage_needs(config, stage)
    return {k: round(v / 2**30, 3) for k, v in {**vars(needs), "total": needs.total}.items()}


def wait_serving(node: Node, timeout_s: float) -> float:
    start = time.monotonic()
    node.wait_for("ppserve: serving", timeout_s)
    return round(time.monotonic() - start, 2)


def client(cluster: Cluster, streams: int, tokens: int, measure: bool) -> dict[str, Any]:
    url = f"http://{cluster.addr(0)}:{HTTP}"
    argv = [sys.executable, "-c", CLIENT, url, PROMPT, str(streams), str(tokens), "1" if measure else "0"]
    res = subprocess.run(
        ["ip", "netns", "exec", cluster.nodes[0], *argv], capture_output=True, text=True, timeout=3600, check=False
    )
    if res.returncode != 0:
        raise RuntimeError(f"the client failed:\n{res.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(res.stdout)
    return out


def stop(nodes: list[Node]) -> None:
    for n in nodes:
        if n.proc.poll() is None:
            n.proc.terminate()
    for n in nodes:
        try:
            n.wait(timeout_s=60)
        except subprocess.TimeoutExpired:
            n.proc.kill()


def pp1_uncapped(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """PP=1 in one namespace, no cap: the reference tokens (and its rates, side by side)."""
    cluster = Cluster.create(1)
    try:
        node = Node(cluster, 0, [*serve_argv(model, 1, args), "--host", cluster.addr(0)])
        try:
            ready = wait_serving(node, args.start_timeout)
            out = client(cluster, args.streams, args.tokens, measure=not args.quick)
        finally:
            stop([node])
    finally:
        cluster.close()
    return {"ready_s": ready, **out}


def pp4_capped(model: Path, args: argparse.Namespace, key: Path) -> dict[str, Any]:
    cluster = CappedCluster.create(NODES)
    assert isinstance(cluster, CappedCluster)
    groups: MemoryCgroups | None = None
    nodes: list[Node] = []
    try:
        groups = cluster.groups = MemoryCgroups([f"n{i}" for i in range(NODES)], CAP)
        drop_cached(model)
        watch = LoadWatch(cluster, NODES)
        for rank in range(NODES):
            argv = [*serve_argv(model, NODES, args), "--host", cluster.addr(rank)]
            argv += ["--nnodes", str(NODES), "--node-rank", str(rank), "--dist-init-addr", f"{cluster.addr(0)}:{PORT}"]
            argv += ["--node-addr", cluster.addr(rank), "--cluster-key-file", str(key)]
            nodes.append(Node(cluster, rank, argv))
        try:
            ready = wait_serving(nodes[0], args.start_timeout)
        finally:
            loaded = watch.stop()
        after_load = [{**resident(cluster, i), **groups.usage(f"n{i}")} for i in range(NODES)]
        out = client(cluster, args.streams, args.tokens, measure=True)
        after_runs = [{**resident(cluster, i), **groups.usage(f"n{i}")} for i in range(NODES)]
        return {
            "ready_s": ready,
            "nodes": [
                {
                    "node": i,
                    **loaded[i],
                    "estimate": estimate(model, args, i),
                    "after_load": after_load[i],
                    "after_runs": after_runs[i],
                }
                for i in range(NODES)
            ],
            **out,
        }
    except Exception:
        for n in nodes:
            print(f"--- node {n.rank} ---\n{n.output[-3000:]}", file=sys.stderr)
        raise
    finally:
        stop(nodes)
        cluster.close()
        if groups is not None:
            groups.close()


def pp1_capped_refusal(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """PP=1 under one cap: the engine must refuse it in one line, and exit (not be killed)."""
    groups = MemoryCgroups(["refusal"], CAP)
    try:
        drop_cached(model)
        argv = [sys.executable, "-m", "ppserve.server.cli", "generate", "--model", str(model), "--prompt", PROMPT]
        argv += ["--max-tokens", "2", *engine_flags(args)]
        start = time.monotonic()
        res = subprocess.run(groups.argv("refusal", argv), capture_output=True, text=True, timeout=600, check=False)
        usage = groups.usage("refusal")
    finally:
        groups.close()
    errors = [line for line in res.stderr.splitlines() if line.startswith("ppserve generate: error:")]
    return {
        "exit_code": res.returncode,
        "seconds": round(time.monotonic() - start, 2),
        "error": errors[0] if len(errors) == 1 else res.stderr[-2000:],
        "one_line": len(errors) == 1,
        "refused": res.returncode == 1 and len(errors) == 1 and "needs" in errors[0] and "but has" in errors[0],
        **usage,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="the GGUF (default: make_big_gguf.py's)")
    parser.add_argument("--tokens", type=int, default=16, help="decoded tokens per stream")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams of the batch rate")
    parser.add_argument("--kv-cache-gb", type=float, default=0.1, help="KV cache per stage, GiB")
    parser.add_argument("--max-batched-tokens", type=int, default=512, help="new tokens per micro-batch")
    parser.add_argument("--dtype", default=None, help="the engine dtype (default: the engine's)")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a cluster to serve")
    parser.add_argument("--skip-pp1", action="store_true", help="no PP=1 reference (no token comparison)")
    parser.add_argument("--quick", action="store_true", help="PP=1: the reference tokens only, no rates")
    parser.add_argument("--only", choices=["refusal", "pp4"], default=None, help="one part only")
    args = parser.parse_args(argv)
    model = args.model or default_path()
    if not model.is_file():
        print(f"writing {model} (benchmarks/make_big_gguf.py)", flush=True)
        write(model)
    from ppserve.engine.config import EngineConfig

    EngineConfig.create(model, kv_cache_gb=args.kv_cache_gb)  # prepared once here, not by four nodes at once
    work = Path(tempfile.mkdtemp(prefix="ppserve-bench-big-"))
    key = work / "cluster.key"
    key.write_text(os.urandom(24).hex())
    results: dict[str, Any] = {}
    try:
        if args.only in (None, "refusal"):
            results["pp1_capped"] = pp1_capped_refusal(model, args)
            print(f"PP=1 under {CAP / 2**30} GiB: {results['pp1_capped']}", flush=True)
        if args.only in (None, "pp4") and not args.skip_pp1:
            results["pp1_uncapped"] = pp1_uncapped(model, args)
            print(f"PP=1 uncapped: {results['pp1_uncapped']}", flush=True)
        if args.only in (None, "pp4"):
            results["pp4_capped"] = pp4_capped(model, args, key)
            print(f"PP=4, {NODES} nodes of {CAP / 2**30} GiB: {json.dumps(results['pp4_capped'])}", flush=True)
    except Unavailable as e:
        sys.exit(f"bench_big_model: {e}")
    finally:
        key.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            work.rmdir()
    if "pp1_uncapped" in results and "pp4_capped" in results:
        pp1, pp4 = results["pp1_uncapped"], results["pp4_capped"]
        results["greedy_equal"] = pp1["greedy"] == pp4["greedy"]
        if "single" in pp1:
            results["single_ratio"] = round(pp4["single"] / pp1["single"], 3)
            results["batch_ratio"] = round(pp4["batch"] / pp1["batch"], 3)
    out = {
        "benchmark": "big_model",
        "model": {"file": model.name, "gb": round(model.stat().st_size / 1e9, 2), "layers": 32, "quant": "Q4_K_M"},
        "cap_gib": CAP / 2**30,
        "nodes": NODES,
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "results": results,
    }
    path = ROOT / "benchmarks" / "results" / "big_model.json"
    if args.only is None:
        write_result(path, out, args)
        print(f"wrote {path}")
    print(json.dumps(results, indent=2))
