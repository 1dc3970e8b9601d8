"""Pipeline benchmarks, side by side in one run; writes benchmarks/results/pipeline.json.

(a) decode throughput with 64 concurrent requests: PP=2 (one thread per stage) over PP=1 (one
    thread), on a model whose layers dominate its compute;
(b) scheduler + transport overhead: micro-batches per second through PP=4 with near-zero
    compute, the per-hop latency seen in the stage timings, and a raw ZeroMQ round trip;
(c) tensor-channel round trips for 1 KB, 1 MB and 64 MB over shm, gloo and zmq.

    python -m benchmarks pipeline [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness.record import write_result
from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.config import EngineConfig
from ppserve.engine.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint
from ppserve.engine.runtime.timeline import Interval
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.transport.addresses import free_ports
from ppserve.transport.channels import open_channel
from ppserve.transport.messages import EdgeHeader
from ppserve.transport.tensor_channel import ChannelSpec

ROOT = Path(__file__).resolve().parent.parent

# Layers dominate: 16 layers of width 512 (50M parameters) against a 4K vocabulary.
COMPUTE_SPEC = TinySpec(
    arch="llama", hidden_size=512, num_layers=16, num_heads=8, num_kv_heads=4, intermediate_size=1536, vocab_size=4096
)
TINY_SPEC = TinySpec(arch="llama", hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1, intermediate_size=64)


async def decode_round(engine: AsyncEngine, requests: int, new_tokens: int) -> float:
    """One round of `requests` concurrent greedy requests; tokens per second once every request
    is decoding (prefill excluded)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    arrivals: list[float] = []
    first_tokens: list[float] = []

    async def one(i: int) -> None:
        prompt = [10 + (i * 7 + j) % 4000 for j in range(32)]
        async for out in engine.generate(prompt, params):
            now = time.perf_counter()
            if len(first_tokens) < requests and out.completion_tokens == len(out.token_ids):
                first_tokens.append(now)
            arrivals.extend([now] * len(out.token_ids))

    await asyncio.gather(*[one(i) for i in range(requests)])
    steady = max(first_tokens)
    return sum(1 for t in arrivals if t > steady) / (max(arrivals) - steady)


async def decode_throughput(model_dir: Path, requests: int, new_tokens: int, rounds: int) -> dict[str, object]:
    """PP=1 and PP=2 engines both up; rounds alternate between them so that drift in the
    machine's speed hits both alike; medians over rounds."""
    engines = {
        pp: AsyncEngine(
            EngineConfig.create(
                model_dir, pp_size=pp, threads_per_stage=1, num_kv_blocks=2048, max_running_requests=requests
            )
        )
        for pp in (1, 2)
    }
    rates: dict[int, list[float]] = {1: [], 2: []}
    try:
        for engine in engines.values():
            await engine.start()
            await decode_round(engine, 8, 8)  # warm-up
        for _ in range(rounds):
            for pp, engine in engines.items():
                rates[pp].append(await decode_round(engine, requests, new_tokens))
    finally:
        for engine in engines.values():
            await engine.close()
    pp1, pp2 = statistics.median(rates[1]), statistics.median(rates[2])
    return {
        "requests": requests,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "pp1_tokens_per_s": pp1,
        "pp2_tokens_per_s": pp2,
        "pp1_rounds": rates[1],
        "pp2_rounds": rates[2],
        "ratio_pp2_over_pp1": pp2 / pp1,
    }


async def overhead(model_dir: Path, seconds: float) -> dict[str, float]:
    """Micro-batches per second through PP=4 on a model with next to no compute."""
    config = EngineConfig.create(model_dir, pp_size=4, threads_per_stage=1, num_kv_blocks=512)
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(config) as engine:

        async def run(i: int) -> None:
            async for _ in engine.generate([5 + i, 6, 7], params):
                pass

        tasks = [asyncio.create_task(run(i)) for i in range(8)]
        await asyncio.sleep(1.0)  # warm-up
        start_wall, start = time.time(), time.perf_counter()
        await asyncio.sleep(seconds)
        elapsed = time.perf_counter() - start
        intervals = [i for i in engine.timeline.intervals if i.start >= start_wall]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    by_mb: dict[int, list[Interval]] = {}
    for i in intervals:
        by_mb.setdefault(i.mb_id, []).append(i)
    mbs = len({i.mb_id for i in intervals if i.stage == 0}) / elapsed
    # Hop latency: from stage i's compute end to stage i+1's compute start, same micro-batch.
    hops = [
        (b.start - a.end) * 1e6
        for stages in by_mb.values()
        for a, b in itertools.pairwise(sorted(stages, key=lambda i: i.stage))
        if b.start >= a.end
    ]
    compute = [(i.end - i.start) * 1e6 for i in intervals]
    return {
        "micro_batches_per_s": mbs,
        "hop_us_median": statistics.median(hops),
        "stage_compute_us_median": statistics.median(compute),
    }


def _zmq_echo(address: str) -> None:
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(address + "-a")
    push.connect(address + "-b")
    while (msg := pull.recv()) != b"stop":
        push.send(msg)
    ctx.destroy(linger=0)


def raw_zmq_round_trip_us(n: int = 2000) -> float:
    import multiprocessing as mp

    import zmq

    tmp = tempfile.TemporaryDirectory(prefix="ppserve-bench-")
    address = f"ipc://{tmp.name}/echo"
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(address + "-a")
    pull.bind(address + "-b")
    proc = mp.get_context("spawn").Process(target=_zmq_echo, args=(address,))
    proc.start()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        push.send(b"x" * 64)
        pull.recv()
        times.append(time.perf_counter() - start)
    push.send(b"stop")
    proc.join()
    ctx.destroy(linger=0)
    tmp.cleanup()
    return statistics.median(times[100:]) * 1e6


def _channel_peer(kind: str, specs: tuple[ChannelSpec, ChannelSpec], port: int, sizes: list[int], reps: int) -> None:
    """Rank 1: receive each tensor and send it straight back."""
    asyncio.run(_channel_side(1, kind, specs, port, sizes, reps, None))


async def _channel_side(
    rank: int,
    kind: str,
    specs: tuple[ChannelSpec, ChannelSpec],
    port: int,
    sizes: list[int],
    reps: int,
    out: dict[str, float] | None,
) -> None:
    import zmq.asyncio

    if kind == "gloo":
        from ppserve.transport.dist_channel import init_process_group

        init_process_group("gloo", rank, 2, "127.0.0.1", port)
    ctx = zmq.asyncio.Context()
    forward, back = specs  # rank 0 -> 1, rank 1 -> 0
    outgoing = open_channel(ctx, forward if rank == 0 else back, sender=True)
    incoming = open_channel(ctx, back if rank == 0 else forward, sender=False)
    header = EdgeHeader(0, [])
    for size in sizes:
        shape = (size // 4,)
        tensor, received = torch.ones(shape), torch.empty(shape)
        times = []
        for _ in range(reps + 1):
            start = time.perf_counter()
            if rank == 0:
                await outgoing.send(header, tensor)
                await incoming.recv(received)
            else:
                await incoming.recv(received)
                await outgoing.send(header, received)
            times.append(time.perf_counter() - start)
        if out is not None:
            out[str(size)] = statistics.median(times[1:]) * 1e6
    outgoing.close(linger_ms=5000)  # let the last reply leave before the socket goes
    incoming.close()
    ctx.term()
    if kind == "gloo":
        import torch.distributed as dist

        dist.destroy_process_group()


def channel_round_trips(kind: str, sizes: list[int], reps: int) -> dict[str, float]:
    import torch.multiprocessing as mp

    from ppserve.transport.shm_channel import allocate_ring

    tmp = tempfile.TemporaryDirectory(prefix="ppserve-bench-")
    rings = [allocate_ring(2, max(sizes)) if kind == "shm" else None for _ in range(2)]
    specs = (
        ChannelSpec(kind, 0, 1, f"ipc://{tmp.name}/fwd", rings[0]),
        ChannelSpec(kind, 1, 0, f"ipc://{tmp.name}/back", rings[1]),
    )
    port = free_ports(1)[0]
    proc = mp.get_context("spawn").Process(target=_channel_peer, args=(kind, specs, port, sizes, reps))
    proc.start()
    out: dict[str, float] = {}
    asyncio.run(_channel_side(0, kind, specs, port, sizes, reps, out))
    proc.join()
    tmp.cleanup()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer tokens and repetitions (a smoke run)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/pipeline.json"))
    args = p.parse_args(argv)
    new_tokens = 16 if args.quick else 64
    reps = 5 if args.quick else 20
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        compute_dir = make_tiny_checkpoint(Path(tmp) / "compute", COMPUTE_SPEC)
        tiny_dir = make_tiny_checkpoint(Path(tmp) / "tiny", TINY_SPEC)
        decode = asyncio.run(decode_throughput(compute_dir, 64, new_tokens, 2 if args.quick else 5))
        over = asyncio.run(overhead(tiny_dir, 2.0 if args.quick else 5.0))
    over["raw_zmq_round_trip_us"] = raw_zmq_round_trip_us()
    sizes = [1024, 1024**2, 64 * 1024**2]
    channels = {kind: channel_round_trips(kind, sizes, reps) for kind in ("shm", "gloo", "zmq")}

    report = {
        "benchmark": "pipeline",
        "decode_64_concurrent": {"model_params_m": 50.3, **decode},
        "overhead_pp4_near_zero_compute": over,
        "channel_round_trip_us": channels,
    }
    write_result(args.out, report, args)
    print(
        f"(a) decode, 64 concurrent: PP=1 {decode['pp1_tokens_per_s']:.0f} tok/s, "
        f"PP=2 {decode['pp2_tokens_per_s']:.0f} tok/s, ratio {decode['ratio_pp2_over_pp1']:.2f}"
    )
    print(
        f"(b) PP=4 overhead: {over['micro_batches_per_s']:.0f} micro-batches/s, hop {over['hop_us_median']:.0f} us, "
        f"raw ZeroMQ round trip {over['raw_zmq_round_trip_us']:.0f} us"
    )
    for kind, rt in channels.items():
        print(f"(c) {kind:4s} round trip: " + ", ".join(f"{int(k) // 1024} KB {v:.0f} us" for k, v in rt.items()))
    print(f"wrote {args.out}")
