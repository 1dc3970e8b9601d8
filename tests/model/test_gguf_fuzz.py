"""Fuzzing the GGUF reader: Hypothesis mutates small valid GGUF files (the header's counts, the
lengths, types and values of metadata, tensor shapes, types and offsets, random bytes, truncation)
and each outcome must be a clean load (config, every tensor, the tokenizer, a stage built) or one
ConfigError, never another exception; and the whole run must stay within a bound of memory.

The run happens in a child process (this file run as a script), so that its peak memory is its
own to measure. Reproducible: Hypothesis derandomized.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from gguf import GGMLQuantizationType as Q
from gguf_tiny import Tiny, slots, write_tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import ROOT

EXAMPLES = 200
MEMORY_BOUND_KIB = 1 << 20  # 1 GiB of peak growth over a valid load, for the whole run
BASES = {"f32-llama": Tiny(), "q8-qwen3": Tiny(arch="qwen3", qtype=Q.Q8_0, seed=1)}
INTERESTING = [0, 1, 2, 3, 4, 7, 8, 31, 32, 33, 63, 64, 255, 256, 4096, 1 << 16, (1 << 31) - 1, 1 << 31]
INTERESTING += [(1 << 32) - 1, 1 << 32, 1 << 40, (1 << 63) - 1, 1 << 63, (1 << 64) - 32, (1 << 64) - 1]
FLOATS = [float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 1e-45, 1e38, 0.5]


def test_fuzzed_gguf_files_load_or_give_one_config_error(tmp_path: Path) -> None:
    # The child is this file as a script: tests/ on its path for the helpers, as pytest has it.
    path = [str(ROOT / "tests"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PPSERVE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": os.pathsep.join(path)}
    res = subprocess.run(
        [sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=600, env=env
    )
    assert res.returncode == 0, res.stderr[-8000:]
    summary = json.loads(res.stdout.splitlines()[-1])
    assert summary["loaded"] > 0 and summary["refused"] > 0, summary  # both outcomes were reached
    assert summary["peak_growth_kib"] < MEMORY_BOUND_KIB, summary


# --- the child ---------------------------------------------------------------------------------

Mutation = tuple[str, int, int | bytes]  # (what, where, value)


@st.composite
def mutation(draw: st.DrawFn, layout: dict[str, int], base: bytes) -> Mutation:
    size = len(base)
    kind = draw(st.sampled_from(["slot", "slot", "nudge", "nudge", "float", "bytes", "truncate"]))
    if kind == "truncate":
        return ("truncate", draw(st.integers(0, size - 1)), 0)
    if kind == "bytes":  # mostly in the header, where a byte means most
        end = draw(st.sampled_from([layout["data_start"], size]))
        return ("bytes", draw(st.integers(0, end - 1)), draw(st.binary(min_size=1, max_size=8)))
    if kind == "float":
        keys = [k for k in layout if k.startswith("value:") and ("epsilon" in k or "freq_base" in k)]
        value = draw(st.sampled_from(FLOATS) | st.floats(width=32))
        return ("bytes", layout[draw(st.sampled_from(sorted(keys)))], struct.pack("<f", value))
    slot = draw(st.sampled_from(sorted(k for k in layout if k != "data_start")))
    width = 4 if slot.split(":")[0] in ("type", "ndims", "version", "value") else 8
    value = draw(st.sampled_from(INTERESTING) | st.integers(0, 1 << 12) | st.integers(0, (1 << 8 * width) - 1))
    if kind == "nudge":  # near the value that was there: an offset moved a little, a count off by one
        delta = draw(st.sampled_from([-1, 1, -32, 32, -4, 4]) | st.integers(-4096, 4096))
        value = int.from_bytes(base[layout[slot] : layout[slot] + width], "little") + delta
    return ("bytes", layout[slot], (value % (1 << 8 * width)).to_bytes(width, "little"))


def mutated(base: bytes, mutations: list[Mutation]) -> bytes:
    data = bytearray(base)
    for kind, pos, value in mutations:
        if kind == "truncate":
            del data[pos:]
        elif pos < len(data):
            assert isinstance(value, bytes)
            data[pos : pos + len(value)] = value
    return bytes(data)


def load(path: Path) -> None:
    """Everything a start does with the file: prepare it, read the config, build a stage (every
    tensor read, fused, its KV cache allocated) and the tokenizer."""
    from ppserve.engine.config import EngineConfig
    from ppserve.engine.model.tokenizer import Tokenizer
    from ppserve.engine.runtime.stage_runner import StageRunner

    config = EngineConfig.create(path, num_kv_blocks=4, cpu_kernels=False)
    StageRunner(config, 0)
    Tokenizer(config.model).encode("the pipeline")


def run_child(root: Path) -> dict[str, int]:
    from ppserve.engine.model.gguf_header import read_header
    from ppserve.engine.model.model_config import ConfigError

    bases = {name: write_tiny(root / f"{name}.gguf", spec) for name, spec in BASES.items()}
    for path in bases.values():
        load(path)  # valid as written: what the imports and a whole load cost
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    layouts = {}
    for name, path in bases.items():
        layouts[name] = slots(path) | {"data_start": read_header(path).data_start}
    contents = {name: path.read_bytes() for name, path in bases.items()}
    counts = {"loaded": 0, "refused": 0}
    names = iter(range(1 << 30))

    @st.composite
    def case(draw: st.DrawFn) -> tuple[str, list[Mutation]]:
        name = draw(st.sampled_from(sorted(bases)))
        return name, draw(st.lists(mutation(layouts[name], contents[name]), min_size=1, max_size=3))

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case())
    def fuzz(example: tuple[str, list[Mutation]]) -> None:
        name, mutations = example
        path = root / f"m{next(names)}.gguf"  # a new name: the hash memo keys on path, size and mtime
        path.write_bytes(mutated(contents[name], mutations))
        try:
            load(path)
            counts["loaded"] += 1
        except ConfigError as e:
            assert "\n" not in str(e), str(e)
            counts["refused"] += 1
        finally:
            path.unlink()

    fuzz()
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss
    return counts | {"peak_growth_kib": growth}


if __name__ == "__main__":
    # As a script: PYTHONPATH=tests python tests/model/test_gguf_fuzz.py [DIR] runs the fuzzing and
    # prints a summary.
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp)
        print(json.dumps(run_child(root)))
