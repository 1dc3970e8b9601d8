"""Weight loading: single file and shards, and each stage holding only its own tensors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers import pipeline, prompt_logits, random_prompt

import ppserve.engine.model.weights as weights
from ppserve.engine.config import EngineConfig
from ppserve.engine.model.model import StageModel
from ppserve.engine.model.weights import load_stage_weights
from ppserve.engine.runtime.stage_runner import StageRunner


def test_sharded_equals_single_file(llama_dir: Path, sharded_dir: Path) -> None:
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    assert len(set(weights.checkpoint_files(sharded_dir).values())) > 2
    prompt = random_prompt(random.Random(3), 20)
    single = prompt_logits(pipeline(llama_dir), prompt)
    sharded = prompt_logits(pipeline(sharded_dir, pp_size=2), prompt)
    assert torch.equal(single, sharded)


def test_stage_loads_only_its_tensors(sharded_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[str] = []
    real_open = weights.safe_open

    class Spy:
        def __init__(self, path: str, **kwargs: str) -> None:
            self.inner = real_open(path, **kwargs)

        def __enter__(self) -> Spy:
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.inner.__exit__(*exc)

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(weights, "safe_open", Spy)
    config = EngineConfig.create(sharded_dir, pp_size=3, num_kv_blocks=4)  # 4 layers: 1, 1, 2
    StageRunner(config, 0)
    assert sorted({n.split(".")[2] for n in read if n.startswith("model.layers.")}) == ["0"]
    assert "model.embed_tokens.weight" in read and "model.norm.weight" not in read
    read.clear()
    StageRunner(config, 1)
    assert all(n.startswith("model.layers.1.") for n in read)
    read.clear()
    last = StageRunner(config, 2)
    layers = {n.split(".")[2] for n in read if n.startswith("model.layers.")}
    assert layers == {"2", "3"}
    # Tied embeddings: the last stage reads the embedding for its lm_head, and nothing else embeds there.
    assert "model.embed_tokens.weight" in read and "model.norm.weight" in read
    assert last.model.model.embed_tokens is None and last.model.head is not None
    assert last.kv_cache.shape[0] == 2  # KV cache for its own two layers only


def test_tied_single_stage_shares_the_tensor(llama_dir: Path) -> None:
    config = EngineConfig.create(llama_dir, num_kv_blocks=4)
    with torch.device("meta"):
        stage = StageModel(config.model_config, range(config.model_config.num_layers), True, True)
    load_stage_weights(stage, llama_dir, torch.float32, torch.device("cpu"))
    embed = stage.model.embed_tokens
    assert stage.lm_head is not None and isinstance(embed, torch.nn.Embedding)
    assert stage.lm_head.weight.data_ptr() == embed.weight.data_ptr()


def test_progress_bar_for_shards(sharded_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    StageRunner(EngineConfig.create(sharded_dir, num_kv_blocks=4), 0)
    assert "loading shards" in capfd.readouterr().err
