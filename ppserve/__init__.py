"""ppserve: a pipeline-parallel LLM serving engine.

The public API for applications that embed the engine::

    from ppserve import AsyncEngine, EngineConfig, SamplingParams

The code lives in four subpackages, `ppserve.engine`, `ppserve.scheduler`, `ppserve.transport` and
`ppserve.server` (folders at the top of the repository, mapped under this name by pyproject.toml).
The three names are imported on first use, so that importing the pure scheduler does not load
torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppserve.engine.async_engine import AsyncEngine
    from ppserve.engine.config import EngineConfig
    from ppserve.scheduler.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineConfig", "SamplingParams"]

_EXPORTS = {
    "AsyncEngine": "ppserve.engine.async_engine",
    "EngineConfig": "ppserve.engine.config",
    "SamplingParams": "ppserve.scheduler.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ppserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
