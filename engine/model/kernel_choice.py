"""Which kernel runs a float linear: chosen on this machine, by timing, where that keeps the model's
output independent of how requests are batched.

A float32 or bfloat16 linear has up to three kernels (engine/model/linear.py): ppserve's own GEMM,
oneDNN's packed one (which uses the AMX tiles where the CPU has them) and torch's matmul. Which is
fastest depends on the CPU and on the row count: on an AMD EPYC with AVX-512 BF16, ppserve's
bfloat16 GEMM was the faster at a few rows, while on an Intel Xeon with AMX oneDNN was the faster
from 32 rows on (docs/models.md#quantized-weights). But only ppserve's GEMM gives a row the same
bits whatever else is in its batch (each output one sum in a fixed order; oneDNN and torch pick
their kernels by the row count, and torch's one-row product is a different routine), and ppserve
promises that a request's tokens do not depend on how the pipeline batched it: chunked or not,
prefix-cached or not, PP=1 or PP=4. So the choice has two modes (EngineConfig.kernel_choice,
$PPSERVE_KERNEL_CHOICE):

- `invariant` (the default): ppserve's GEMM wherever it runs the linear; elsewhere (no kernel
  library, a bfloat16 width it cannot take) the one kernel of the others that is fastest over the
  row counts, timed, for every call. Nothing is timed on a CPU where ppserve's GEMM runs.
- `fastest`: each call runs the kernel fastest at its row count: the weight is laid out for the
  kernel nearest the best over all row counts, and for a second one only where that saves at least
  a fifth of the time at some row count (the weight then held twice). Tokens may then differ with
  the batching, by the rounding of a sum (greedy output stays the same in float32 on the tests'
  models). For a CPU where another kernel wins by far (oneDNN's AMX at prefill sizes).

Timing: each distinct linear shape, each candidate at the row counts of ROWS (a decode step's few
rows up to a prefill chunk's hundreds), on at most SAMPLE_ROWS of the weight's output rows. The
answers are kept in a table beside the built kernels, keyed by what decides them (CPU model and
flags, torch, threads, the kernel library, the mode): a machine times a shape once. The stages of
one machine take turns (a file lock): one times, the others read its answer. Each stage logs its
linears' kernels, and /debug/pipeline shows them (`kernels`).

Only float linears are chosen for: the quantized kernels compute different things (int8 activations
in ppserve's, bfloat16 in torch's), and a model's output must not depend on a timing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

ROWS = (1, 4, 16, 64, 256)  # the row counts timed; a call takes the choice of the nearest (`bucket`)
_TOPS = (2, 8, 32, 128)  # the last row count of each bucket but the last: halfway, in powers of two
SECOND_GAIN = 0.8  # a second layout is held where its kernel takes at most this share of the first's time
SAMPLE_ROWS = 2048  # a weight's output rows timed at most: time grows with them alike for every kernel
# Timed calls per kernel and row count (the median counts), after one to warm up: REPS, or MIN_REPS
# once they took REP_BUDGET_S (a slow kernel at a prefill's rows would take seconds).
REPS, MIN_REPS, REP_BUDGET_S = 5, 3, 0.02
FORMAT = 2  # of the table file: a change of the timing or of the choice makes a new file
MODES = ("invariant", "fastest", "off")  # EngineConfig.kernel_choice (see the module doc)
INVARIANT = "ppserve"  # the kernel whose rows do not depend on their batch


def bucket(rows: int) -> int:
    """The index in ROWS of the row count whose choice a call of `rows` rows takes."""
    for i, top in enumerate(_TOPS):
        if rows <= top:
            return i
    return len(_TOPS)


def time_kernels(run: Mapping[str, Callable[[int], object]], rows: Sequence[int] = ROWS) -> dict[str, list[float]]:
    """Seconds per call of each kernel (`run[name](rows)` makes one call) at each row count: the
    median of MIN_REPS to REPS calls, the kernels taking turns, so that a change in the machine's
    load falls on all of them alike."""
    times: dict[str, list[list[float]]] = {name: [[] for _ in rows] for name in run}
    for i, n in enumerate(rows):
        for fn in run.values():
            fn(n)  # oneDNN makes (JIT-compiles) its kernel for a new shape on the first call
        for rep in range(REPS):
            for name, fn in run.items():
                if rep >= MIN_REPS and sum(times[name][i]) > REP_BUDGET_S:
                    continue
                start = time.perf_counter()
                fn(n)
                times[name][i].append(time.perf_counter() - start)
    return {name: [statistics.median(t) for t in per_rows] for name, per_rows in times.items()}


def choose(times: Mapping[str, Sequence[float]], per_rows: bool = True) -> tuple[str, ...]:
    """A kernel per row count (per entry of the times): the one nearest the fastest over all row
    counts, each row count counted alike; and with `per_rows`, at the row counts where it saves at
    least 1 - SECOND_GAIN of the first's time, the one other kernel that saves the most there."""
    names = list(times)
    counts = range(len(times[names[0]]))
    best = [min(times[k][i] for k in names) for i in counts]
    first = min(names, key=lambda k: sum(times[k][i] / best[i] for i in counts))
    if not per_rows:
        return (first,) * len(counts)

    def saves(k: str, i: int) -> bool:
        return times[k][i] <= SECOND_GAIN * times[first][i]

    others = [k for k in names if k != first and any(saves(k, i) for i in counts)]
    if not others:
        return (first,) * len(counts)
    second = max(others, key=lambda k: sum(times[first][i] / times[k][i] for i in counts if saves(k, i)))
    return tuple(second if saves(second, i) else first for i in counts)


def machine_key(library: str, mode: str) -> str:
    """What decides which kernel is chosen: the CPU (model and flags), torch's version, its thread
    count, the kernel library (`library`: its file name, which names its source and build) and the
    mode."""
    cpu = ""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join(next((li for li in lines if li.startswith(k)), "") for k in ("model name", "flags"))
    import torch  # here, so that the choosing above stays importable without it

    parts = [str(FORMAT), cpu, torch.__version__, str(torch.get_num_threads()), library, repr(ROWS), mode]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


class KernelChooser:
    """The table of choices of one machine (a JSON file: shape -> a kernel per row count of ROWS),
    read, and added to, by every stage that starts there."""

    def __init__(self, path: Path, mode: str = "invariant") -> None:
        assert mode in MODES[:2], mode
        self.path = path
        self.mode = mode
        self.chosen: dict[str, tuple[str, ...]] = {}  # this stage's shapes, as its linears run them

    @classmethod
    def for_machine(cls, cache: Path, library: str, mode: str = "invariant") -> KernelChooser:
        return cls(cache / "kernels" / f"choices-{machine_key(library, mode)}.json", mode)

    def kernels(
        self, shape: str, names: Sequence[str], run: Callable[[], Mapping[str, Callable[[int], object]]]
    ) -> tuple[str, ...]:
        """The kernel per row count of ROWS for linears of `shape` (a key naming dtype, size and
        kind), from the table, or timed now and added to it. `names`: the candidates here; `run()`
        makes them, as `time_kernels` takes them. An entry that names a kernel not among them (a
        table written by another build) is timed again. In the invariant mode, where ppserve's GEMM
        is a candidate it is the answer, untimed."""
        if self.mode == "invariant" and INVARIANT in names:
            self.chosen[shape] = (INVARIANT,) * len(ROWS)
            return self.chosen[shape]
        with self._locked():
            table = self._read()
            known = table.get(shape)
            if known is None or len(known) != len(ROWS) or not set(known) <= set(names):
                start = time.perf_counter()
                times = time_kernels(run())
                known = table[shape] = list(choose(times, per_rows=self.mode == "fastest"))
                log.info(
                    "timed the kernels of %s in %.2f s (ms at rows %s): %s", shape, time.perf_counter() - start,
                    "/".join(map(str, ROWS)),
                    "; ".join(f"{k} {' '.join(f'{t * 1e3:.3f}' for t in ts)}" for k, ts in times.items()),
                )  # fmt: skip
                self._write(table)
        self.chosen[shape] = tuple(known)
        return self.chosen[shape]

    def report(self) -> str:
        """This stage's choices, a line per shape: the kernel at each row count of ROWS."""
        head = f"linear kernels by rows {'/'.join(map(str, ROWS))}:"
        return "\n".join([head, *(f"  {shape}: {' '.join(ks)}" for shape, ks in sorted(self.chosen.items()))])

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            yield

    def _read(self) -> dict[str, list[str]]:
        """The table; empty where there is none or it is not one (then it is written anew)."""
        try:
            table = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(table, dict):
            return {}
        return {k: v for k, v in table.items() if isinstance(v, list) and all(isinstance(name, str) for name in v)}

    def _write(self, table: dict[str, list[str]]) -> None:
        """Whole or not at all: a reader never sees half a file."""
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)
