"""Shared fixtures: tiny random checkpoints, made once per test session."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hang_watch import hang_watch
from live_server import LiveServer

from ppserve.engine.environment import LOOP_WATCH_ENV
from ppserve.engine.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint
from ppserve.engine.runtime import loop_watch
from ppserve.server.demo import demo_model

# Two cores: keep torch from oversubscribing them when tests run stage work in one process.
torch.set_num_threads(2)

# One checkpoint per architecture, each exercising what is special about it.
_QWEN3_MOE = (
    ("num_experts", 8),
    ("num_experts_per_tok", 2),
    ("moe_intermediate_size", 48),
    ("norm_topk_prob", True),
    ("mlp_only_layers", [2]),
)
SPECS = {
    "llama": TinySpec(arch="llama", seed=1, rope_scaling="llama3", tie_word_embeddings=True),
    "mistral": TinySpec(arch="mistral", seed=2, sliding_window=24),  # prompts in tests exceed the window
    "qwen2": TinySpec(arch="qwen2", seed=3, rope_scaling="linear"),  # q/k/v bias
    "qwen3": TinySpec(arch="qwen3", seed=4, head_dim=24),  # q/k norm, head_dim != hidden / heads
    # Less common variants of the same families.
    "llama-bias": TinySpec(arch="llama", seed=5, overrides=(("attention_bias", True), ("mlp_bias", True))),
    "qwen2-sliding": TinySpec(
        arch="qwen2",
        seed=6,
        overrides=(("use_sliding_window", True), ("sliding_window", 16), ("max_window_layers", 2)),
    ),
    "qwen3-bias-tied": TinySpec(arch="qwen3", seed=7, tie_word_embeddings=True, overrides=(("attention_bias", True),)),
    # head_dim 64: the prefill attention kernel's (engine/model/cpu_kernels.cpp), with a window.
    "mistral-hd64": TinySpec(arch="mistral", seed=8, head_dim=64, sliding_window=24),
    # Mixtures of experts (engine/model/moe.py): 8 experts, top 2; Qwen3-MoE's renormalised, with
    # one dense layer, and Mixtral's.
    "qwen3-moe": TinySpec(arch="qwen3_moe", seed=9, head_dim=16, overrides=_QWEN3_MOE),
    "mixtral": TinySpec(arch="mixtral", seed=10, overrides=(("num_local_experts", 8), ("num_experts_per_tok", 2))),
}
ARCHS = list(SPECS)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with hang_watch(item.nodeid):
        return (yield)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_tiny_checkpoint(root / name, spec) for name, spec in SPECS.items()}


@pytest.fixture(scope="session")
def gguf_sources(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints llama.cpp's formats can hold: Mixtral, and a Qwen3-MoE with experts in every layer
    (llama.cpp's qwen3moe has no dense layers, and renormalises the top k) whose widths are whole
    blocks of 32."""
    moe = (*_QWEN3_MOE[:2], ("moe_intermediate_size", 64), ("norm_topk_prob", True))
    spec = TinySpec(arch="qwen3_moe", seed=12, head_dim=16, overrides=moe)
    return {"mixtral": checkpoints["mixtral"], "qwen3-moe": make_tiny_checkpoint(tmp_path_factory.mktemp("q3m"), spec)}


@pytest.fixture(scope="session")
def llama_dir(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["llama"]


@pytest.fixture(scope="session")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llama spec again, written as several shards with an index."""
    spec = TinySpec(**{**SPECS["llama"].__dict__, "max_shard_size": "200KB"})
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sharded"), spec)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The demo model's GGUF (SmolLM2-135M-Instruct, Q4_1), downloaded into the user's cache
    directory on first use and kept there, so that later runs work offline."""
    return demo_model()


@pytest.fixture(scope="session")
def live_server(llama_dir: Path) -> Iterator[LiveServer]:
    """`ppserve serve` with two stages on the tiny llama, shared by the HTTP tests."""
    server = LiveServer(llama_dir, "--pp-size", "2", "--kv-cache-gb", "0.02", "--tensor-transport", "shm")
    yield server
    assert server.stop() == 0, "".join(server.output)


LOOP_BOUND_MS = 50.0  # a callback that uses this much CPU holds up every socket of its process


@pytest.fixture
def watch_loops(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> Iterator[None]:
    """Debug mode for event loops (engine/runtime/loop_watch.py): the test fails if a callback used more
    than LOOP_BOUND_MS of CPU, or a process was joined on a loop, in this process's loops, in the
    stage processes it starts, or in the servers it starts (all of which inherit the setting
    through the environment). Stages report on stderr, which is this process's (captured here);
    a server's stderr is its output."""
    monkeypatch.setenv(LOOP_WATCH_ENV, str(LOOP_BOUND_MS))
    found: list[str] = []
    servers = len(LiveServer.started)
    with loop_watch.watching(LOOP_BOUND_MS, found.append):
        yield
    out, err = capfd.readouterr()
    sys.stdout.write(out)  # back into the report, where they would have been
    sys.stderr.write(err)
    outputs = [out, err, *("".join(s.output) for s in LiveServer.started[servers:])]
    found += [line for text in outputs for line in text.splitlines() if loop_watch.MARKER in line]
    assert not found, "event loops were blocked:\n" + "\n".join(found)
