"""A model's generation_config.json `max_new_tokens` is the length of a request that names none,
on every endpoint and in `ppserve generate`; an explicit limit still wins."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import LiveServer

from ppserve.engine.model.model_config import ConfigError, ModelConfig
from ppserve.server.demo import TINY_SPEC

DEFAULT = 5


@pytest.fixture(scope="module")
def model_with_default(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = tmp_path_factory.mktemp("defaults") / "model"
    shutil.copytree(llama_dir, ckpt)
    gen = json.loads((ckpt / "generation_config.json").read_text())
    (ckpt / "generation_config.json").write_text(json.dumps({**gen, "max_new_tokens": DEFAULT}))
    return ckpt


@pytest.fixture(scope="module")
def server(model_with_default: Path) -> Iterator[LiveServer]:
    srv = LiveServer(model_with_default, "--kv-cache-gb", "0.02")
    yield srv
    srv.stop()


def test_parsed_from_generation_config(model_with_default: Path, llama_dir: Path) -> None:
    assert ModelConfig.from_dir(model_with_default).max_new_tokens == DEFAULT
    assert ModelConfig.from_dir(llama_dir).max_new_tokens is None
    raw = json.loads((llama_dir / "config.json").read_text())
    for bad in (0, -3, 2.5, "64", True):
        with pytest.raises(ConfigError, match="max_new_tokens must be a positive integer"):
            ModelConfig.from_dict(raw, {"max_new_tokens": bad})


def test_the_tiny_random_model_has_a_default() -> None:
    assert TINY_SPEC.max_new_tokens is not None and TINY_SPEC.max_new_tokens < TINY_SPEC.max_position_embeddings


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "body", "explicit"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": "Once upon"}, "max_tokens"),
    ],
)
def test_openai_endpoints(server: LiveServer, path: str, body: dict[str, object], explicit: str) -> None:
    body = {**body, "model": server.model, "ignore_eos": True}
    status, _, raw = server.request("POST", path, body)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == DEFAULT
    status, _, raw = server.request("POST", path, {**body, explicit: DEFAULT + 3})
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == DEFAULT + 3


@pytest.mark.slow
def test_native_generate(server: LiveServer) -> None:
    status, _, raw = server.request("POST", "/generate", {"text": "Once", "sampling_params": {"ignore_eos": True}})
    assert status == 200, raw
    assert len(json.loads(raw)["token_ids"]) == DEFAULT


@pytest.mark.slow
def test_cli_generate(model_with_default: Path) -> None:
    args = ["generate", "--model", str(model_with_default), "--input-ids", "5,6,7", "--ignore-eos", "--json"]
    res = subprocess.run(
        [sys.executable, "-m", "ppserve.server.cli", *args, "--kv-cache-gb", "0.02"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert len(json.loads(res.stdout)["token_ids"]) == DEFAULT
