"""The PPSERVE_* environment variables, read in one place.

The engine's variables are read once, by `EngineConfig.create`, into fields of the frozen config;
everything after that, stage processes included (the config is pickled to them), reads the config.
The two secrets are read where the command line is parsed, into the config they feed:
PPSERVE_CLUSTER_KEY by `transport/cluster_key.load_key` (a cluster's or a disaggregated pair's key)
and PPSERVE_API_KEY by `server/cli_clients.server_options`. PPSERVE_CACHE_DIR is read by
`engine/model/cache_dir.cache_dir`, which the host also needs before there is a config (the demo model,
GGUF preparation); the stages take it from the config.
PPSERVE_CPU_ISA is read by `engine/model/cpu_kernels.load` on each machine that builds the CPU
kernels: which instruction-set paths to compile is a question about that machine's CPU (a variant
it cannot run builds native), and a way to test the paths of other CPUs, not a setting of a run.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from typing import Any

from ppserve.engine.disagg.faults import DisaggFaults
from ppserve.engine.model.cache_dir import cache_dir
from ppserve.engine.model.model_config import ConfigError

SMOOTH_ENV = "PPSERVE_DYNAMIC_CHUNKING_SMOOTH_FACTOR"
PIN_STAGES_ENV = "PPSERVE_PIN_STAGES"
CPU_KERNELS_ENV = "PPSERVE_CPU_KERNELS"
KERNEL_CHOICE_ENV = "PPSERVE_KERNEL_CHOICE"
LOOP_WATCH_ENV = "PPSERVE_DEBUG_LOOP_MS"
DECODE_AHEAD_ENV = "PPSERVE_DECODE_AHEAD"
COMPUTE_NICE_ENV = "PPSERVE_COMPUTE_NICE"


def _number(name: str) -> float | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None  # the field's default
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
    return number


def _nice() -> int | None:
    number = _number(COMPUTE_NICE_ENV)
    if number is not None and number != int(number):
        raise ConfigError(f"{COMPUTE_NICE_ENV} must be a whole number, got {number!r}")
    return None if number is None else int(number)


def _loop_watch() -> float | None:
    ms = _number(LOOP_WATCH_ENV)
    return ms or None  # 0: off


# EngineConfig field -> how the environment sets it when the caller does not.
READERS: dict[str, Callable[[], Any]] = {
    "chunk_smooth": lambda: _number(SMOOTH_ENV),
    # Opt-in: on a two-core machine pinning measured within the noise (engine/runtime/cpu_affinity.py).
    "pin_stages": lambda: os.environ.get(PIN_STAGES_ENV, "0") == "1",
    # On unless switched off (then the forward pass runs torch ops only; engine/model/cpu_kernels.py).
    "cpu_kernels": lambda: os.environ.get(CPU_KERNELS_ENV, "1") != "0",
    # invariant, fastest or off (engine/model/kernel_choice.py); checked by EngineConfig.create.
    "kernel_choice": lambda: os.environ.get(KERNEL_CHOICE_ENV) or None,
    # On unless switched off (A/B: the host's turnaround between decode steps; scheduler/scheduler.py).
    "decode_ahead": lambda: os.environ.get(DECODE_AHEAD_ENV, "1") != "0",
    # How far below the host and the stages' event loops the compute threads run (engine/runtime/priority.py).
    "compute_nice": _nice,
    "cache_dir": lambda: str(cache_dir()),
    "disagg_faults": DisaggFaults.from_env,  # malformed: a ValueError before anything starts
    # Tests: stages report event-loop callbacks over this many ms of CPU (engine/runtime/loop_watch.py).
    "debug_loop_ms": _loop_watch,
}


def read(names: Iterable[str]) -> dict[str, Any]:
    """The values of those of `names` that the environment sets (None: not set, take the default)."""
    return {name: READERS[name]() for name in names if name in READERS}
