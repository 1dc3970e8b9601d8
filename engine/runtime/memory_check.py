"""Whether a stage fits in the memory its process may use: told in one line before it loads.

A stage whose weights, KV cache and activations do not fit would otherwise be killed by the
kernel's OOM killer halfway through loading (or at its first long prefill), with no message but a
signal. `check_stage_memory` runs first, in the stage process, and raises a ConfigError that
names what the stage needs and what it has, which reaches the user as the CLI's one-line error.

What a stage needs (`stage_needs`), in bytes:
- weights: the stage's own tensors (the parameters `StageModel` makes for its layers) as they are
  kept. A GGUF's tensors that stay quantized (`--quantization auto`: what weights.py keeps, the
  embedding too where the GGUF block kernels run) take their size in the file, a tied embedding
  that is also the LM head once; every other tensor takes its element count times the engine
  dtype's size, as it is dequantized or converted; with `--quantization int8` every linear takes
  1 + 2/32 bytes per weight (int8 and a float16 scale per block of 32).
- loading: the copies that exist only while loading, above the weights: float linears wait for
  `StageModel.fuse` before int8 quantizes them (all of them at once); a fused group (q/k/v, gate
  and up) is concatenated and packed beside its parts; a GGUF tensor dequantized by gguf-py goes
  through float32 temporaries of about 2.5 times its float32 size.
- KV cache: exactly what `allocate_kv_cache` allocates (kv_bytes_per_block times the blocks).
- activations: one micro-batch of `max_batched_tokens` tokens at the engine dtype: per token
  the residual stream, the previous layer's pending output, a norm's output and the two edge
  buffers (5 x hidden), plus the larger of the MLP's gate/up output and product (3 x
  intermediate) and attention's q/k/v, rotated q/k and output (3 x q width + 4 x kv width); the
  gather buffers of the fallback attention (at most one layer's K and V of the whole cache); on
  the last stage, float32 logits and the sampler's copy for as many rows as requests in a batch.
The stage needs the weights plus the larger of the loading copies and the KV cache with the
activations (the cache is allocated once the weights are in).

What it has (`memory_limit`): the least of the machine's MemAvailable, and for each memory cgroup
of this process and its ancestors (v1: memory.limit_in_bytes - memory.usage_in_bytes; v2:
memory.max - memory.current) what is left under the limit. Page cache that the kernel would drop
before it kills anything (file pages not mapped by any process: a checkpoint read or hashed at
start-up is charged to the cgroup too) counts as free; mapped file pages (weights kept in a
memory-mapped file) do not. Only on the CPU: on CUDA the weights and the cache are in the GPU's
memory, whose exhaustion is torch's error, not a kill.

The stages of one node start together and each reads the same free memory, so each checks the
node's whole share: the needs of every stage on this node, against what is free now plus what
its sibling stage processes already hold (their memory is in the reading) less a process's
baseline for each sibling (this process's size now: the interpreter, torch, the engine).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ppserve.engine.model.gguf_checkpoint import is_prepared_gguf
from ppserve.engine.model.gguf_quant import packed_nbytes
from ppserve.engine.model.kv_cache import kv_bytes_per_block, windowed_layers
from ppserve.engine.model.model_config import ConfigError
from ppserve.engine.model.weights import LINEAR, QUANT_TAKERS, kept_quantized

if TYPE_CHECKING:
    from ppserve.engine.config import EngineConfig

GIB = 1 << 30
INT8_BYTES = 1 + 2 / 32  # --quantization int8: a byte per weight and a float16 scale per 32
# The parameters that take a kept GGUF tensor, as in weights.py: linears, and with the GGUF block
# kernels the embedding too.
_TIED_SOURCE = "model.embed_tokens.weight"
_GGUF_TEMPORARIES = 2.5  # gguf-py's dequantization: float32 temporaries per float32 result
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1
_STAGE_NAME = "ppserve-stage-"  # the stage processes' names (stage_process.set_process_name)


@dataclass(frozen=True)
class StageNeeds:
    """Bytes a stage needs (see the module doc for how each is estimated)."""

    weights: int
    loading: int  # above the weights, while loading only
    kv_cache: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + max(self.loading, self.kv_cache + self.activations)

    def __add__(self, other: StageNeeds) -> StageNeeds:
        # Stages of one node load at once: their loading copies add up too (a bound).
        return StageNeeds(
            self.weights + other.weights,
            self.loading + other.loading,
            self.kv_cache + other.kv_cache,
            self.activations + other.activations,
        )


@dataclass(frozen=True)
class MemoryLimit:
    available: int  # bytes this process may still use
    source: str  # what limits it: "cgroup memory limit" or "available memory"


def stage_needs(config: EngineConfig, stage: int) -> StageNeeds:
    weights, loading = _weight_bytes(config, stage)
    kv = _kv_cache_bytes(config, stage)
    return StageNeeds(weights, loading, kv, _activation_bytes(config, stage, kv))


def _weight_bytes(config: EngineConfig, stage: int) -> tuple[int, int]:
    """(weights as kept, extra bytes while loading) of the stage's own tensors."""
    from ppserve.engine.model.model import StageModel

    mc, e = config.model_config, config.torch_dtype.itemsize
    with torch.device("meta"):  # the stage's parameters, by name and shape, without memory
        model = StageModel(mc, config.layer_ranges[stage], stage == 0, stage == config.pp_size - 1)
    shapes = {name: math.prod(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    table = _gguf_table(Path(config.model))
    kept, takers, blocks = _kept(config, table)
    weights, waiting, staging = 0, 0, 0
    shared: set[str] = set()  # kept GGUF tensors counted (a tied embedding is the LM head too)
    groups: dict[str, int] = {}  # fused group (q/k/v, gate/up, or a lone linear) -> its bytes
    for name, numel in shapes.items():
        linear = LINEAR.search(name) is not None
        src = _TIED_SOURCE if name == "lm_head.weight" and table and name not in table else name
        if src in kept and takers.search(name):
            type_name, shape = table[src][0], table[src][1]
            size = 0 if src in shared else int(table[src][3])  # the file's blocks
            shared.add(src)
            if blocks:  # repacked by fuse, the file's pages then let go (a tied embedding's too)
                weights += 0 if size == 0 else packed_nbytes(type_name, shape)
                continue
        elif linear and config.quantization == "int8":
            size = math.ceil(numel * INT8_BYTES)
            waiting += numel * e - size  # its float copy, until fuse quantizes it
            staging = max(staging, 2 * 4 * numel)  # quantize_int8 works in float32
        else:
            size = numel * e
            if table and src in table and table[src][0] not in ("F32", "F16", "BF16"):
                staging = max(staging, int(_GGUF_TEMPORARIES * 4 * numel))  # dequantized by gguf-py
        weights += size
        if linear:
            group = re.sub(r"\.(q|k|v)_proj\.|\.(gate|up)_proj\.", ".", name)
            groups[group] = groups.get(group, 0) + size
    fuse = 2 * max(groups.values(), default=0)  # concatenated and packed beside the parts (a bound)
    return weights, waiting + max(fuse, staging)


def _kept(config: EngineConfig, table: dict[str, list[Any]]) -> tuple[set[str], re.Pattern[str], bool]:
    """The GGUF tensors kept quantized, the parameters that take them (as weights.py decides), and
    whether they run as their blocks."""
    if not table or config.quantization != "auto":
        return set(), LINEAR, False
    from ppserve.engine.model import cpu_kernels

    cpu_kernels.configure(config.cpu_kernels, config.cache_dir)  # as the stage runner is about to
    types, takers = kept_quantized(torch.device(config.device), config.torch_dtype)
    return {name for name, entry in table.items() if entry[0] in types}, takers, takers is QUANT_TAKERS


def _gguf_table(model_dir: Path) -> dict[str, list[Any]]:
    """A prepared GGUF's tensor table (engine name -> [type, shape, offset, bytes, heads]); {} else."""
    if not is_prepared_gguf(model_dir):
        return {}
    import json

    from ppserve.engine.model.gguf_checkpoint import INFO_FILE

    tensors: dict[str, list[Any]] = json.loads((model_dir / INFO_FILE).read_text())["tensors"]
    return tensors


def _kv_cache_bytes(config: EngineConfig, stage: int) -> int:
    """What the stage's KV cache allocates: a block of each full-attention layer for each of the
    engine's blocks, and of each sliding-window layer for each block of the windowed group's pool,
    where there is one (engine/model/kv_cache.py)."""
    mc = config.model_config
    per_layer = kv_bytes_per_block(mc, 1, config.block_size, config.torch_dtype)
    windowed = windowed_layers(mc.sliding_windows, config.kv_window)
    window_blocks = config.num_window_blocks
    return sum(per_layer * (window_blocks if windowed[i] else config.num_kv_blocks) for i in config.layer_ranges[stage])


def _activation_bytes(config: EngineConfig, stage: int, kv_cache: int) -> int:
    mc, e, tokens = config.model_config, config.torch_dtype.itemsize, config.max_batched_tokens
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    per_token = 5 * mc.hidden_size + max(3 * mc.intermediate_size, 3 * q + 4 * kv)
    gather = kv_cache // max(1, len(config.layer_ranges[stage]))
    logits = 0
    if stage == config.pp_size - 1:
        logits = 2 * 4 * min(tokens, config.max_running_requests) * mc.vocab_size
    return tokens * per_token * e + gather + logits


# ---- what the process may use ------------------------------------------------------------------


def memory_limit(root: Path = Path("/")) -> MemoryLimit:
    """The least of MemAvailable and what each memory cgroup of this process leaves (`root`: where
    /proc and /sys are, for tests)."""
    found = [MemoryLimit(_mem_available(root), "available memory")]
    for left in (*_cgroup_v1(root), *_cgroup_v2(root)):
        found.append(MemoryLimit(left, "cgroup memory limit"))
    return min(found, key=lambda limit: limit.available)


def _mem_available(root: Path) -> int:
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return _UNLIMITED  # no reading: no limit from here


def _cgroup_v1(root: Path) -> list[int]:
    """What is left under each limited v1 memory cgroup from this process's up to the root."""
    out = []
    for path in _chain(root, "cgroup", lambda controllers: "memory" in controllers.split(",")):
        limit = _read_int(path / "memory.limit_in_bytes")
        usage = _read_int(path / "memory.usage_in_bytes")
        if limit is None or usage is None or limit >= _UNLIMITED:
            continue
        stat = _read_stat(path / "memory.stat")
        prefix = "total_" if "total_inactive_file" in stat else ""  # hierarchical, with descendants
        files = (prefix + "active_file", prefix + "inactive_file", prefix + "mapped_file")
        out.append(limit - usage + _droppable(stat, *files))
    return out


def _cgroup_v2(root: Path) -> list[int]:
    out = []
    for path in _chain(root, "cgroup2", lambda controllers: controllers == ""):
        limit = _read_int(path / "memory.max")  # "max": none
        usage = _read_int(path / "memory.current")
        if limit is None or usage is None or limit >= _UNLIMITED:
            continue
        stat = _read_stat(path / "memory.stat")
        out.append(limit - usage + _droppable(stat, "active_file", "inactive_file", "file_mapped"))
    return out


def _droppable(stat: dict[str, int], active: str, inactive: str, mapped: str) -> int:
    """Page cache the kernel drops before it kills: file pages, less those mapped by a process."""
    return max(0, stat.get(active, 0) + stat.get(inactive, 0) - stat.get(mapped, 0))


def _chain(root: Path, fstype: str, wanted: Callable[[str], bool]) -> list[Path]:
    """This process's cgroup directories of one hierarchy, from its own to the mount's root."""
    try:
        groups = (root / "proc/self/cgroup").read_text().splitlines()
        mounts = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in groups:
        parts = line.split(":", 2)
        if len(parts) != 3 or not wanted(parts[1]) or (fstype == "cgroup2") != (parts[0] == "0"):
            continue
        mount = _mount(mounts, fstype, parts[1])
        if mount is None:
            continue
        mount_root, mount_point = mount
        relative = parts[2]
        if mount_root != "/" and (relative + "/").startswith(mount_root.rstrip("/") + "/"):
            relative = relative[len(mount_root.rstrip("/")) :]  # a container's own cgroup, mounted as the root
        top = root / mount_point.lstrip("/")
        here = top / relative.strip("/")
        if not here.is_dir():  # a cgroup namespace: the path is relative to what is mounted
            here = top
        return [here, *(p for p in here.parents if p.is_relative_to(top))]
    return []


def _mount(mounts: Iterable[str], fstype: str, controllers: str) -> tuple[str, str] | None:
    """(root inside the hierarchy, mount point) of the hierarchy's mount, from /proc/self/mountinfo."""
    for line in mounts:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if not after or after[0] != fstype:
            continue
        options = after[2].split(",") if len(after) > 2 else []
        if fstype == "cgroup2" or any(c in options for c in controllers.split(",") if c):
            return fields[3], fields[4]
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _read_stat(path: Path) -> dict[str, int]:
    out = {}
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
    except OSError:
        pass
    return out


# ---- the check --------------------------------------------------------------------------------


def local_stages(config: EngineConfig, stage: int) -> list[int]:
    """The stages that start on this node with `stage`, which is among them."""
    if config.ray is not None:  # each stage an actor, placed by Ray on its own
        return [stage]
    if config.cluster is not None:
        return config.cluster.local_stages
    return list(range(config.pp_size))


def sibling_rss(root: Path = Path("/")) -> int:
    """What the other stage processes of this process's parent hold now (their resident sets)."""
    parent, total = os.getppid(), 0
    for stat in (root / "proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            name = text[text.index("(") + 1 : text.rindex(")")]
            fields = text[text.rindex(")") + 2 :].split()
            pid = int(stat.parent.name)
            if pid != os.getpid() and int(fields[1]) == parent and name.startswith(_STAGE_NAME):
                total += _rss(stat.parent / "status")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not readable
    return total


def _rss(status: Path) -> int:
    for line in status.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def check_stage_memory(
    config: EngineConfig, stage: int, limit: MemoryLimit | None = None, siblings: int | None = None
) -> None:
    """Raise a one-line ConfigError unless the stages of this node starting with `stage` fit in
    what this process may use (`limit`, `siblings`' resident bytes: read now unless given)."""
    if config.device != "cpu":  # weights and KV in GPU memory: torch's own error there, not a kill
        return
    local = local_stages(config, stage)
    needs = sum((stage_needs(config, s) for s in local[1:]), stage_needs(config, local[0]))
    limit = limit or memory_limit()
    held = sibling_rss() if siblings is None and len(local) > 1 else siblings or 0
    baseline = _rss(Path("/proc/self/status")) if len(local) > 1 else 0
    has = limit.available + held - (len(local) - 1) * baseline
    if needs.total <= has:
        return
    ranges = [config.layer_ranges[s] for s in local]
    layers = f"layers {ranges[0].start}-{ranges[-1].stop - 1}"
    who = f"stage {stage} ({layers})" if len(local) == 1 else f"stages {local[0]}-{local[-1]} ({layers}) of this node"
    parts = f"weights {_size(needs.weights)}, KV cache {_size(needs.kv_cache)}, activations {_size(needs.activations)}"
    if needs.loading > needs.kv_cache + needs.activations:
        parts += f"; {_size(needs.loading)} more while loading"
    verb = "needs" if len(local) == 1 else "need"
    have = "has" if len(local) == 1 else "have"
    raise ConfigError(
        f"{who} {verb} {_size(needs.total)} ({parts}) but {have} {_size(max(0, has))} ({limit.source}); "
        "spread the model over more stages or nodes, or lower --kv-cache-gb or --max-batched-tokens"
    )


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB // 10 else f"{n / 2**20:.0f} MiB"
