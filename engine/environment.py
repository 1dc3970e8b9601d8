"""The PPSERVE_* environment variables, read in one place.

The engine's variables are read once, by `EngineConfig.create`, into fields of the frozen config;
everything after that, stage processes included (the config is pickled to them), reads the config.
The two secrets are read where the command line is parsed, into the config they feed:
PPSERVE_CLUSTER_KEY by `transport/cluster_key.load_key` (a cluster's or a disaggregated pair's key)
and PPSERVE_API_KEY by `server/cli_clients.server_options`. PPSERVE_CACHE_DIR is read by
`engine/model/cache_dir.cache_dir`, which the host also needs before there is a config (the demo model,
GGUF preparation); the stages take it from the config.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from ppserve.engine.disagg.faults import DisaggFaults
from ppserve.engine.model.cache_dir import cache_dir
from ppserve.engine.model.model_config import ConfigError

SMOOTH_ENV = "PPSERVE_DYNAMIC_CHUNKING_SMOOTH_FACTOR"
PIN_STAGES_ENV = "PPSERVE_PIN_STAGES"
DECODE_KERNEL_ENV = "PPSERVE_DECODE_KERNEL"


def _smooth() -> float | None:
    value = os.environ.get(SMOOTH_ENV)
    if value is None or value == "":
        return None  # the field's default
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{SMOOTH_ENV} must be a number, got {value!r}") from None


# EngineConfig field -> how the environment sets it when the caller does not.
READERS: dict[str, Callable[[], Any]] = {
    "chunk_smooth": _smooth,
    # Opt-in: on a two-core machine pinning measured within the noise (engine/runtime/cpu_affinity.py).
    "pin_stages": lambda: os.environ.get(PIN_STAGES_ENV, "0") == "1",
    # On unless switched off (then decode attention uses SDPA; engine/model/decode_attention.py).
    "decode_kernel": lambda: os.environ.get(DECODE_KERNEL_ENV, "1") != "0",
    "cache_dir": lambda: str(cache_dir()),
    "disagg_faults": DisaggFaults.from_env,  # malformed: a ValueError before anything starts
}


def read(names: Iterable[str]) -> dict[str, Any]:
    """The values of those of `names` that the environment sets (None: not set, take the default)."""
    return {name: READERS[name]() for name in names if name in READERS}
