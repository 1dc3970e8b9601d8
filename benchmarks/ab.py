"""A/B serving throughput: a base commit (A) against this checkout (B), rounds alternating.

A is a git worktree of the base commit with its own .venv (created on first use with
`git worktree add --detach` and scripts/venv.sh; a shared venv would import this checkout's
code, since ppserve is installed editable). B is this checkout as it is (its working tree,
uncommitted changes included), served from its own .venv; with --candidate REV, B is a worktree
of that commit instead, made as A's is, so that two commits are compared. For each --pp-size,
every round starts one side's `ppserve serve` on loopback (the demo model unless --model),
drives benchmarks/serving.py's HTTP load generator at it (a warm-up burst, then the measured
workload, the same prompts for both sides), and stops it (SIGTERM, then SIGKILL for the server
and any stage left over) before the other side starts: one server at a time. The side that goes
first alternates from round to round (A B, B A, A B, ...), so drift in the machine's speed hits
both alike; --fixed-order keeps A first. The run stops if either checkout moves (a commit, an
edit) between rounds. Other load on the machine skews a round: "others' CPU-s" says how much CPU
other processes took during it.

    python -m benchmarks ab                       # base 28e8e46, PP 1 and 2, 3 rounds each
    python -m benchmarks ab --rounds 1 --num-requests 16 --pp-size 1      # a quick trial
    python -m benchmarks ab --base 2032a0f --candidate 2db6229            # two commits

Reported per PP size: median output-token and request throughput per side, ITL p50, and B/A
(of the medians, and per round). Writes benchmarks/results/ab_throughput[_TAG].json.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.record import write_result
from benchmarks.serving import children, http_run, make_workload, median_summary, parse_range, run_async

ROOT = Path(__file__).resolve().parent.parent

SMOLLM2_VOCAB = 49152  # the demo model's vocabulary: prompt ids are drawn below it
REPORTED = (
    ("output tok/s", "output_token_throughput"),
    ("req/s", "request_throughput"),
    ("ITL p50 (ms)", "itl_ms_p50"),
    ("TTFT p50 (ms)", "ttft_ms_p50"),
    ("others' CPU-s", "other_cpu_s"),
)


@dataclass(frozen=True)
class Side:
    name: str  # "A" or "B"
    checkout: Path
    commit: str
    dirty: bool

    @property
    def ppserve(self) -> Path:
        return self.checkout / ".venv" / "bin" / "ppserve"

    def describe(self) -> dict[str, Any]:
        return {"checkout": str(self.checkout), "commit": self.commit, "dirty": self.dirty}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def tree_dirty(checkout: Path) -> bool:
    """Tracked files differ from HEAD (results files aside, as benchmarks/harness/record.py counts it)."""
    status = git(checkout, "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
    return bool(status)


def prepare_worktree(name: str, ref: str, where: Path, dir_flag: str) -> Side:
    """Side `name`'s worktree of commit `ref` and its venv: created when missing, checked when present."""
    want = git(ROOT, "rev-parse", "--verify", f"{ref}^{{commit}}")
    if not where.exists():
        print(f"creating worktree {where} at {want[:12]}", flush=True)
        git(ROOT, "worktree", "add", "--detach", str(where), want)
    have = git(where, "rev-parse", "HEAD")
    if have != want:
        raise SystemExit(f"{where} is at {have[:12]}, not at {ref} ({want[:12]}); remove it or pass {dir_flag}")
    subprocess.run([str(where / "scripts" / "venv.sh")], check=True)  # no-op once installed
    return Side(name, where, want, tree_dirty(where))


def check_imports_own_code(side: Side) -> None:
    """The side's venv must import ppserve from its own checkout, every sub-package."""
    python = side.checkout / ".venv" / "bin" / "python"
    code = "import ppserve.engine, ppserve.scheduler, ppserve.server, ppserve.transport as t; "
    code += "print('\\n'.join(m.__file__ for m in (ppserve.engine, ppserve.scheduler, ppserve.server, t)))"
    out = subprocess.run([str(python), "-c", code], cwd="/", check=True, capture_output=True, text=True).stdout
    for path in out.split():
        if not Path(path).resolve().is_relative_to(side.checkout.resolve()):
            raise SystemExit(f"side {side.name}: {python} imports {path}, outside {side.checkout}")


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@contextlib.contextmanager
def served(side: Side, args: argparse.Namespace, pp_size: int) -> Iterator[tuple[str, int]]:
    """The side's `ppserve serve` on a free loopback port; yields (base URL, pid). On the way out:
    SIGTERM, then SIGKILL for the server and for any stage process it leaves behind."""
    cmd = [str(side.ppserve), "serve", "--host", "127.0.0.1", "--port", "0", "--pp-size", str(pp_size)]
    cmd += ["--kv-cache-gb", str(args.kv_cache_gb), "--max-running-requests", str(args.max_running_requests)]
    cmd += ["--chunked-prefill-size", str(args.chunked_prefill_size), "--log-level", "warning"]
    cmd += ["--model", args.model] if args.model else []
    # Its own session: the stages share its process group, so nothing outlives the round.
    proc = subprocess.Popen(
        cmd, cwd=side.checkout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    stages: list[int] = []
    try:
        lines = []
        for line in proc.stdout:  # the URL line comes once the stages are up; EOF if start-up failed
            lines.append(line)
            if match := re.search(r"at (http://\S+)", line):
                break
        else:
            raise RuntimeError(f"side {side.name}: ppserve serve did not start:\n" + "".join(lines[-20:]))
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # a full pipe would block it
        stages = children(proc.pid)
        yield match.group(1), proc.pid
    finally:
        stages = sorted({*stages, *children(proc.pid)})
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=args.stop_timeout)
            except subprocess.TimeoutExpired:
                print(f"side {side.name}: server did not stop in {args.stop_timeout:g} s; killing it", flush=True)
                proc.kill()
                proc.wait()
        deadline = time.monotonic() + 10
        while (left := [p for p in stages if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            print(f"side {side.name}: killing stage processes left behind: {left}", flush=True)
            kill_all(left)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything else still in the server's group


def check_unchanged(side: Side) -> None:
    """Stop if the side's checkout moved (a commit, an edit) since the run began: its rounds would mix code."""
    now = (git(side.checkout, "rev-parse", "HEAD"), tree_dirty(side.checkout))
    if now != (side.commit, side.dirty):
        raise SystemExit(
            f"side {side.name}: {side.checkout} changed during the run (was {side.commit[:12]}, dirty={side.dirty}; "
            f"now {now[0][:12]}, dirty={now[1]}); run again on a checkout that stays put"
        )


def one_round(side: Side, args: argparse.Namespace, pp_size: int, warmup: list[Any], jobs: list[Any]) -> dict[str, Any]:
    check_unchanged(side)
    t0 = time.perf_counter()
    with served(side, args, pp_size) as (url, pid):
        started = time.perf_counter() - t0
        result = run_async(http_run(url, args, warmup, jobs, pid))
    result = {k: v for k, v in result.items() if k != "_samples"}
    result["startup_s"] = started
    result["round_s"] = time.perf_counter() - t0
    check_unchanged(side)
    return result


def ratio(b: float, a: float) -> float:
    return b / a if a and math.isfinite(a) and math.isfinite(b) else math.nan


def compare(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per side the medians over rounds; B/A of the medians and of each round's pair."""
    medians = {side: median_summary(rs) for side, rs in rounds.items()}
    keys = [k for _, k in REPORTED[:3]]
    out: dict[str, Any] = {}
    for side, rs in rounds.items():
        out[side] = {**medians[side], "errors": sorted({e for r in rs for e in r["errors"]})[:5]}
    out["ratio_b_over_a"] = {k: ratio(medians["B"][k], medians["A"][k]) for k in keys}
    out["ratio_b_over_a_per_round"] = {
        k: [ratio(b[k], a[k]) for a, b in zip(rounds["A"], rounds["B"], strict=True)] for k in keys
    }
    out["rounds"] = rounds
    return out


def print_report(pp_size: int, result: dict[str, Any]) -> None:
    print(f"\nPP={pp_size}: median of {len(result['rounds']['A'])} round(s)")
    print(f"{'':16s}{'A (base)':>12s}{'B':>12s}{'B/A':>8s}   B/A per round")
    for label, key in REPORTED:
        a, b = result["A"][key], result["B"][key]
        line = f"{label:16s}{a:12.1f}{b:12.1f}"
        if key in result["ratio_b_over_a"]:
            per_round = " ".join(f"{x:.3f}" for x in result["ratio_b_over_a_per_round"][key])
            line += f"{result['ratio_b_over_a'][key]:8.3f}   {per_round}"
        print(line)
    print(f"failed requests: A {result['A']['failed']:.0f}, B {result['B']['failed']:.0f}")
    for side in ("A", "B"):
        for err in result[side]["errors"]:
            print(f"  {side}: {err}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="28e8e46", help="the base commit (side A)")
    p.add_argument("--base-dir", default=str(ROOT.parent / "wt-base"), help="its worktree (created if missing)")
    p.add_argument("--candidate", default=None, help="side B's commit (default: this checkout, as it is)")
    p.add_argument("--candidate-dir", default=str(ROOT.parent / "wt-candidate"), help="its worktree, with --candidate")
    p.add_argument("--pp-size", type=int, nargs="+", default=[1, 2], help="pipeline sizes, measured in turn")
    p.add_argument("--rounds", type=int, default=3, help="rounds per PP size; each round runs A and B once")
    p.add_argument("--fixed-order", action="store_true", help="A first in every round (default: alternate)")
    p.add_argument("--model", default=None, help="`ppserve serve --model` (default: the demo model, SmolLM2-135M)")
    p.add_argument("--vocab-size", type=int, default=SMOLLM2_VOCAB, help="prompt ids are drawn below this")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson req/s (default inf: all at once)")
    p.add_argument("--input-len", type=parse_range, default=(64, 192), help="LO:HI, uniform")
    p.add_argument("--output-len", type=parse_range, default=(32, 96), help="LO:HI, uniform")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=8)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--stop-timeout", type=float, default=30.0, help="seconds a server gets to stop after SIGTERM")
    p.add_argument("--tag", default="", help="suffix for the output file: ab_throughput_TAG.json")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks/results"))
    args = p.parse_args(argv)
    # http_run's request fields: the served model's default name, no key.
    args.model_name, args.api_key = None, None
    torch.set_num_threads(1)  # the client only streams; the cores are the server's

    a = prepare_worktree("A", args.base, Path(args.base_dir).resolve(), "--base-dir")
    if args.candidate:
        b = prepare_worktree("B", args.candidate, Path(args.candidate_dir).resolve(), "--candidate-dir")
    else:
        b = Side("B", ROOT, git(ROOT, "rev-parse", "HEAD"), tree_dirty(ROOT))
        if not b.ppserve.exists():
            subprocess.run([str(ROOT / "scripts" / "venv.sh")], check=True)
    for side in (a, b):
        check_imports_own_code(side)
        print(f"side {side.name}: {side.commit[:12]}{' (dirty)' if side.dirty else ''} in {side.checkout}", flush=True)

    jobs = make_workload(
        args.num_requests, args.input_len, args.output_len, args.request_rate, args.vocab_size, args.seed
    )
    # Warm-up: a short burst of small requests (other seed), so no measured run pays first-call costs.
    warmup = make_workload(args.warmup_requests, args.input_len, (8, 8), math.inf, args.vocab_size, args.seed + 1)

    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    for pp_size in args.pp_size:
        rounds: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
        for i in range(args.rounds):
            order = (a, b) if args.fixed_order or i % 2 == 0 else (b, a)
            for side in order:
                r = one_round(side, args, pp_size, warmup, jobs)
                rounds[side.name].append(r)
                print(
                    f"PP={pp_size} round {i + 1} {side.name}: {r['output_token_throughput']:.1f} tok/s, "
                    f"{r['request_throughput']:.2f} req/s, ITL p50 {r['itl_ms_p50']:.1f} ms, "
                    f"{r['failed']} failed (start-up {r['startup_s']:.0f} s, round {r['round_s']:.0f} s)",
                    flush=True,
                )
        results[f"pp{pp_size}"] = compare(rounds)
        print_report(pp_size, results[f"pp{pp_size}"])

    report: dict[str, Any] = {
        "benchmark": "ab_throughput",
        "base": {"ref": args.base, **a.describe()},
        "candidate": {"ref": args.candidate, **b.describe()} if args.candidate else b.describe(),
        "model": args.model or "demo (SmolLM2-135M-Instruct)",
        "results": results,
        "wall_s": time.perf_counter() - t0,
        "machine": {"loadavg_end": list(os.getloadavg())},
    }
    stem = "ab_throughput" + (f"_{args.tag}" if args.tag else "")
    path = write_result(Path(args.out_dir) / f"{stem}.json", report, args)
    print(f"\nwrote {path} ({report['wall_s']:.0f} s)")
