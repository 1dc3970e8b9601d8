"""The CPU decode-attention kernel (decode_attention.cpp): built once per machine, loaded with ctypes.

SDPA needs each request's keys and values gathered into one padded tensor first, and its flash
kernel is tuned for many queries; for one query per request the gather and the kernel cost
several times what reading the cache once does (scripts/profile_step.py). The kernel reads the
cache in place.

It is compiled with the system's g++ at the first stage start on a machine (about a second) into
`kernels/` of the cache directory (engine/model/cache_dir.py: ~/.cache/ppserve by default), keyed by
the source, the compiler and the CPU's flags, and loaded from there afterwards. Where there is
no compiler, or the build fails, decode attention falls back to SDPA, with one warning.

Whether to use it and where to build it come from the engine config (`decode_kernel`,
`cache_dir`), which each stage hands over through `configure` before its first step.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ppserve.engine.model.cache_dir import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.cpp")
KERNEL_DTYPES = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}
_INT64 = ctypes.c_int64
_ARGTYPES = [ctypes.c_void_p] * 6 + [_INT64] * 6 + [ctypes.c_float, _INT64]
# Sums may be reordered (that is what lets the loops vectorize; the result differs from SDPA's
# by rounding only), but NaN and infinity keep their meaning: no -ffast-math. libmvec has the
# vector expf.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno"]
FLAGS += ["-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


# (enabled, cache directory) of the config this process runs; None: not configured (a script that
# drives the model directly), then on. A cache directory of "" is the default one.
_settings: tuple[bool, str] | None = None


def configure(enabled: bool, cache: str) -> None:
    """Take the engine config's settings (a process runs the stages of one config)."""
    global _settings
    _settings = (enabled, cache)


def load() -> ctypes.CDLL | None:
    """The built kernel library, or None where it is switched off or cannot be built (then SDPA
    is used)."""
    enabled, cache = _settings or (True, "")
    return _load(cache or str(cache_dir())) if enabled else None


@functools.cache
def _load(cache: str) -> ctypes.CDLL | None:
    cxx = _compiler()
    if cxx is None:
        log.warning("no C++ compiler found: decode attention uses SDPA (slower on the CPU)")
        return None
    cmd = [cxx, *FLAGS]
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
        key = hashlib.sha256(" ".join([SOURCE.read_text(), version, _cpu_flags(), *cmd]).encode()).hexdigest()[:16]
        lib = Path(cache) / "kernels" / f"decode_attention-{key}.so"
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            # Built under a temporary name and renamed: stages starting at once each build, and
            # the rename makes whichever finishes first the one the others load.
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                out = Path(tmp) / lib.name
                subprocess.run(
                    [*cmd, str(SOURCE), "-o", str(out), "-lmvec"], capture_output=True, text=True, check=True
                )
                os.replace(out, lib)
        dll = ctypes.CDLL(str(lib))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.strip().splitlines()[-1:] if isinstance(e, subprocess.CalledProcessError) else [str(e)]
        log.warning("cannot build the decode-attention kernel (%s): decode attention uses SDPA", *detail or ["?"])
        return None
    for name in KERNEL_DTYPES.values():
        fn = getattr(dll, name)
        fn.argtypes, fn.restype = _ARGTYPES, None
    return dll


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in KERNEL_DTYPES and load() is not None


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """q: [batch, heads, head_dim] (one query per request) -> [batch, heads, head_dim].

    caches: [num_blocks, block_size, kv_heads, head_dim]; block_tables: [batch, max_blocks] int64;
    context_lens: [batch] int64, keys per request (the query's position + 1).
    """
    dll = load()
    assert dll is not None and q.dtype == k_cache.dtype, "call only where available()"
    q = q.contiguous()
    out = torch.empty_like(q)
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    getattr(dll, KERNEL_DTYPES[q.dtype])(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        batch,
        heads,
        kv_heads,
        head_dim,
        block_size,
        block_tables.shape[1],
        scale,
        window or 0,
    )
    return out
