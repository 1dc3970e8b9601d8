"""A stage that cannot fit is refused before it loads, in one line (engine/runtime/memory_check.py):
the estimate's arithmetic, the limit readers on fake /proc and /sys trees, and `ppserve generate`
in a real cgroup v1 memory cgroup whose limit is below what the stage needs."""

from __future__ import annotations

import contextlib
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from gguf_tiny import Tiny, write_tiny

from ppserve.engine.config import EngineConfig
from ppserve.engine.model.gguf_quant import packed_nbytes
from ppserve.engine.model.kv_cache import kv_bytes_per_block
from ppserve.engine.model.model_config import ConfigError
from ppserve.engine.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint
from ppserve.engine.runtime import memory_check
from ppserve.engine.runtime.memory_check import GIB, INT8_BYTES, MemoryLimit, check_stage_memory, stage_needs

MIB = 1 << 20
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
SPEC = TinySpec(arch="llama", seed=11, hidden_size=64, num_layers=4, intermediate_size=128, vocab_size=512)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("memcheck"), SPEC)


# ---- the estimate -------------------------------------------------------------------------------


def _params(stage: int, pp: int) -> dict[str, int]:
    """The tiny llama's parameters of a stage (untied: its own lm_head), by name: element counts."""
    h, i, v = SPEC.hidden_size, SPEC.intermediate_size, SPEC.vocab_size
    q, kv = h, SPEC.num_kv_heads * (h // SPEC.num_heads)
    per = SPEC.num_layers // pp
    out: dict[str, int] = {}
    for layer in range(stage * per, (stage + 1) * per):
        p = f"model.layers.{layer}."
        out |= {p + "self_attn.q_proj.weight": q * h, p + "self_attn.k_proj.weight": kv * h}
        out |= {p + "self_attn.v_proj.weight": kv * h, p + "self_attn.o_proj.weight": h * q}
        out |= {p + "mlp.gate_proj.weight": i * h, p + "mlp.up_proj.weight": i * h, p + "mlp.down_proj.weight": h * i}
        out |= {p + "input_layernorm.weight": h, p + "post_attention_layernorm.weight": h}
    if stage == 0:
        out["model.embed_tokens.weight"] = v * h
    if stage == pp - 1:
        out |= {"model.norm.weight": h, "lm_head.weight": v * h}
    return out


def test_float_checkpoint_needs_its_parameters_kv_and_one_batch(tiny: Path) -> None:
    config = EngineConfig.create(tiny, pp_size=2, kv_cache_gb=0.01)
    mc = config.model_config
    for stage in range(2):
        needs = stage_needs(config, stage)
        assert needs.weights == 4 * sum(_params(stage, 2).values())  # float32 on the CPU
        kv = kv_bytes_per_block(mc, 2, config.block_size, config.torch_dtype) * config.num_kv_blocks
        assert needs.kv_cache == kv
        per_token = 5 * mc.hidden_size + max(3 * mc.intermediate_size, 3 * mc.hidden_size + 4 * 32)
        logits = 2 * 4 * min(config.max_batched_tokens, config.max_running_requests) * mc.vocab_size
        expected = config.max_batched_tokens * per_token * 4 + kv // 2 + (logits if stage == 1 else 0)
        assert needs.activations == expected
        assert needs.total == needs.weights + max(needs.loading, needs.kv_cache + needs.activations)


def test_int8_linears_take_about_a_byte_and_their_floats_while_loading(tiny: Path) -> None:
    config = EngineConfig.create(tiny, kv_cache_gb=0.01, quantization="int8")
    params = _params(0, 1)
    linear = {n: c for n, c in params.items() if n.endswith("_proj.weight") or n == "lm_head.weight"}
    other = sum(c for n, c in params.items() if n not in linear)
    needs = stage_needs(config, 0)
    assert needs.weights == 4 * other + sum(math.ceil(c * INT8_BYTES) for c in linear.values())
    # Every linear is float until fuse quantizes it.
    assert needs.loading >= sum(4 * c - math.ceil(c * INT8_BYTES) for c in linear.values())


def test_gguf_kept_tensors_take_their_packed_size(tmp_path: Path) -> None:
    path = write_tiny(tmp_path / "tiny.gguf", Tiny(qtype=Q.Q8_0, hidden=64, heads=4, kv_heads=2, ffn=128))
    floats = EngineConfig.create(path, kv_cache_gb=0.01, quantization="none")
    kept = EngineConfig.create(path, kv_cache_gb=0.01)
    table = memory_check._gguf_table(Path(kept.model))
    names, takers, _ = memory_check._kept(kept, table)
    assert names, "the Q8_0 matrices are kept"
    with_blocks = sum(packed_nbytes(table[n][0], table[n][1]) for n in table if n in names and takers.search(n))
    assert with_blocks >= sum(int(table[n][3]) for n in table if n in names and takers.search(n))  # the file's
    numel = {n: math.prod(entry[1]) for n, entry in table.items()}
    as_floats = sum(4 * numel[n] for n in table if not (n in names and takers.search(n)))
    assert stage_needs(floats, 0).weights == 4 * sum(numel.values())
    assert stage_needs(kept, 0).weights == with_blocks + as_floats < stage_needs(floats, 0).weights


def test_refusal_is_one_line_naming_needed_and_available(tiny: Path) -> None:
    config = EngineConfig.create(tiny, kv_cache_gb=0.5)
    limit = MemoryLimit(300 * MIB, "cgroup memory limit")
    with pytest.raises(ConfigError) as refused:
        check_stage_memory(config, 0, limit)
    message = str(refused.value)
    assert "\n" not in message
    needs = stage_needs(config, 0)
    assert message.startswith(f"stage 0 (layers 0-3) needs {needs.total / GIB:.1f} GiB (weights ")
    assert "KV cache 0.5 GiB, activations " in message
    assert "but has 0.3 GiB (cgroup memory limit)" in message
    check_stage_memory(config, 0, MemoryLimit(GIB, "available memory"))  # fits: no error


def test_the_stages_of_one_node_are_checked_together(tiny: Path) -> None:
    config = EngineConfig.create(tiny, pp_size=2, kv_cache_gb=0.2)
    one = stage_needs(config, 0).total
    limit = MemoryLimit(int(1.5 * one), "available memory")
    with pytest.raises(ConfigError, match=r"^stages 0-1 \(layers 0-3\) of this node need .* GiB \(weights .* but have"):
        check_stage_memory(config, 1, limit, siblings=0)
    # The sibling already holds its share besides a process's baseline (its memory is in the
    # reading): then this stage fits.
    baseline = memory_check._rss(Path("/proc/self/status"))
    check_stage_memory(config, 1, limit, siblings=baseline + stage_needs(config, 0).total + 100 * MIB)


# ---- the limit readers, on fake files ------------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
)
MEMINFO = "MemTotal:       32000000 kB\nMemAvailable:    8388608 kB\n"
NO_LIMIT = "9223372036854771712\n"


def test_cgroup_v1_least_of_the_chain_with_droppable_cache(tmp_path: Path) -> None:
    m = "sys/fs/cgroup/memory"
    stat = f"total_active_file {100 * MIB}\ntotal_inactive_file {200 * MIB}\ntotal_mapped_file {50 * MIB}\n"
    root = _tree(
        tmp_path,
        {
            "proc/self/cgroup": "5:cpu:/\n4:memory:/jobs/one\n0::/\n",
            "proc/self/mountinfo": MOUNTS,
            "proc/meminfo": MEMINFO,
            f"{m}/memory.limit_in_bytes": NO_LIMIT,
            f"{m}/memory.usage_in_bytes": f"{4 * GIB}\n",
            f"{m}/jobs/memory.limit_in_bytes": f"{3 * GIB}\n",
            f"{m}/jobs/memory.usage_in_bytes": f"{2 * GIB}\n",
            f"{m}/jobs/one/memory.limit_in_bytes": f"{2 * GIB}\n",
            f"{m}/jobs/one/memory.usage_in_bytes": f"{GIB + 512 * MIB}\n",
            f"{m}/jobs/one/memory.stat": stat,
        },
    )
    # jobs/one: 2 GiB - 1.5 GiB used + 250 MiB of cache not mapped; jobs: 1 GiB left; root: no limit
    assert memory_check.memory_limit(root) == MemoryLimit(762 * MIB, "cgroup memory limit")
    (root / f"{m}/jobs/one/memory.limit_in_bytes").write_text(NO_LIMIT)
    assert memory_check.memory_limit(root) == MemoryLimit(GIB, "cgroup memory limit")
    (root / f"{m}/jobs/memory.limit_in_bytes").write_text(f"{16 * GIB}\n")
    assert memory_check.memory_limit(root) == MemoryLimit(8 * GIB, "available memory")  # MemAvailable


def test_cgroup_v2_and_a_container_that_sees_its_own_cgroup_as_root(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/svc/app\n",
            "proc/self/mountinfo": "40 23 0:38 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
            "proc/meminfo": MEMINFO,
            "sys/fs/cgroup/svc/app/memory.max": f"{GIB}\n",
            "sys/fs/cgroup/svc/app/memory.current": f"{900 * MIB}\n",
            "sys/fs/cgroup/svc/app/memory.stat": f"active_file {10 * MIB}\ninactive_file {30 * MIB}\nfile_mapped 0\n",
            "sys/fs/cgroup/svc/memory.max": "max\n",
            "sys/fs/cgroup/svc/memory.current": f"{GIB}\n",
        },
    )
    assert memory_check.memory_limit(root) == MemoryLimit(164 * MIB, "cgroup memory limit")
    # A container: /proc/self/cgroup names the host's path, the mount's root is that same path.
    inside = _tree(
        tmp_path / "container",
        {
            "proc/self/cgroup": "4:memory:/docker/abc\n",
            "proc/self/mountinfo": "35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n",
            "proc/meminfo": MEMINFO,
            "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{2 * GIB}\n",
            "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{GIB}\n",
        },
    )
    assert memory_check.memory_limit(inside) == MemoryLimit(GIB, "cgroup memory limit")


def test_nothing_readable_means_no_limit_but_meminfo(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"proc/meminfo": MEMINFO})
    assert memory_check.memory_limit(root) == MemoryLimit(8 * GIB, "available memory")


# ---- a real cgroup --------------------------------------------------------------------------------


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A cgroup v1 memory cgroup of its own with `limit`, removed afterwards (skips where there is
    none to make: not root, cgroup v2 only, a read-only /sys)."""
    group = CGROUP_V1 / f"ppserve-test-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a cgroup v1 memory cgroup under {CGROUP_V1}: {e}")
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        yield group
    finally:
        for _ in range(50):  # its processes have exited; the kernel lets go of it shortly
            with contextlib.suppress(OSError):
                for pid in (group / "cgroup.procs").read_text().split():
                    (group.parent / "cgroup.procs").write_text(pid)
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_generate_in_a_small_cgroup_exits_with_the_one_line_error(tiny: Path) -> None:
    limit = 1536 * MIB  # room for the host and a stage process, not for an 8 GiB KV cache
    with memory_cgroup(limit) as group:
        # The shell joins the cgroup, then becomes the CLI: every process of it is inside.
        join = f'echo $$ > {group / "cgroup.procs"} && exec "$@"'
        argv = [sys.executable, "-m", "ppserve.server.cli", "generate", "--model", str(tiny), "--prompt", "hi"]
        argv += ["--max-tokens", "2", "--kv-cache-gb", "8"]
        res = subprocess.run(["sh", "-c", join, "sh", *argv], capture_output=True, text=True, timeout=180, check=False)
        oom = (group / "memory.oom_control").read_text()
    assert res.returncode == 1, (res.returncode, res.stderr[-2000:])  # an exit, not a kill (-9)
    assert "oom_kill 0" in oom or "oom_kill " not in oom, oom
    errors = [line for line in res.stderr.splitlines() if line.startswith("ppserve generate: error:")]
    assert len(errors) == 1, res.stderr[-2000:]
    assert re.search(r"stage 0 \(layers 0-3\) needs \d+\.\d GiB \(weights 1 MiB, KV cache 8\.0 GiB, ", errors[0])
    assert errors[0].endswith(
        "(cgroup memory limit); spread the model over more stages or nodes, "
        "or lower --kv-cache-gb or --max-batched-tokens"
    )
    has = float(errors[0].split("but has ")[1].split()[0])
    assert 0 < has < limit / GIB
