"""Load a stage's tensors, and only those, from `model.safetensors`, a sharded index, or a prepared
GGUF checkpoint (engine/model/gguf_checkpoint.py)."""

from __future__ import annotations

import json
import re
import sys
import threading
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ppserve.engine.model.gguf_checkpoint import (
    gguf_kept_quantized,
    gguf_tensor_names,
    is_prepared_gguf,
    read_gguf_quantized,
    read_gguf_tensors,
)
from ppserve.engine.model.gguf_quant import BLOCKS, gguf_kernels_available
from ppserve.engine.model.model import StageModel
from ppserve.engine.model.model_config import MIXTRAL, ConfigError
from ppserve.engine.model.quantized import GGUF_KEPT

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TIED_SOURCE = "model.embed_tokens.weight"
LINEAR = re.compile(r"(_proj|^lm_head)\.weight$")  # the weights a quantized linear can take
QUANT_TAKERS = re.compile(r"(_proj|^lm_head|^model\.embed_tokens)\.weight$")  # ... and GGUFEmbedding


def checkpoint_files(model_dir: Path) -> dict[str, str]:
    """Tensor name -> file name, for the single file or the sharded index."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"{index} is not a valid index (no 'weight_map')") from None
        for shard in sorted(set(weight_map.values())):
            if not (model_dir / shard).is_file():
                raise ConfigError(f"shard {shard} listed in {INDEX_FILE} is missing from {model_dir}")
        return weight_map
    single = model_dir / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE)
    raise ConfigError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")


def kept_quantized(device: torch.device, dtype: torch.dtype) -> tuple[Collection[str], re.Pattern[str]]:
    """With `--quantization auto`: the GGML types a GGUF's tensors keep, and the parameters that
    take them. They run as their blocks where that kernel is built, embeddings too; else only the
    types QuantLinear takes, in linears (engine/model/linear.py decides which of the two runs them)."""
    if gguf_kernels_available(device, dtype):
        return BLOCKS, QUANT_TAKERS
    return GGUF_KEPT, LINEAR


def load_stage_weights(
    stage: StageModel, model_dir: str | Path, dtype: torch.dtype, device: torch.device, quantization: str = "none"
) -> None:
    """Fill `stage` (built on the meta device) with its tensors from the checkpoint.

    A missing tensor or one of the wrong shape is an error naming it. With tied embeddings the
    last stage reads `lm_head.weight` from the embedding (sharing the same tensor when the stage
    also embeds). With `quantization` "auto", a GGUF's linear weights of a type a quantized linear
    runs (engine/model/gguf_quant.py, quantized.py) are kept so, and where GGUF blocks run, the
    embedding too: each is set as its module's `quant` (the module's
    float weight is never loaded) for `StageModel.fuse` to take.
    """
    model_dir = Path(model_dir)
    gguf = is_prepared_gguf(model_dir)
    where = {} if gguf else checkpoint_files(model_dir)
    available = gguf_tensor_names(model_dir) if gguf else set(where)
    kept_types, takes_quant = kept_quantized(device, dtype)
    kept = gguf_kept_quantized(model_dir, kept_types) if gguf and quantization == "auto" else set()
    tied = stage.cfg.tie_word_embeddings
    wanted = {name: p for name, p in stage.named_parameters(remove_duplicate=False)}
    # source tensor name -> our parameter names that take it, as floats or kept quantized
    sources: dict[str, list[str]] = defaultdict(list)
    quantized: dict[str, list[str]] = defaultdict(list)
    arch = stage.cfg.architecture
    for name in wanted:
        src = name if gguf else checkpoint_name(name, arch)  # a prepared GGUF's table has our names
        src = TIED_SOURCE if name == "lm_head.weight" and tied and src not in available else src
        (quantized if src in kept and takes_quant.search(name) else sources)[src].append(name)
    missing = sorted(src for src in {*sources, *quantized} if src not in available)
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ConfigError(f"checkpoint {model_dir} is missing tensor(s): {shown}")
    for src, weight in read_gguf_quantized(model_dir, quantized) if quantized else ():
        for name in quantized[src]:
            _check_shape(src, weight.shape, name, wanted)
            setattr(stage.get_submodule(name.rpartition(".")[0]), "quant", weight)  # noqa: B010 (not a Module's field)
    # One tensor at a time, straight to the device: the host never holds a stage's weights twice.
    tensors = read_gguf_tensors(model_dir, sources, dtype) if gguf else _read_safetensors(model_dir, where, sources)
    for src, tensor in tensors:
        names = sources[src]
        for name in names:
            _check_shape(src, tensor.shape, name, wanted)
        loaded = torch.nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
        for name in names:
            module_name, _, attr = name.rpartition(".")
            setattr(stage.get_submodule(module_name), attr, loaded)


def checkpoint_name(name: str, arch: str) -> str:
    """The checkpoint's name of our parameter `name`: the same, but for Mixtral's experts (our
    `mlp.experts.E.gate_proj`, `up_proj`, `down_proj` and `mlp.gate` are its `block_sparse_moe.experts.E.w1`,
    `w3`, `w2` and `block_sparse_moe.gate`)."""
    if arch != MIXTRAL or ".mlp." not in name:
        return name
    name = name.replace(".mlp.", ".block_sparse_moe.")
    for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        name = name.replace(f".{ours}.", f".{theirs}.")
    return name


def _check_shape(src: str, shape: Sequence[int], name: str, wanted: dict[str, torch.nn.Parameter]) -> None:
    expected = tuple(wanted[name].shape)
    if tuple(shape) != expected:
        raise ConfigError(f"tensor {src} has shape {tuple(shape)}, expected {expected} for {name}")


def _read_safetensors(
    model_dir: Path, where: dict[str, str], names: Iterable[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[str, list[str]] = defaultdict(list)
    for name in names:
        by_file[where[name]].append(name)
    files = sorted(by_file)
    # tqdm's default lock is a multiprocessing semaphore, which a stage process would leak at
    # exit; a thread lock is all one process needs.
    tqdm.set_lock(threading.RLock())
    for file in tqdm(files, desc="loading shards", disable=len(files) < 2, file=sys.stderr):
        with safe_open(str(model_dir / file), framework="pt", device="cpu") as f:
            yield from ((name, f.get_tensor(name)) for name in by_file[file])
