"""GGUF checkpoints (llama.cpp's format), prepared once into a directory the engine reads like a
Hugging Face checkpoint, with each stage dequantizing only its own layers.

`prepare_gguf(path)` reads the file's metadata (never its weights) and writes, into
`<cache>/gguf/<stem>-<sha256 prefix>/`:
- config.json and generation_config.json, from the GGUF's keys;
- the tokenizer (tokenizer.json, tokenizer_config.json, the chat template), converted from the
  GGUF's vocabulary by transformers' GGUF tokenizer conversion;
- gguf.json: the source file and a table of its tensors under the engine's names (GGML type,
  shape, byte offset), so that a stage finds its tensors without parsing the file again.

A stage then calls `read_gguf_tensors`: it memory-maps the file, dequantizes the tensors of its own
layers with gguf-py into the engine's dtype, and caches them as one safetensors file per layer
under `<dtype>/`, so that later starts read them directly.

The file is input: its header is read by a bounded reader (gguf_header.py) and every value the
engine takes from it is checked (gguf_check.py) before anything else parses the file or allocates
from it. A bad file is one ConfigError naming the field and the problem.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ppserve.engine.model.cache_dir import cache_dir
from ppserve.engine.model.file_hash import file_fingerprint
from ppserve.engine.model.gguf_check import KEPT_ARRAYS, GGUFModel, check_model, engine_name, norm_shift
from ppserve.engine.model.gguf_header import GGUFHeader, read_header
from ppserve.engine.model.gguf_quant import BLOCKS, GGUFWeight, from_blocks
from ppserve.engine.model.model_config import ConfigError
from ppserve.engine.model.progress import Progress

INFO_FILE = "gguf.json"
PREPARED_VERSION = "v4"  # bump when what prepare_gguf or read_gguf_tensors writes changes
# general.file_type -> the checkpoint's dtype, which --dtype auto takes on GPUs (CPUs run float32).
_PLAIN_TYPES = ("F32", "F16", "BF16")  # read as they are: a plain conversion
# The tokenizer class AutoTokenizer picks for each family's model_type.
_TOKENIZER_CLASSES = {
    "llama": "TokenizersBackend",
    "qwen2": "Qwen2Tokenizer",
    "qwen3": "Qwen2Tokenizer",
    "qwen3moe": "Qwen2Tokenizer",
    "gemma3": "GemmaTokenizer",
}
_CHECKPOINT_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}  # the quantized types: bfloat16


def is_gguf_file(model: str | Path) -> bool:
    return str(model).endswith(".gguf") and Path(model).is_file()


def is_prepared_gguf(model_dir: str | Path) -> bool:
    return (Path(model_dir) / INFO_FILE).is_file()


def prepare_gguf(path: str | Path) -> Path:
    """The prepared directory of the GGUF file `path`, written on first use (see the module doc)."""
    path = Path(path).resolve()
    sha = file_fingerprint(path)  # not a hash of every byte: a node reads only its own tensors
    out = cache_dir() / "gguf" / f"{path.stem}-{sha[:16]}-{PREPARED_VERSION}"
    if (out / INFO_FILE).is_file():
        _point_at(out, path)  # the same file may have moved, or been copied, since
        return out
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


def gguf_fingerprint(model_dir: str | Path) -> str:
    """The prepared file's fingerprint (engine/model/file_hash.py's `file_fingerprint`)."""
    return str(_info(Path(model_dir))["fingerprint"])


def read_gguf_tensors(
    model_dir: str | Path, names: Iterable[str], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for the tensors `names` (engine names) in `dtype`, layer by layer: from the
    per-layer cache, else dequantized from the GGUF file (and cached, best effort: every tensor of
    each layer touched)."""
    model_dir = Path(model_dir)
    info = _info(model_dir)
    table: dict[str, list[Any]] = info["tensors"]
    arch = str(info["architecture"])
    wanted: dict[str, list[str]] = defaultdict(list)
    for name in names:
        wanted[_shard_of(name)].append(name)
    shard_dir = model_dir / str(dtype).removeprefix("torch.")
    source: np.memmap | None = None
    announced = False
    progress: Progress | None = None
    in_shards: dict[str, list[str]] = defaultdict(list)
    for name in table:
        in_shards[_shard_of(name)].append(name)

    def direct(shard: str) -> bool:
        """A layer whose linears run quantized: its plain tensors (norms) are read as they are."""
        plain = all(table[n][0] in _PLAIN_TYPES for n in wanted[shard])
        return plain and any(table[n][0] in BLOCKS for n in in_shards[shard])

    for shard, shard_names in sorted(wanted.items()):
        path = shard_dir / f"{shard}.safetensors"
        in_shard = in_shards[shard]
        if direct(shard):  # nothing cached
            source = source if source is not None else _map_source(info)
            yield from ((name, _dequantize(source, table[name], dtype, norm_shift(arch, name))) for name in shard_names)
            continue
        if path.is_file():
            with safe_open(str(path), framework="pt", device="cpu") as f:
                yield from ((name, f.get_tensor(name)) for name in shard_names)
            continue
        if not announced:
            # Only these become floats (the tensors a linear runs quantized are not among them):
            # say which, and how many, since on a first start this can take a while.
            todo = [s for s in wanted if not direct(s) and not (shard_dir / f"{s}.safetensors").is_file()]
            types = sorted({table[n][0] for s in todo for n in wanted[s]})
            count = sum(len(wanted[s]) for s in todo)
            print(
                f"ppserve: converting {count} tensor(s) ({', '.join(types)}) in {len(todo)} layer group(s) of "
                f"{Path(info['source']).name} to {str(dtype).removeprefix('torch.')}, once (cached in {shard_dir})",
                file=sys.stderr,
                flush=True,
            )
            announced = True
            progress = Progress(f"converting {Path(info['source']).name}", len(todo))
        source = source if source is not None else _map_source(info)
        tensors = {name: _dequantize(source, table[name], dtype, norm_shift(arch, name)) for name in in_shard}
        _save_shard(tensors, path)
        assert progress is not None
        progress.step(shard)
        if progress.done == progress.total:
            progress.close()
        yield from ((name, tensors[name]) for name in shard_names)


def gguf_kept_quantized(model_dir: str | Path, types: Collection[str]) -> set[str]:
    """The tensors whose GGML type is one of `types` (those a linear can run as they are)."""
    return {name for name, entry in _info(Path(model_dir))["tensors"].items() if entry[0] in types}


def read_gguf_quantized(model_dir: str | Path, names: Iterable[str]) -> Iterator[tuple[str, GGUFWeight]]:
    """(name, weight) for the tensors `names`, kept in their quantized type: views of the mapped
    file (copy-on-write, never written), so nothing is read until the weight is packed; q and k of a
    Llama are copies, their rows put back in transformers' order."""
    info = _info(Path(model_dir))
    source = _map_source(info, copy_on_write=True)
    for name in names:
        type_name, shape, offset, nbytes, heads = info["tensors"][name]
        weight = from_blocks(type_name, source[offset : offset + nbytes], shape)
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


def _write_prepared(path: Path, sha: str, out: Path) -> None:
    header = read_header(path, keep=KEPT_ARRAYS)  # bounded: every count and offset checked first
    model = check_model(header)
    # Only now, so that a bad file's error is the one line a user sees.
    print(f"ppserve: preparing {path.name} (once: config, tokenizer and tensor table)", file=sys.stderr, flush=True)
    progress = Progress(f"preparing {path.name}", 3)
    names = {t.name for t in header.tensors}
    config = _hf_config(model, names)
    generation = {"eos_token_id": sorted(set(model.eos_ids))}
    progress.step("config")
    table = _tensor_table(header, model)
    del header  # its copy of the vocabulary, while transformers reads its own
    progress.step("tensor table")
    _save_tokenizer(path, model.arch, out)  # the slow one: transformers converts the vocabulary
    progress.step("tokenizer")
    progress.close()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    info = {"fingerprint": sha, "architecture": model.arch, "tensors": table, **_source_stat(path)}
    (out / INFO_FILE).write_text(json.dumps(info))


def _hf_config(model: GGUFModel, tensor_names: set[str]) -> dict[str, Any]:
    """config.json for the GGUF's model, as transformers would write it."""
    config: dict[str, Any] = {
        "architectures": [model.architecture],
        # transformers' name of the family (llama.cpp's, but for its mixtures of experts)
        "model_type": {"qwen3moe": "qwen3_moe", "llama": "mixtral" if model.experts else "llama"}.get(
            model.arch, model.arch
        ),
        "hidden_size": model.hidden,
        "intermediate_size": model.ffn,
        "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "rms_norm_eps": model.rms_eps,
        "max_position_embeddings": model.context,
        "rope_theta": model.rope_base,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "dtype": _CHECKPOINT_DTYPES.get(model.file_type, "bfloat16"),
    }
    if model.arch == "gemma3":  # RoPE per layer type, the window, the activation, the query scale
        del config["rope_theta"]
        config.update(model.gemma3_config())
    elif model.rope_linear_factor is not None:
        config["rope_scaling"] = {"rope_type": "linear", "factor": model.rope_linear_factor}
    if model.experts:
        config.update(model.moe_config())
    config["vocab_size"] = model.vocab  # the embedding's rows, which the check matched to the tokens
    return config


def _tensor_table(header: GGUFHeader, model: GGUFModel) -> dict[str, list[Any]]:
    """engine name -> [GGML type name, shape (torch order), byte offset, byte count, heads to unpermute (0: none)]."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    checked: set[Any] = set()
    table: dict[str, list[Any]] = {}
    for t in header.tensors:
        name = engine_name(t.name, model.arch, model.experts > 0)
        assert name is not None  # check_model refused unknown tensors
        if t.type not in checked:  # one block of each type, to refuse what gguf-py cannot read
            nbytes = GGML_QUANT_SIZES[t.type][1]
            try:
                dequantize(np.zeros((1, nbytes), dtype=np.uint8), t.type)
            except NotImplementedError:
                raise ConfigError(f"{header.file}: tensor type {t.type.name} (of {t.name}) is not supported") from None
            checked.add(t.type)
        # llama.cpp's converter interleaves the two rotary halves of each q and k head for Llama
        # (its RoPE rotates adjacent pairs); Qwen models keep transformers' layout.
        heads = 0
        if model.arch == "llama" and ".attn_q." in t.name:
            heads = model.heads
        elif model.arch == "llama" and ".attn_k." in t.name:
            heads = model.kv_heads
        if "*" in name:  # [experts, out, in]: each expert's rows, whole blocks, one after the other
            each = t.nbytes // model.experts
            for e in range(model.experts):
                table[name.replace("*", str(e))] = [t.type.name, t.shape[1:], t.offset + e * each, each, 0]
            continue
        table[name] = [t.type.name, t.shape, t.offset, t.nbytes, heads]
    return table


def _save_tokenizer(path: Path, arch: str, out: Path) -> None:
    """The GGUF's vocabulary converted by transformers, into the class AutoTokenizer would pick for
    the family. Named directly: AutoTokenizer would first parse the whole file again with gguf-py's
    reader, which builds Python objects per array element, only to learn the family."""
    import transformers

    try:
        cls = getattr(transformers, _TOKENIZER_CLASSES[arch])
        tokenizer = cls.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        tokenizer.save_pretrained(str(out))
    except BaseException as e:  # transformers' conversion of a vocabulary the checks let through
        # tokenizers (Rust) reports input it cannot take as a panic, which pyo3 raises as a
        # BaseException so that `except Exception` does not swallow it; other BaseExceptions pass.
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
            raise
        detail = " ".join(str(e).split())[:200]
        raise ConfigError(f"{path.name}: cannot convert the GGUF's tokenizer: {detail}") from None


def _dequantize(source: np.memmap, entry: list[Any], dtype: torch.dtype, shift: float = 0.0) -> torch.Tensor:
    """A tensor of the table, in `dtype`, less `shift` (subtracted in float32, see gguf_check.norm_shift)."""
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
    if shift:
        values = values - shift
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
        # The fingerprint samples the file: layers dequantized from another file of the same
        # fingerprint (or this one before an edit) are made again rather than trusted.
        for shards in (p for p in out.iterdir() if p.is_dir()):
            shutil.rmtree(shards, ignore_errors=True)
        tmp = out / f".{INFO_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps({**info, **_source_stat(path)}))
        os.replace(tmp, out / INFO_FILE)


def _map_source(info: dict[str, Any], copy_on_write: bool = False) -> np.memmap:
    """The source file, memory-mapped, after checking it is the one that was prepared (`copy_on_write`:
    a private mapping, whose arrays torch takes as writable without copying them)."""
    path = Path(info["source"])
    try:
        same = {k: info[k] for k in ("source", "size", "mtime_ns")} == _source_stat(path)
    except OSError:
        same = False
    if not same:
        raise ConfigError(f"{path} changed or moved since it was prepared; start the engine again")
    return np.memmap(path, dtype=np.uint8, mode="c" if copy_on_write else "r")
