"""GGUF checkpoints (llama.cpp's format), prepared once into a directory the engine reads like a
Hugging Face checkpoint, with each stage dequantizing only its own layers.

`prepare_gguf(path)` reads the file's metadata (never its weights) with gguf-py and writes, into
`<cache>/gguf/<stem>-<sha256 prefix>/`:
- config.json and generation_config.json, from the GGUF's keys;
- the tokenizer (tokenizer.json, tokenizer_config.json, the chat template), converted from the
  GGUF's vocabulary by transformers' GGUF tokenizer conversion;
- gguf.json: the source file and a table of its tensors under the engine's names (GGML type,
  shape, byte offset), so that a stage finds its tensors without parsing the file again.

A stage then calls `read_gguf_tensors`: it memory-maps the file, dequantizes the tensors of its own
layers with gguf-py into the engine's dtype, and caches them as one safetensors file per layer
under `<dtype>/`, so that later starts read them directly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ppserve.engine.model.cache_dir import cache_dir
from ppserve.engine.model.file_hash import file_sha256
from ppserve.engine.model.model_config import ConfigError
from ppserve.engine.model.quantized import GGUF_KEPT, QuantWeight, from_gguf_blocks

INFO_FILE = "gguf.json"
PREPARED_VERSION = "v1"  # bump when what prepare_gguf or read_gguf_tensors writes changes
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# general.file_type -> the checkpoint's dtype, which --dtype auto takes on GPUs (CPUs run float32).
_PLAIN_TYPES = ("F32", "F16", "BF16")  # read as they are: a plain conversion
_CHECKPOINT_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}  # the quantized types: bfloat16


def is_gguf_file(model: str | Path) -> bool:
    return str(model).endswith(".gguf") and Path(model).is_file()


def is_prepared_gguf(model_dir: str | Path) -> bool:
    return (Path(model_dir) / INFO_FILE).is_file()


def prepare_gguf(path: str | Path) -> Path:
    """The prepared directory of the GGUF file `path`, written on first use (see the module doc)."""
    path = Path(path).resolve()
    sha = file_sha256(path)
    out = cache_dir() / "gguf" / f"{path.stem}-{sha[:16]}-{PREPARED_VERSION}"
    if (out / INFO_FILE).is_file():
        _point_at(out, path)  # the same bytes may have moved since
        return out
    print(f"ppserve: preparing {path.name} (once: config, tokenizer and tensor table)", file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _write_prepared(path, sha, tmp)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / INFO_FILE).is_file():  # lost a race to another process: use theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_tensor_names(model_dir: str | Path) -> set[str]:
    return set(_info(Path(model_dir))["tensors"])


def gguf_sha256(model_dir: str | Path) -> str:
    return str(_info(Path(model_dir))["sha256"])


def read_gguf_tensors(
    model_dir: str | Path, names: Iterable[str], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for the tensors `names` (engine names) in `dtype`, layer by layer: from the
    per-layer cache, else dequantized from the GGUF file (and cached, best effort: every tensor of
    each layer touched)."""
    model_dir = Path(model_dir)
    info = _info(model_dir)
    table: dict[str, list[Any]] = info["tensors"]
    wanted: dict[str, list[str]] = defaultdict(list)
    for name in names:
        wanted[_shard_of(name)].append(name)
    shard_dir = model_dir / str(dtype).removeprefix("torch.")
    source: np.memmap | None = None
    announced = False
    for shard, shard_names in sorted(wanted.items()):
        path = shard_dir / f"{shard}.safetensors"
        in_shard = [name for name in table if _shard_of(name) == shard]
        if all(table[n][0] in _PLAIN_TYPES for n in shard_names) and any(table[n][0] in GGUF_KEPT for n in in_shard):
            # A layer whose linears run quantized: its norms are read as they are, nothing cached.
            source = source if source is not None else _map_source(info)
            yield from ((name, _dequantize(source, table[name], dtype)) for name in shard_names)
            continue
        if path.is_file():
            with safe_open(str(path), framework="pt", device="cpu") as f:
                yield from ((name, f.get_tensor(name)) for name in shard_names)
            continue
        if not announced:
            todo = sum(not (shard_dir / f"{shard}.safetensors").is_file() for shard in wanted)
            print(
                f"ppserve: dequantizing {todo} layer group(s) of {Path(info['source']).name} to {dtype} (once)",
                file=sys.stderr,
                flush=True,
            )
            announced = True
        source = source if source is not None else _map_source(info)
        tensors = {name: _dequantize(source, table[name], dtype) for name in in_shard}
        _save_shard(tensors, path)
        yield from ((name, tensors[name]) for name in shard_names)


def gguf_kept_quantized(model_dir: str | Path) -> set[str]:
    """The tensors whose GGML type a linear can run as it is (engine/model/quantized.py)."""
    return {name for name, entry in _info(Path(model_dir))["tensors"].items() if entry[0] in GGUF_KEPT}


def read_gguf_quantized(model_dir: str | Path, names: Iterable[str]) -> Iterator[tuple[str, QuantWeight]]:
    """(name, weight) for the tensors `names`, kept in their quantized type (no cache: reading the
    blocks is a reshuffle of bytes)."""
    info = _info(Path(model_dir))
    source = _map_source(info)
    for name in names:
        type_name, shape, offset, nbytes, heads = info["tensors"][name]
        weight = from_gguf_blocks(type_name, source[offset : offset + nbytes], shape)
        if heads:
            weight = weight.rows(_unpermute(torch.arange(shape[0]), heads))
        yield name, weight


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Whole or absent, even with two stages converting the same shard; a cache that cannot be
    written (a full disk) only costs the next start the conversion again."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(exist_ok=True)
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
    except OSError as e:
        print(f"ppserve: warning: cannot cache {path.name} in {path.parent}: {e}", file=sys.stderr, flush=True)
    finally:
        tmp.unlink(missing_ok=True)


def _shard_of(name: str) -> str:
    """Cached per layer, so a stage reads only its own: layer-<i>, embed (stage 0), head (last stage)."""
    if name.startswith("model.layers."):
        return "layer-" + name.split(".")[2]
    return "embed" if name == "model.embed_tokens.weight" else "head"


def _engine_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m and m[2] in _LAYER_NAMES:
        return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"
    return None


def _write_prepared(path: Path, sha: str, out: Path) -> None:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf-py raises ValueError, IndexError, ... on a damaged file
        raise ConfigError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e}") from None
    fields = {name: field for name, field in reader.fields.items()}

    def get(key: str, default: Any = None) -> Any:
        if key in fields:
            return fields[key].contents()
        if default is None:
            raise ConfigError(f"{path.name}: GGUF metadata key {key!r} is missing")
        return default

    arch = get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{path.name}: unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    if "tokenizer.ggml.model" not in fields or "tokenizer.ggml.tokens" not in fields:
        raise ConfigError(f"{path.name}: the GGUF has no tokenizer (tokenizer.ggml.model and tokens)")
    if int(get("split.count", 1)) > 1:
        raise ConfigError(
            f"{path.name} is one part of a split GGUF; merge the parts first (llama.cpp's gguf-split --merge)"
        )
    names = {t.name for t in reader.tensors}
    try:
        config = _hf_config(get, arch, names, path.name)
    except (TypeError, ValueError) as e:  # a key of the wrong type, e.g. a per-layer array
        raise ConfigError(f"{path.name}: GGUF metadata not understood: {e}") from None
    kinds = [k for k in _LAYER_NAMES if arch == "qwen3" or k not in ("attn_q_norm", "attn_k_norm")]
    layers = range(config["num_hidden_layers"])
    required = ["token_embd.weight", "output_norm.weight", *(f"blk.{i}.{k}.weight" for i in layers for k in kinds)]
    if missing := [n for n in required if n not in names]:
        raise ConfigError(f"{path.name} is missing tensor(s): {', '.join(missing[:5])}")
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    config["vocab_size"] = int(embedding.shape[-1])  # rows of the embedding (GGUF lists them last)
    eos = [get("tokenizer.ggml.eos_token_id", -1), get("tokenizer.ggml.eot_token_id", -1)]
    generation = {"eos_token_id": sorted({int(t) for t in eos if t >= 0})}
    table = _tensor_table(reader, path, arch, config)
    size = path.stat().st_size
    for name, (_, _, offset, nbytes, _) in table.items():
        if offset + nbytes > size:
            raise ConfigError(f"{path.name} is truncated: tensor {name} ends past the end of the file")
    _save_tokenizer(path, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    info = {"sha256": sha, "architecture": arch, "tensors": table, **_source_stat(path)}
    (out / INFO_FILE).write_text(json.dumps(info))


def _hf_config(get: Any, arch: str, tensor_names: set[str], file: str) -> dict[str, Any]:
    """config.json for the GGUF's model, as transformers would write it."""
    heads = int(get(f"{arch}.attention.head_count"))
    hidden = int(get(f"{arch}.embedding_length"))
    head_dim = int(get(f"{arch}.attention.key_length", hidden // heads))
    if int(get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise ConfigError(f"{file}: attention key and value lengths differ; not supported")
    if int(get(f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise ConfigError(f"{file}: partial rotary embeddings ({arch}.rope.dimension_count) are not supported")
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,  # transformers' name of the family (the same three names)
        "hidden_size": hidden,
        "intermediate_size": int(get(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(get(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get(f"{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get(f"{arch}.context_length")),
        "rope_theta": float(get(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "dtype": _CHECKPOINT_DTYPES.get(int(get("general.file_type", 0)), "bfloat16"),
    }
    scaling = get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(get(f"{arch}.rope.scaling.factor"))}
    elif scaling != "none":
        raise ConfigError(f"{file}: rope scaling {scaling!r} is not supported (only linear)")
    return config


def _tensor_table(reader: Any, path: Path, arch: str, config: dict[str, Any]) -> dict[str, list[Any]]:
    """engine name -> [GGML type name, shape (torch order), byte offset, byte count, heads to unpermute (0: none)]."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    checked: set[Any] = set()
    table: dict[str, list[Any]] = {}
    for t in reader.tensors:
        name = _engine_name(t.name)
        if name is None:
            raise ConfigError(f"{path.name}: tensor {t.name!r} is not supported (unknown to the {arch} model)")
        if t.tensor_type not in checked:  # one block of each type, to refuse what gguf-py cannot read
            nbytes = GGML_QUANT_SIZES[t.tensor_type][1]
            try:
                dequantize(np.zeros((1, nbytes), dtype=np.uint8), t.tensor_type)
            except NotImplementedError:
                kind = t.tensor_type.name
                raise ConfigError(f"{path.name}: tensor type {kind} (of {t.name}) is not supported") from None
            checked.add(t.tensor_type)
        # llama.cpp's converter interleaves the two rotary halves of each q and k head for Llama
        # (its RoPE rotates adjacent pairs); Qwen models keep transformers' layout.
        heads = 0
        if arch == "llama" and ".attn_q." in t.name:
            heads = config["num_attention_heads"]
        elif arch == "llama" and ".attn_k." in t.name:
            heads = config["num_key_value_heads"]
        shape = [int(d) for d in reversed(t.shape.tolist())]  # GGUF lists the fastest dimension first
        table[name] = [t.tensor_type.name, shape, int(t.data_offset), int(t.n_bytes), heads]
    return table


def _save_tokenizer(path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ConfigError(f"{path.name}: cannot convert the GGUF's tokenizer: {e}") from None
    tokenizer.save_pretrained(str(out))


def _dequantize(source: np.memmap, entry: list[Any], dtype: torch.dtype) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quant_shape_to_byte_shape

    type_name, shape, offset, nbytes, heads = entry
    qtype = GGMLQuantizationType[type_name]
    raw = source[offset : offset + nbytes].reshape(quant_shape_to_byte_shape(shape, qtype))
    array = np.asarray(dequantize(raw, qtype), dtype=np.float32)
    if not array.flags.writeable:  # F32 comes back as a view of the read-only map
        array = array.copy()
    values = torch.from_numpy(array).reshape(shape)
    if heads:
        values = _unpermute(values, heads)
    return values.to(dtype).contiguous()


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: within each head, rows (2j, 2j+1) go back to (j, d/2 + j).
    w: [heads * head_dim, ...] (a weight or a bias)."""
    rest = w.shape[1:]
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def _info(model_dir: Path) -> dict[str, Any]:
    try:
        info: dict[str, Any] = json.loads((model_dir / INFO_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{model_dir} is not a prepared GGUF checkpoint: {e}") from None
    return info


def _source_stat(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"source": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _point_at(out: Path, path: Path) -> None:
    info = _info(out)
    if {k: info.get(k) for k in ("source", "size", "mtime_ns")} != _source_stat(path):
        tmp = out / f".{INFO_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps({**info, **_source_stat(path)}))
        os.replace(tmp, out / INFO_FILE)


def _map_source(info: dict[str, Any]) -> np.memmap:
    """The source file, memory-mapped, after checking it is the one that was prepared."""
    path = Path(info["source"])
    try:
        same = {k: info[k] for k in ("source", "size", "mtime_ns")} == _source_stat(path)
    except OSError:
        same = False
    if not same:
        raise ConfigError(f"{path} changed or moved since it was prepared; start the engine again")
    return np.memmap(path, dtype=np.uint8, mode="r")
