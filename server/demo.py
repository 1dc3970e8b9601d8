"""The built-in demo model: a small random Llama, made once (deterministically) in a cache dir.

Its weights are random, so its text is gibberish; it exists to show and test the whole server
without downloading anything.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ppserve.engine.cache_dir import cache_dir
from ppserve.engine.tiny_checkpoint import TinySpec, make_tiny_checkpoint

DEMO_SPEC = TinySpec(
    arch="llama",
    hidden_size=256,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=512,
    vocab_size=2048,
    max_position_embeddings=4096,
    seed=2024,
    # Random weights rarely sample EOS: without a default, a request that names no limit runs to
    # the end of the context.
    max_new_tokens=128,
)
DEMO_NAME = "demo-llama-v2"  # bump when DEMO_SPEC or the checkpoint writer changes


def demo_checkpoint() -> Path:
    """The demo checkpoint's directory, written on first use. Built in a temporary directory and
    renamed into place, so a crash or two servers starting at once never leave half a checkpoint."""
    path = cache_dir() / DEMO_NAME
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=path.parent))
    try:
        make_tiny_checkpoint(tmp, DEMO_SPEC)
        try:
            tmp.rename(path)
        except OSError:
            if not (path / "config.json").is_file():  # lost a race to another process: use theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
