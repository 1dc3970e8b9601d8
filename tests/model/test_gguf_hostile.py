"""A model file is input: crafted GGUF files (and config.json checkpoints) are refused with one
ConfigError naming the field and the problem, before anything is allocated from them.

Each hostile file is a small valid one (tests/gguf_tiny.py, with gguf-py's GGUFWriter) with one
field made wrong, either in the writing or by patching bytes where gguf-py's reader locates them. The
cases follow an attack run's findings: counts that ask for terabytes, a tensor offset that wraps
around to the header, overlapping or misaligned data, impossible head counts and token ids,
malformed merges, a NaN epsilon, a tensor of a layer that does not exist.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf_tiny import TOKENS, Tiny, metadata, patch, read_u64, slots, tensors, write_tiny
from helpers import LLAMA_CONFIG

from ppserve.engine.config import EngineConfig
from ppserve.engine.model import gguf_check
from ppserve.engine.model.gguf_check import engine_name
from ppserve.engine.model.gguf_checkpoint import prepare_gguf, read_gguf_tensors
from ppserve.engine.model.model_config import ConfigError, ModelConfig


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPSERVE_CACHE_DIR", str(tmp_path / "cache"))


# --- the hostile cases: (how to make bad.gguf from a directory, what the error must say) ------


def _patched(slot: str, value: int | Callable[[Path, int], int], width: int = 8) -> Callable[[Path], Path]:
    def make(root: Path) -> Path:
        path = write_tiny(root / "bad.gguf")
        pos = slots(path)[slot]
        patch(path, pos, value(path, pos) if callable(value) else value, width)
        return path

    return make


def _written(**kwargs: Any) -> Callable[[Path], Path]:
    return lambda root: write_tiny(root / "bad.gguf", **kwargs)


def _vocab_of_ten(root: Path) -> Path:
    tokens = TOKENS[:10]
    return write_tiny(root / "bad.gguf", meta=metadata(Tiny(), tokens, merges=["Ġ t"]), drop=("tokenizer.ggml.merges",))


def _long_tokens(root: Path) -> Path:
    """A sentencepiece vocabulary without merges, of long tokens: deriving merges from it (as
    transformers does) would cost time and memory in the square of their lengths."""
    tokens = [*TOKENS, *("a" * k for k in range(2, 600))]
    spm = {"tokenizer.ggml.model": ("llama", V.STRING), "tokenizer.ggml.scores": ([0.0] * len(tokens), V.ARRAY)}
    meta = metadata(Tiny(), tokens) | spm
    weights = tensors(Tiny(), vocab=len(tokens))
    return write_tiny(root / "bad.gguf", meta=meta, drop=("tokenizer.ggml.merges",), weights=weights)


def _truncated_header(root: Path) -> Path:
    path = write_tiny(root / "bad.gguf")
    with path.open("r+b") as f:
        f.truncate(slots(path)["value:tokenizer.chat_template"] + 20)
    return path


A = "llama"
CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "array-of-2^40": (
        _patched("count:tokenizer.ggml.token_type", 1 << 40),
        "'tokenizer.ggml.token_type' declares an array of 1099511627776 int32 elements, but the",
    ),
    "strings-of-2^40": (_patched("count:tokenizer.ggml.tokens", 1 << 40), "1099511627776 string elements"),
    "kv-count-2^63": (_patched("kv_count", 1 << 63), "the header declares 9223372036854775808 metadata keys"),
    "tensor-count-2^32": (_patched("tensor_count", 1 << 32), "the header declares 4294967296 tensors"),
    "string-length-2^64-1": (
        _patched("length:general.architecture", -1),
        "metadata 'general.architecture' is 18446744073709551615 bytes long; at most",
    ),
    "chat-template-length": (
        _patched("length:tokenizer.chat_template", 1 << 40),
        "metadata 'tokenizer.chat_template' is 1099511627776 bytes long",
    ),
    "block_count-10^9": (_written(meta={f"{A}.block_count": (10**9, V.UINT32)}), f"'{A}.block_count' is 1000000000"),
    "block_count-beyond-tensors": (
        _written(meta={f"{A}.block_count": (40, V.UINT32)}),
        f"{A}.block_count is 40, but the file's 21 tensors make at most 2 layers",
    ),
    "head_count-0": (_written(meta={f"{A}.attention.head_count": (0, V.UINT32)}), "head_count' is 0"),
    "head_count_kv-0": (_written(meta={f"{A}.attention.head_count_kv": (0, V.UINT32)}), "head_count_kv' is 0"),
    "head_count_kv-3": (_written(meta={f"{A}.attention.head_count_kv": (3, V.UINT32)}), "not a multiple of"),
    "head_count-per-layer": (
        _written(meta={f"{A}.attention.head_count_kv": ([2, 2], V.ARRAY)}),
        "must be an integer, not an array of 2 int32",
    ),
    "key_length-odd": (
        _written(meta={f"{A}.attention.key_length": (7, V.UINT32), f"{A}.attention.value_length": (7, V.UINT32)}),
        "head size 7 must be even",
    ),
    "eos-2^32-1": (
        _written(meta={"tokenizer.ggml.eos_token_id": (2**32 - 1, V.UINT32)}),
        "'tokenizer.ggml.eos_token_id' is 4294967295; it must be in [0, 262]",
    ),
    "pad-id-past-vocab": (
        _written(meta={"tokenizer.ggml.padding_token_id": (263, V.UINT32)}),
        "'tokenizer.ggml.padding_token_id' is 263",
    ),
    "vocab-of-10": (_vocab_of_ten, "token_embd.weight has 263 rows, but tokenizer.ggml.tokens has 10 tokens"),
    "vocab_size-key": (_written(meta={f"{A}.vocab_size": (10**6, V.UINT32)}), f"{A}.vocab_size is 1000000"),
    "token_type-count": (
        _written(meta={"tokenizer.ggml.token_type": ([1] * 5, V.ARRAY)}),
        "'tokenizer.ggml.token_type' has 5 entries for 263 tokens",
    ),
    "merge-of-three": (
        _written(meta={"tokenizer.ggml.merges": (["Ġ t h"], V.ARRAY)}),
        "tokenizer.ggml.merges entry 0 ('Ġ t h') is not two tokens separated by one space",
    ),
    "merge-no-space": (_written(meta={"tokenizer.ggml.merges": (["Ġt"], V.ARRAY)}), "is not two tokens"),
    "merge-unknown-token": (
        _written(meta={"tokenizer.ggml.merges": (["Ġ zz"], V.ARRAY)}),
        "uses 'zz', which is not a token",
    ),
    "merge-result-unknown": (
        _written(meta={"tokenizer.ggml.merges": (["a b"], V.ARRAY)}),
        "uses 'ab', which is not a token",
    ),
    "long-tokens-without-merges": (_long_tokens, "has no merges and its tokens are too long to derive them"),
    "offset-wraps-to-header": (
        _patched("offset:token_embd.weight", -32),
        "tensor 'token_embd.weight' data at offset 18446744073709551584",
    ),
    "offset-overlaps": (
        _patched("offset:blk.0.attn_norm.weight", lambda p, pos: read_u64(p, slots(p)["offset:output.weight"])),
        "overlaps tensor",
    ),
    "offset-misaligned": (
        _patched("offset:blk.1.ffn_up.weight", lambda p, pos: read_u64(p, pos) + 4),
        "is not aligned to 32 bytes",
    ),
    "offset-past-end": (_patched("offset:output_norm.weight", 1 << 30), "lies past the end of the file"),
    "rms-eps-nan": (
        _written(meta={f"{A}.attention.layer_norm_rms_epsilon": (math.nan, V.FLOAT32)}),
        "layer_norm_rms_epsilon' is nan; it must be a finite number > 0",
    ),
    "rms-eps-negative": (_written(meta={f"{A}.attention.layer_norm_rms_epsilon": (-1e-5, V.FLOAT32)}), "> 0"),
    "rope-base-inf": (_written(meta={f"{A}.rope.freq_base": (math.inf, V.FLOAT32)}), "freq_base' is inf"),
    "layer-99999999999": (
        _written(weights={"blk.99999999999.attn_norm.weight": np.ones(32, np.float32)}),
        "tensor 'blk.99999999999.attn_norm.weight' is for layer 99999999999, but llama.block_count is 2",
    ),
    "tensor-shape": (
        _written(weights={"blk.1.attn_k.weight": np.zeros((32, 32), np.float32)}),
        "tensor 'blk.1.attn_k.weight' has shape [32, 32]; the metadata implies [16, 32]",
    ),
    "tensor-type-99": (_patched("type:blk.0.ffn_up.weight", 99, 4), "unknown GGML type 99"),
    "tensor-5-dims": (_patched("ndims:blk.0.ffn_up.weight", 5, 4), "has 5 dimensions"),
    "tensor-dim-0": (_patched("dim0:blk.0.ffn_up.weight", 0), "has an empty dimension"),
    "tensor-dim-2^63": (_patched("dim0:token_embd.weight", 1 << 63), "lies past the end of the file"),
    "alignment-24": (_written(meta={"general.alignment": (24, V.UINT32)}), "general.alignment 24 must be a power"),
    "alignment-type": (_written(meta={"general.alignment": (32, V.UINT64)}), "general.alignment must be a uint32"),
    "version-1": (_patched("version", 1, 4), "GGUF version 1 is not supported"),
    "big-endian": (_patched("version", 3 << 24, 4), "big-endian"),
    "truncated-header": (_truncated_header, "runs past the end of the file"),
    "value-type-42": (
        _patched(f"type:{A}.block_count", 42, 4),
        f"metadata '{A}.block_count' has unknown value type 42",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_file_is_one_config_error(tmp_path: Path, case: str) -> None:
    make, message = CASES[case]
    path = make(tmp_path)
    with pytest.raises(ConfigError) as e:
        EngineConfig.create(path)
    text = str(e.value)
    assert text.startswith("bad.gguf"), text  # names the file
    assert message in text
    assert "\n" not in text and len(text) < 400, text  # one line, quoting little of the input
    assert not list((tmp_path / "cache" / "gguf").glob("bad-*")), "nothing half-prepared is left"


def test_a_vocabulary_that_would_derive_too_many_merges_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without merges, transformers derives one per token and split point whose halves are tokens:
    their number is counted (and bounded) first. A small bound here, for a small file."""
    monkeypatch.setattr(gguf_check, "MAX_DERIVED_MERGES", 100)
    # Every string over "abc" of two to four letters: each split of each is two tokens.
    tokens = [*TOKENS, *("".join(t) for k in (2, 3, 4) for t in itertools.product("abc", repeat=k))]
    spm = {"tokenizer.ggml.model": ("llama", V.STRING), "tokenizer.ggml.scores": ([0.0] * len(tokens), V.ARRAY)}
    meta = metadata(Tiny(), tokens) | spm
    weights = tensors(Tiny(), vocab=len(tokens))
    path = write_tiny(tmp_path / "bad.gguf", meta=meta, drop=("tokenizer.ggml.merges",), weights=weights)
    with pytest.raises(ConfigError, match="has no merges and would derive more than 100 of them"):
        EngineConfig.create(path)


def test_a_panic_in_the_tokenizer_conversion_is_one_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tokenizers reports some input it cannot take as a Rust panic (pyo3's PanicException, a
    BaseException); one the checks did not foresee is still the one-line error."""
    import transformers

    class PanicException(BaseException):  # pyo3's own cannot be imported
        pass

    def panic(*args: object, **kwargs: object) -> None:
        raise PanicException("range end index 2 out of range\nfor slice of length 1")

    monkeypatch.setattr(transformers.TokenizersBackend, "from_pretrained", panic)
    with pytest.raises(ConfigError, match="cannot convert the GGUF's tokenizer: range end index 2 out of range for"):
        EngineConfig.create(write_tiny(tmp_path / "ok.gguf"))

    def interrupt(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.TokenizersBackend, "from_pretrained", interrupt)
    with pytest.raises(KeyboardInterrupt):
        EngineConfig.create(write_tiny(tmp_path / "ok.gguf"))


def sparse_vocabulary(root: Path, tokens: int = 10_000_000, size: int = 222 << 20) -> Path:
    """A file of `size` bytes (sparse: zeros cost no disk) whose vocabulary declares `tokens`
    strings: empty ones, eight zero bytes each, so every count fits in the file."""
    path = write_tiny(root / "bad.gguf")
    patch(path, slots(path)["count:tokenizer.ggml.tokens"], tokens)
    with path.open("r+b") as f:
        f.truncate(size)
    return path


def test_a_ten_million_token_vocabulary_is_refused_before_it_is_read(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"declares an array of 10000000 string elements; at most \d+ are supported"):
        EngineConfig.create(sparse_vocabulary(tmp_path))


CHILD = """
import json, resource, sys, time
from pathlib import Path
from ppserve.engine.config import EngineConfig
from ppserve.engine.model.model_config import ConfigError
EngineConfig.create(sys.argv[1])  # a valid file first: what the imports and one load cost
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = []
for path in sys.argv[2:]:
    t = time.monotonic()
    try:
        EngineConfig.create(path)
        error = None
    except ConfigError as e:
        error = str(e)
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    out.append({"path": path, "error": error, "kib": growth, "s": time.monotonic() - t})
print(json.dumps(out))
"""


def test_hostile_files_allocate_little(tmp_path: Path) -> None:
    """In a fresh process, every hostile file (and the sparse 222 MB one) is refused while the
    process's peak memory grows by well under 1 GB over a valid file's load."""
    valid = write_tiny(tmp_path / "valid.gguf")
    paths = []
    for case, (make, _) in CASES.items():
        (tmp_path / case).mkdir()
        paths.append(str(make(tmp_path / case)))
    (tmp_path / "sparse").mkdir()
    paths.append(str(sparse_vocabulary(tmp_path / "sparse")))
    env = {**os.environ, "PPSERVE_CACHE_DIR": str(tmp_path / "cache")}
    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(valid), *paths], capture_output=True, text=True, timeout=600, env=env
    )
    assert res.returncode == 0, res.stderr
    results = json.loads(res.stdout.splitlines()[-1])
    assert [r["path"] for r in results if r["error"] is None] == []
    worst = max(results, key=lambda r: r["kib"])
    assert worst["kib"] < 1 << 20, worst  # ru_maxrss is in KiB on Linux


def test_the_cli_refuses_a_hostile_file_in_one_line(tmp_path: Path) -> None:
    path = CASES["offset-wraps-to-header"][0](tmp_path)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ppserve.server.cli",
            "serve",
            "--model",
            str(path),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PPSERVE_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines == [lines[-1]] and "Traceback" not in res.stderr, res.stderr
    assert "bad.gguf: tensor 'token_embd.weight' data at offset 18446744073709551584" in lines[0]


# --- valid files load exactly as before -------------------------------------------------------


@pytest.mark.parametrize(
    "spec", [Tiny(), Tiny(arch="qwen3", qtype=Q.Q8_0), Tiny(qtype=Q.F16, heads=2, kv_heads=1)], ids=["f32", "q8", "f16"]
)
def test_valid_files_load_as_gguf_py_reads_them(tmp_path: Path, spec: Tiny) -> None:
    """The checked reader's tensor table is gguf-py's (type, shape, offset, size), the config is
    the metadata's, and every tensor reads back as gguf-py dequantizes it."""
    path = write_tiny(tmp_path / "ok.gguf", spec)
    prepared = prepare_gguf(path)
    info = json.loads((prepared / "gguf.json").read_text())
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    assert len(info["tensors"]) == len(by_name)
    config = ModelConfig.from_dir(prepared)
    head_dim = spec.hidden // spec.heads
    assert (config.num_layers, config.hidden_size, config.num_heads, config.head_dim) == (
        spec.layers,
        spec.hidden,
        spec.heads,
        head_dim,
    )
    assert (config.vocab_size, config.eos_token_ids, config.rms_norm_eps) == (
        len(TOKENS),
        (2,),
        float(np.float32(1e-5)),
    )
    names = {}
    for t in reader.tensors:
        engine = engine_name(t.name)
        assert engine is not None
        kind, shape, offset, nbytes, _ = info["tensors"][engine]
        as_read = (t.tensor_type.name, list(reversed(t.shape.tolist())), t.data_offset, t.n_bytes)
        assert (kind, shape, offset, nbytes) == as_read
        names[engine] = t
    for name, tensor in read_gguf_tensors(prepared, names, torch.float32):
        t = names[name]
        expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tensor.shape)
        if spec.arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            continue  # un-permuted rows; test_gguf.py checks those against the checkpoint
        assert torch.equal(tensor, torch.from_numpy(np.array(expected, np.float32))), name


# --- config.json checkpoints -------------------------------------------------------------------

DIMENSIONS = [
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "num_hidden_layers",
    "vocab_size",
    "max_position_embeddings",
]


@pytest.mark.parametrize("value", [math.nan, 0, -4, 2.0, True, "64", 10**30], ids=lambda v: repr(v)[:10])
@pytest.mark.parametrize("key", DIMENSIONS)
def test_config_json_dimensions_must_be_positive_integers(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"config.json: {key} must be a positive integer"):
        ModelConfig.from_dict({**LLAMA_CONFIG, key: value})


@pytest.mark.parametrize(
    "value", [math.nan, math.inf, -math.inf, 0, -1e-6, "1e-6", 10**400], ids=lambda v: repr(v)[:10]
)
@pytest.mark.parametrize("key", ["rms_norm_eps", "rope_theta"])
def test_config_json_epsilon_and_rope_base_must_be_finite_and_positive(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"config.json: {key} must be a finite number > 0"):
        ModelConfig.from_dict({**LLAMA_CONFIG, key: value})
    if key == "rope_theta":  # transformers 5 writes it inside rope_parameters
        with pytest.raises(ConfigError, match=f"{key} must be a finite number > 0"):
            ModelConfig.from_dict({**LLAMA_CONFIG, "rope_parameters": {"rope_type": "default", key: value}})


def test_config_json_from_disk_with_nan(tmp_path: Path) -> None:
    """JSON parsers read NaN and Infinity; the checks see them as the floats they are."""
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "rms_norm_eps": math.nan}))
    assert "NaN" in (tmp_path / "config.json").read_text()
    with pytest.raises(ConfigError, match="rms_norm_eps must be a finite number > 0, got nan"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("eos", [-1, "2", [2, -5], 1.5, True])
def test_config_json_eos_must_be_a_token(eos: object) -> None:
    with pytest.raises(ConfigError, match=r"eos_token_id .* is not a token id"):
        ModelConfig.from_dict(LLAMA_CONFIG, {"eos_token_id": eos})


def test_config_json_eos_past_the_vocabulary_is_dropped() -> None:
    """It can never be sampled, so it ends nothing (Llama 3 writes lists of ids)."""
    assert ModelConfig.from_dict(LLAMA_CONFIG, {"eos_token_id": [2, 10**6]}).eos_token_ids == (2,)
    assert ModelConfig.from_dict(LLAMA_CONFIG, {"eos_token_id": 512}).eos_token_ids == ()


def test_config_json_still_takes_what_it_took() -> None:
    """Absent or null keys take their defaults, as before."""
    cfg = ModelConfig.from_dict({**LLAMA_CONFIG, "num_key_value_heads": None, "head_dim": None, "rope_theta": 5e5})
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope.theta, cfg.rms_norm_eps) == (4, 16, 5e5, 1e-6)
    assert cfg.max_position_embeddings == 4096 and cfg.eos_token_ids == ()
    assert ModelConfig.from_dict(LLAMA_CONFIG, {"eos_token_id": [0, 511]}).eos_token_ids == (0, 511)
