"""Plan-size benchmark: what one decode step's StepPlan costs the host and every stage, with
block-table diffs (the stages keep each request's table) against whole tables in every plan.

Pure: the real Scheduler builds the plans, msgspec encodes and decodes them, and the stage side
builds the attention metadata; no model, no processes. Steady decoding of `--requests` requests
at each context length; per step, side by side in one run:

- old: every chunk carries its request's whole block table (the plan as it was before diffs),
  and the metadata is built by the per-token Python loop it was built with (kept below).
- vectorized: the same whole-table plan, metadata built by the tensor ops now in use.
- new: the plan as the scheduler sends it (new blocks only), applied to the stage's
  BlockTables, metadata built from the kept tables.

Reported per context: plan bytes (mean, max over steps) and the stage's decode + metadata time
(median), and the ratios. The target is plan size independent of context length.

    .venv/bin/python scripts/bench_plan.py                  # 256 requests x 1K, 4K, 16K
    .venv/bin/python scripts/bench_plan.py --contexts 4096 --steps 16

Writes benchmarks/results/plan_diff.json (`--out`), with the commit, the settings and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ppserve.engine.model.attention import AttentionMetadata, padded_tables
from ppserve.engine.runtime.block_tables import BlockTables
from ppserve.scheduler.request import Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.scheduler.scheduler import Scheduler, SchedulerConfig
from ppserve.transport.messages import Sampled, SeqChunk, StepPlan, StepResult, decode, encode

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16
CPU = torch.device("cpu")


def old_build(chunks: Sequence[SeqChunk], block_size: int) -> tuple[torch.Tensor, ...]:
    """The metadata build before diffs, as it was for a decode batch: positions, slots and padded
    decode tables by a Python loop over every token and every block, then the decode mask."""
    slots: list[int] = []
    positions: list[int] = []
    decode_tables: list[list[int]] = []
    decode_pos: list[int] = []
    for c in chunks:
        end = c.start + c.num_new
        needed = -(-end // block_size)
        positions.extend(range(c.start, end))
        for pos in range(c.start, end):
            slots.append(c.blocks[pos // block_size] * block_size + pos % block_size)
        if c.num_new == 1:
            decode_tables.append(c.blocks[:needed])
            decode_pos.append(c.start)
    width = max(len(t) for t in decode_tables)
    padded = [list(t) + [0] * (width - len(t)) for t in decode_tables]
    q_pos = torch.tensor(decode_pos)
    mask = torch.arange(width * block_size) <= q_pos[:, None]  # [num_decodes, width * block_size]
    return torch.tensor(positions), torch.tensor(slots), torch.tensor(padded), mask


def stage_old(wire: bytes) -> None:
    plan = decode(wire)
    assert isinstance(plan, StepPlan)
    old_build(plan.chunks, BLOCK)


def stage_vectorized(wire: bytes) -> None:
    plan = decode(wire)
    assert isinstance(plan, StepPlan)
    tables, lengths = padded_tables([c.blocks for c in plan.chunks])
    starts, num_new = [c.start for c in plan.chunks], [c.num_new for c in plan.chunks]
    AttentionMetadata.from_tables(starts, num_new, tables, lengths, BLOCK, CPU)


def stage_new(wire: bytes, kept: BlockTables) -> None:
    plan = decode(wire)
    assert isinstance(plan, StepPlan)
    kept.apply(plan)
    tables, lengths = kept.lookup([c.request_id for c in plan.chunks])
    starts, num_new = [c.start for c in plan.chunks], [c.num_new for c in plan.chunks]
    AttentionMetadata.from_tables(starts, num_new, tables, lengths, BLOCK, CPU)


def whole_tables(plan: StepPlan, s: Scheduler) -> StepPlan:
    """The plan as it was before diffs: every chunk with its request's whole table."""
    chunks = [
        SeqChunk(c.request_id, c.token_ids, c.start, list(s.requests[c.request_id].block_table), c.sample)
        for c in plan.chunks
    ]
    return StepPlan(plan.mb_id, chunks, plan.new_requests, plan.released, plan.prompt_targets)


def timed(fn: Callable[..., None], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def complete(s: Scheduler, plan: StepPlan) -> None:
    s.update(StepResult(plan.mb_id, [Sampled(c.request_id, 7) for c in plan.chunks if c.sample], []))


def measure(requests: int, context: int, steps: int) -> dict[str, object]:
    blocks = requests * (context + steps + BLOCK) // BLOCK + requests
    s = Scheduler(
        SchedulerConfig(
            num_blocks=blocks,
            block_size=BLOCK,
            pp_size=1,
            async_depth=0,
            max_running_requests=requests,
            max_batched_tokens=requests * context,
            chunked_prefill_size=context,
        )
    )
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(requests):
        s.add(Request(f"req-{i}", [(i + j) % 256 for j in range(context)], params))
    stage = BlockTables()
    # Prefill (one plan, all prompts): the stage learns every table here, once.
    while (plan := s.schedule()) is not None and any(c.num_new > 1 for c in plan.chunks):
        received = decode(encode(plan))
        assert isinstance(received, StepPlan)
        stage.apply(received)
        complete(s, plan)
    assert plan is not None
    rows: dict[str, list[float]] = {k: [] for k in ("old_bytes", "new_bytes", "old_s", "vec_s", "new_s", "host_s")}
    for _ in range(steps):
        assert len(plan.chunks) == requests and all(c.num_new == 1 for c in plan.chunks)
        old_wire = encode(whole_tables(plan, s))
        new_wire = encode(plan)
        rows["old_bytes"].append(len(old_wire))
        rows["new_bytes"].append(len(new_wire))

        rows["old_s"].append(timed(stage_old, old_wire))
        rows["vec_s"].append(timed(stage_vectorized, old_wire))
        rows["new_s"].append(timed(stage_new, new_wire, stage))  # applies the plan: once per step, in order
        complete(s, plan)
        start = time.perf_counter()
        next_plan = s.schedule()
        rows["host_s"].append(time.perf_counter() - start)
        if next_plan is None:
            break
        plan = next_plan
    ms = {k: round(statistics.median(v) * 1e3, 3) for k, v in rows.items() if k.endswith("_s")}
    old_bytes, new_bytes = statistics.mean(rows["old_bytes"]), statistics.mean(rows["new_bytes"])
    return {
        "context": context,
        "requests": requests,
        "steps": len(rows["new_bytes"]),
        "plan_bytes": {
            "old_mean": round(old_bytes),
            "new_mean": round(new_bytes),
            "new_max": max(rows["new_bytes"]),  # a step where requests cross into a new block
        },
        "stage_decode_and_metadata_ms": {
            "old": ms["old_s"],
            "vectorized_whole_tables": ms["vec_s"],
            "new": ms["new_s"],
        },
        "host_schedule_ms": ms["host_s"],
        "ratios": {
            "plan_bytes_old_over_new": round(
                statistics.mean(rows["old_bytes"]) / statistics.mean(rows["new_bytes"]), 1
            ),
            "stage_ms_old_over_new": round(ms["old_s"] / ms["new_s"], 1),
        },
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=32, help="decode steps measured per context")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "plan_diff.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a stage's compute thread; the numbers do not depend on a free core
    results: dict[str, object] = {
        "benchmark": "plan_diff",
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "settings": {"requests": args.requests, "contexts": args.contexts, "steps": args.steps, "block_size": BLOCK},
        "machine": {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform()},
    }
    runs = []
    for context in args.contexts:
        runs.append(measure(args.requests, context, args.steps))
        print(json.dumps(runs[-1]))
    results["results"] = runs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
