"""The decode step in one call (engine/model/decode_step.py) against the layers run as modules:
bitwise the same hidden states, logits and KV cache, on every stage of a split model."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import write_gguf
from helpers import random_prompt
from test_gemma3 import SPECS as GEMMA3

from ppserve.engine.config import EngineConfig
from ppserve.engine.model import cpu_kernels, linear
from ppserve.engine.model.moe import MoE
from ppserve.engine.model.tiny_checkpoint import make_tiny_checkpoint
from ppserve.engine.runtime.stage_runner import StageRunner
from ppserve.transport.messages import SeqChunk

pytestmark = pytest.mark.skipif(
    cpu_kernels.decode_layers(torch.float32) is None, reason="the CPU kernels are not built here"
)

BLOCK = 4


def _runners(model: Path, **kwargs: object) -> list[StageRunner]:
    config = EngineConfig.create(model, pp_size=2, num_kv_blocks=128, block_size=BLOCK, **kwargs)  # type: ignore[arg-type]
    return [StageRunner(config, stage) for stage in range(2)]


def _forward(runners: list[StageRunner], chunks: list[SeqChunk]) -> list[torch.Tensor]:
    """Each stage's output for the micro-batch, the first stage's feeding the second."""
    outs: list[torch.Tensor] = []
    for runner in runners:
        outs.append(runner.execute(chunks, outs[-1] if outs else None))
    return outs


def _check_equal_to_layers(runners: list[StageRunner], lengths: list[int]) -> None:
    """Prefill prompts of `lengths`, then decode one token of each twice from the same cache: in one
    call and as modules. Outputs and caches must be bitwise equal."""
    assert all(r.model.decode_step is not None for r in runners)
    rng = random.Random(len(lengths))
    vocab = runners[0].config.model_config.vocab_size
    tables, next_block = [], 1  # block 0 stays empty: padding of decode tables points at it
    for i, n in enumerate(lengths):
        need = -(-(n + 1) // BLOCK)
        tables.append(list(range(next_block, next_block + need)))
        next_block += need
        _forward(runners, [SeqChunk(f"r{i}", random_prompt(rng, n, vocab), 0, tables[-1], True)])
    decode = [SeqChunk(f"r{i}", [rng.randrange(6, vocab)], n, tables[i], True) for i, n in enumerate(lengths)]
    before = [_kv(r) for r in runners]
    calls: list[int] = []
    for runner in runners:  # counted: the step must run (not the modules, which would equal themselves)
        step = runner.model.decode_step
        assert step is not None
        step.fn = _counted(step.fn, calls)
    fused = _forward(runners, decode)
    assert len(calls) == len(runners)
    fused_kv = [_kv(r) for r in runners]
    steps = [r.model.decode_step for r in runners]
    try:
        for runner, kv in zip(runners, before, strict=True):
            tensors = runner.kv.tensors()
            for t, saved in zip(tensors, kv.split([t.numel() for t in tensors]), strict=True):
                t.copy_(saved.view(t.shape))
            runner.model.decode_step = None
        layered = _forward(runners, decode)
    finally:
        for runner, step in zip(runners, steps, strict=True):
            runner.model.decode_step = step
    for a, b in zip(fused + fused_kv, layered + [_kv(r) for r in runners], strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(fused_kv[0], before[0])  # the step wrote its keys and values


def _counted(fn: Callable[..., int], calls: list[int]) -> Callable[..., int]:
    def call(*args: object) -> int:
        calls.append(1)
        return fn(*args)

    return call


def _kv(runner: StageRunner) -> torch.Tensor:
    """A copy of the stage's whole KV cache: every group's (engine/model/kv_cache.py), flat."""
    return torch.cat([t.reshape(-1) for t in runner.kv.tensors()])


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2-sliding", "llama-bias", "qwen3", "qwen3-bias-tied"])
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_equals_layers(checkpoints: dict[str, Path], arch: str, quantization: str) -> None:
    """Sliding windows (mistral's 24 and qwen2's 16 are shorter than some contexts), biases, q/k
    norms (qwen3), and weights quantized to int8; one request at batch 1 and six of different
    lengths."""
    runners = _runners(checkpoints[arch], quantization=quantization)
    _check_equal_to_layers(runners, [9])
    _check_equal_to_layers(runners, [1, 5, 16, 30, 41, 3])


@pytest.mark.parametrize("name", list(GEMMA3))
def test_gemma3_equals_layers(tmp_path: Path, name: str) -> None:
    """Gemma 3: its norms around attention and the MLP, GELU, q/k norms, and sliding layers with their
    own RoPE table reading their own KV group (a window of 16, shorter than some contexts)."""
    runners = _runners(make_tiny_checkpoint(tmp_path / name, GEMMA3[name]))
    assert any(r.kv.window is not None for r in runners)
    _check_equal_to_layers(runners, [9])
    _check_equal_to_layers(runners, [1, 5, 16, 30, 41, 3])


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0, Q.Q8_0, Q.Q5_0], ids=lambda q: q.name)
def test_equals_layers_with_gguf_types(llama_dir: Path, tmp_path: Path, qtype: Q) -> None:
    runners = _runners(write_gguf(llama_dir, tmp_path / "m.gguf", qtype), quantization="auto")
    _check_equal_to_layers(runners, [2, 19, 7])


@pytest.mark.parametrize("arch", ["llama", "qwen2-sliding", "qwen3-bias-tied"])
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_bfloat16_equals_layers(checkpoints: dict[str, Path], arch: str, quantization: str) -> None:
    """bfloat16: its float linears are the library's bfloat16 GEMM where the CPU has AVX-512 BF16
    (else oneDNN's, which the step calls back for); its int8 linears are the library's, with
    bfloat16 activations."""
    runners = _runners(checkpoints[arch], dtype="bfloat16", quantization=quantization)
    _check_equal_to_layers(runners, [9])
    _check_equal_to_layers(runners, [1, 5, 16, 30, 41, 3])


def test_a_failed_callback_fails_the_step(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error in a linear that the C++ side calls back for (oneDNN's) stops the step and is raised."""
    monkeypatch.setattr(linear, "default_kernel", lambda device, dtype: "onednn")
    runners = _runners(llama_dir, dtype="bfloat16", kernel_choice="off")  # the default, not the chosen
    step = runners[0].model.decode_step
    assert step is not None

    def broken(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("broken linear")

    linears = [list(layer) for layer in step.linears]
    linears[1][2] = broken  # the second layer's gate_up
    monkeypatch.setattr(step, "linears", linears)
    _forward(runners, [SeqChunk("a", [7, 8, 9], 0, [1], True)])
    with pytest.raises(RuntimeError, match="decode step failed") as info:
        _forward(runners, [SeqChunk("a", [11], 3, [1], True)])
    assert isinstance(info.value.__cause__, ValueError)


def test_a_mixed_micro_batch_runs_as_modules(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A micro-batch with a prefill chunk in it never takes the one call."""
    runners = _runners(llama_dir)
    calls: list[int] = []
    for r in runners:
        step = r.model.decode_step
        assert step is not None

        def counted(*args: object, _fn: Callable[..., int] = step.fn) -> int:
            calls.append(1)
            return _fn(*args)

        monkeypatch.setattr(step, "fn", counted)
    chunks = [SeqChunk("a", [7, 8, 9], 0, [1], True), SeqChunk("b", [10], 0, [2], True)]
    _forward(runners, chunks)
    assert calls == []
    _forward(runners, [SeqChunk("a", [11], 3, [1], True), SeqChunk("b", [12], 1, [2], True)])
    assert calls == [1, 1]


@pytest.mark.parametrize("source", ["checkpoint", "gguf-q4_0", "gguf-q4_0-bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_moe_equals_layers(gguf_sources: dict[str, Path], tmp_path: Path, arch: str, source: str) -> None:
    """Mixtures of experts: the step calls each MoE module back whole (its router torch's), with float
    experts (the loop over them) or Q4_0 ones (the grouped kernel), in float32 and bfloat16."""
    model = gguf_sources[arch]
    if source.startswith("gguf-q4_0"):
        model = write_gguf(model, tmp_path / "m.gguf", Q.Q4_0)
    runners = _runners(model, dtype="bfloat16" if source.endswith("bfloat16") else "float32")
    assert any(isinstance(layer.mlp, MoE) for r in runners for layer in r.model.model.layers.values())
    _check_equal_to_layers(runners, [9])
    _check_equal_to_layers(runners, [1, 5, 16, 30, 41, 3])
