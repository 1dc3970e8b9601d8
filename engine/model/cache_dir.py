"""Where ppserve keeps what it builds once per machine: the demo model, the CPU kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$PPSERVE_CACHE_DIR, else $XDG_CACHE_HOME/ppserve, else ~/.cache/ppserve."""
    if "PPSERVE_CACHE_DIR" in os.environ:
        return Path(os.environ["PPSERVE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ppserve"
