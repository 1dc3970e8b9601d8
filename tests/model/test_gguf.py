"""GGUF checkpoints: tiny models written with gguf-py's GGUFWriter, read back through the engine."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import gguf_name, llama_permute, write_gguf
from helpers import pipeline, prompt_logits, random_prompt

from ppserve.engine.config import EngineConfig
from ppserve.engine.model.gguf_checkpoint import prepare_gguf, read_gguf_tensors
from ppserve.engine.model.model_config import ConfigError
from ppserve.engine.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint
from ppserve.engine.model.tokenizer import Tokenizer

SPECS = {
    "llama": TinySpec(arch="llama", seed=11, tie_word_embeddings=True),  # q/k permuted by llama.cpp
    "qwen2": TinySpec(arch="qwen2", seed=12),  # q/k/v bias
    "qwen3": TinySpec(arch="qwen3", seed=13, head_dim=24),  # q/k norm, head_dim != hidden / heads
}
# Every matrix's rows a whole number of 256-value blocks, for the K types.
WIDE = TinySpec(arch="llama", seed=14, hidden_size=256, intermediate_size=512, num_layers=2)
TYPES = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPSERVE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    specs = {**SPECS, "wide": WIDE}
    return {name: make_tiny_checkpoint(root / name, spec) for name, spec in specs.items()}


@pytest.mark.parametrize("arch", list(SPECS))
def test_f32_gguf_gives_the_checkpoints_logits(
    hf_dirs: dict[str, Path], tmp_path: Path, arch: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same weights through GGUF (names, permutation, config, tied head) and through
    safetensors give bit-identical logits, split in two stages, and the same tokens for text. The
    first start says what it converts, and where it keeps it."""
    path = write_gguf(hf_dirs[arch], tmp_path / f"{arch}.gguf")
    prompt = random_prompt(random.Random(arch), 30)
    expected = prompt_logits(pipeline(hf_dirs[arch], pp_size=2), prompt)
    capsys.readouterr()
    assert torch.equal(prompt_logits(pipeline(path, pp_size=2), prompt), expected)
    said = capsys.readouterr().err
    assert re.search(r"converting \d+ tensor\(s\) \(F32\) in \d+ layer group\(s\) of .* to float32, once", said), said
    # Each slow step is a line where stderr is not a terminal (a log): no start sits silent.
    assert f"preparing {path.name}: tokenizer (3/3)" in said and f"preparing {path.name}: done in" in said
    assert (
        re.search(rf"converting {path.name}: layer-0 \(\d+/\d+\)", said) and f"converting {path.name}: done in" in said
    )
    prepared = Path(EngineConfig.create(path).model)
    shards = sorted(p.name for p in (prepared / "float32").iterdir())
    assert shards == sorted(["embed.safetensors", "head.safetensors", *(f"layer-{i}.safetensors" for i in range(4))])
    # A second start reads the cached shards: the GGUF file itself could be gone.
    path.unlink()
    assert torch.equal(prompt_logits(pipeline(prepared, pp_size=2), prompt), expected)
    text = "The pipeline streams café and 東京 🙂 at every stage."
    assert Tokenizer(prepared).encode(text) == Tokenizer(hf_dirs[arch]).encode(text)


def _expected(reader_tensor: gguf.ReaderTensor, heads: int) -> np.ndarray:
    """gguf-py's own dequantization of the tensor, with llama.cpp's row permutation undone by
    indexing (independently of the engine's reshape)."""
    values = gguf.quants.dequantize(reader_tensor.data, reader_tensor.tensor_type).astype(np.float32)
    shape = [int(d) for d in reversed(reader_tensor.shape.tolist())]
    values = values.reshape(shape)
    if heads:
        rows = llama_permute(np.arange(shape[0]), heads)  # GGUF row i holds original row rows[i]
        out = np.empty_like(values)
        out[rows] = values
        values = out
    return values


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_dequantization_equals_gguf_py(hf_dirs: dict[str, Path], tmp_path: Path, qtype: Q) -> None:
    path = write_gguf(hf_dirs["wide"], tmp_path / "wide.gguf", qtype)
    prepared = prepare_gguf(path)
    reader = gguf.GGUFReader(path)
    assert {t.tensor_type for t in reader.tensors} == {qtype, Q.F32}
    names = {gguf_name(n): n for n in _engine_names(WIDE)}
    for dtype in (torch.float32, torch.bfloat16):
        ours = dict(read_gguf_tensors(prepared, names.values(), dtype))
        for t in reader.tensors:
            heads = {"attn_q": WIDE.num_heads, "attn_k": WIDE.num_kv_heads}.get(t.name.split(".")[-2], 0)
            expected = torch.from_numpy(_expected(t, heads)).to(dtype)
            assert torch.equal(ours[names[t.name]], expected), (t.name, qtype.name, dtype)
    # And the model runs on them.
    logits = prompt_logits(pipeline(path), random_prompt(random.Random(0), 8))
    assert torch.isfinite(logits).all()


def _engine_names(spec: TinySpec) -> list[str]:
    per_layer = ["input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    per_layer += [f"self_attn.{p}_proj" for p in "qkvo"]
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    return names + [f"model.layers.{i}.{m}.weight" for i in range(spec.num_layers) for m in per_layer]


def _truncate(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size * 2 // 3)


def _bad_magic(path: Path) -> None:
    with path.open("r+b") as f:
        f.write(b"GGML")


@pytest.mark.parametrize(
    ("kwargs", "damage", "message"),
    [
        ({"arch": "gemma"}, None, "unsupported GGUF architecture 'gemma'; supported: llama, qwen2, qwen3"),
        ({"qtype": Q.F64}, None, "tensor type F64 (of output.weight) is not supported"),
        ({"tokenizer": False}, None, "the GGUF has no tokenizer"),
        (
            {"extra_tensors": {"rope_freqs.weight": np.ones(4, np.float32)}},
            None,
            "'rope_freqs.weight' is not supported",
        ),
        ({}, _truncate, "truncated"),
        ({}, _bad_magic, "is not a readable GGUF file"),
    ],
    ids=["architecture", "tensor-type", "no-tokenizer", "unknown-tensor", "truncated", "corrupt"],
)
def test_bad_files_are_refused_naming_the_problem(
    hf_dirs: dict[str, Path], tmp_path: Path, kwargs: dict[str, object], damage: object, message: str
) -> None:
    path = write_gguf(hf_dirs["qwen2"], tmp_path / "bad.gguf", **kwargs)  # type: ignore[arg-type]
    if callable(damage):
        damage(path)
    with pytest.raises(ConfigError, match=r"bad\.gguf") as e:
        EngineConfig.create(path)
    assert message in str(e.value)
    assert not list((tmp_path / "cache" / "gguf").glob("bad-*")), "nothing half-prepared is left"


def test_a_changed_file_is_not_read(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = write_gguf(hf_dirs["qwen2"], tmp_path / "m.gguf")
    prepared = prepare_gguf(path)
    os.utime(path, ns=(0, 0))
    with pytest.raises(ConfigError, match="changed or moved since it was prepared"):
        dict(read_gguf_tensors(prepared, ["model.norm.weight"], torch.float32))


def test_cli_refuses_a_bad_gguf_in_one_line(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = write_gguf(hf_dirs["llama"], tmp_path / "gemma.gguf", arch="gemma")
    res = subprocess.run(
        [sys.executable, "-m", "ppserve.server.cli", "generate", "--model", str(path), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PPSERVE_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert res.returncode == 2, res.stderr
    assert "unsupported GGUF architecture 'gemma'" in res.stderr and "Traceback" not in res.stderr
