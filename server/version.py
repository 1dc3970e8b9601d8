"""The installed package's version, for /version, the OpenAPI document and `ppserve --version`
(a module of its own so that the CLI reads it without loading the engine)."""

from __future__ import annotations

import importlib.metadata


def installed_version() -> str:
    try:
        return importlib.metadata.version("ppserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"
