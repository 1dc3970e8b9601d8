"""What every benchmark result records about how it was made, and how it is written.

Each benchmark (`python -m benchmarks NAME`, benchmarks/NAME.py) writes its results JSON through
`write_result`, which puts these keys first, beside the benchmark's own figures:

    commit     the git commit measured (null outside a git checkout)
    dirty      whether tracked files differed from that commit (results files aside), so the
               figures may not be the commit's
    date       when the result was written (UTC, ISO 8601)
    script     the benchmark's module, relative to the repository (earlier: its script)
    argv       its command-line arguments
    settings   its parsed parameters (argparse's namespace, or what the benchmark passes)
    env        the PPSERVE_* environment variables set, keys aside (they change what is measured)
    machine    cpus, cpu_model and the kernels' cpu_flags (from /proc/cpuinfo), mem_gib, platform, python, torch

`python -m benchmarks tables` (benchmarks/tables/) reads them to say, under every table, what it
was measured at.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# The module `python -m benchmarks NAME` runs (benchmarks/__main__.py sets it): the `script` recorded.
SCRIPT: str | None = None
# A run writes its own results; they do not make the tree it measured dirty.
_NOT_CODE = ":(exclude)benchmarks/results"


def git_state() -> dict[str, Any]:
    """{"commit": sha or None, "dirty": bool or None} of the repository the benchmarks live in."""

    def git(*args: str) -> str | None:
        try:
            res = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return res.stdout if res.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", _NOT_CODE)
    return {"commit": commit.strip() if commit else None, "dirty": None if status is None else bool(status.strip())}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The CPU flags that decide which kernels run (engine/model/cpu_kernels.py): one machine's figures
# say which it had. Two CPUs of one "model name" (a virtual machine's "AMD EPYC") may differ here.
KERNEL_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def cpu_flags() -> list[str]:
    """Which of KERNEL_FLAGS /proc/cpuinfo lists."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in KERNEL_FLAGS if f in have]
    except OSError:
        pass
    return []


def machine() -> dict[str, Any]:
    try:
        mem_gib: float | None = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        mem_gib = None
    try:
        torch_version: str | None = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "mem_gib": mem_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch_version,
    }


def jsonable(value: Any) -> Any:
    """A settings value as JSON can hold it: tuples as lists, paths as strings, infinities as text."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def provenance(settings: argparse.Namespace | Mapping[str, Any] | None, script: str | None = None) -> dict[str, Any]:
    """The keys `write_result` adds: commit, dirty, date, script, argv, settings, env, machine."""
    values = vars(settings) if isinstance(settings, argparse.Namespace) else dict(settings or {})
    path = Path(script or SCRIPT or sys.argv[0]).resolve()
    try:
        name = str(path.relative_to(ROOT))
    except ValueError:
        name = path.name
    return {
        **git_state(),
        "date": datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat(),
        "script": name,
        "argv": sys.argv[1:],
        "settings": jsonable(values),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("PPSERVE_") and "KEY" not in k},
        "machine": machine(),
    }


def write_result(
    path: Path | str, report: Mapping[str, Any], settings: argparse.Namespace | Mapping[str, Any] | None
) -> Path:
    """Write `report` to `path` as JSON, led by `provenance(settings)`.

    A `machine` dict in the report adds to the recorded one (e.g. the load average at the end).
    NaN, which JSON cannot hold, is written as null. Returns the path written.
    """
    record = provenance(settings)
    body = dict(report)
    extra_machine = body.pop("machine", None)
    if isinstance(extra_machine, Mapping):
        record["machine"] = {**record["machine"], **extra_machine}
    for key in record:
        body.pop(key, None)  # the record's values are the ones that hold
    out = {**({"benchmark": body.pop("benchmark")} if "benchmark" in body else {}), **record, **body}
    out = json.loads(json.dumps(out, default=str), parse_constant=lambda _: None)  # NaN -> null
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=2) + "\n")
    return target


def read_result(path: Path | str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(Path(path).read_text())
    return data
