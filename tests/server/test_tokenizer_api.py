"""GET /tokenizer_info, POST /tokenize and POST /detokenize (server/tokenizer_api.py): vLLM's paths
and fields, the model's own tokenizer and chat template, bounded input; and the model card and
version endpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

from live_server import LiveServer

from ppserve.engine.model.tokenizer import Tokenizer
from ppserve.server.version import installed_version as version

TEXT = "The pipeline stage — café 東京 🙂"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a stage?"}]


def _post(server: LiveServer, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, _, raw = server.request("POST", path, body)
    return status, json.loads(raw)


def test_tokenizer_info(live_server: LiveServer, llama_dir: Path) -> None:
    status, _, raw = live_server.request("GET", "/tokenizer_info")
    info = json.loads(raw)
    hf = Tokenizer(llama_dir).hf
    assert status == 200 and info["eos_token"] == hf.eos_token and info["bos_token"] == hf.bos_token
    assert info["chat_template"] == hf.chat_template and info["vocab_size"] == 512
    assert info["max_model_len"] == info["model_max_length"] == 2048
    assert live_server.request("GET", "/tokenizer_info", headers={"Authorization": ""})[0] == 401


def test_tokenize_and_detokenize_are_the_models_tokenizer(live_server: LiveServer, llama_dir: Path) -> None:
    """A prompt's ids with and without special tokens, chat messages as the chat template renders
    them, and the text back from ids, special tokens kept."""
    tokenizer = Tokenizer(llama_dir)
    for special in (True, False):
        status, body = _post(live_server, "/tokenize", {"prompt": TEXT, "add_special_tokens": special})
        ids = tokenizer.encode(TEXT, add_special_tokens=special)
        assert status == 200 and body == {"tokens": ids, "count": len(ids), "max_model_len": 2048}
    status, body = _post(live_server, "/tokenize", {"messages": MESSAGES, "model": live_server.model})
    assert status == 200 and body["tokens"] == tokenizer.apply_chat_template(MESSAGES)
    status, body = _post(live_server, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and body["prompt"] == tokenizer.decode(tokenizer.apply_chat_template(MESSAGES), False)
    assert "<|assistant|>" in body["prompt"]  # special tokens kept


def test_bad_input_is_a_400_naming_the_field(live_server: LiveServer, llama_dir: Path) -> None:
    """A prompt longer than the context is counted (lm-evaluation-harness measures documents so),
    but text that no tokenization could fit is refused before any tokenizing."""
    status, body = _post(live_server, "/tokenize", {"prompt": "a b " * 5000})
    assert status == 200 and body["count"] > body["max_model_len"]
    too_long = "x" * (Tokenizer(llama_dir).max_token_chars * 2048 + 1)
    cases: list[tuple[str, dict[str, Any], str | None]] = [
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "messages"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": too_long}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, 512]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, None),
        ("/detokenize", {"tokens": [1], "extra": 1}, None),
    ]
    for path, body, param in cases:
        status, answer = _post(live_server, path, body)
        assert status == 400, (path, body, answer)
        if param is not None:
            assert answer["error"]["param"] == param, (path, body, answer)
    assert live_server.request("GET", "/health")[0] == 200


def test_model_card_and_version(live_server: LiveServer) -> None:
    """GET /v1/models/{model} (a name with slashes too) is /v1/models' card; another name is a 404;
    GET /version needs no key."""
    status, _, raw = live_server.request("GET", "/v1/models")
    card = json.loads(raw)["data"][0]
    status, _, raw = live_server.request("GET", "/v1/models/" + live_server.model.lstrip("/"))
    assert status == 404  # the path without its leading slash is another name
    status, _, raw = live_server.request("GET", "/v1/models/" + quote(live_server.model, safe=""))
    assert status == 200 and json.loads(raw) == card
    status, _, raw = live_server.request("GET", "/v1/models/other")
    assert status == 404 and json.loads(raw)["error"]["param"] == "model"
    status, _, raw = live_server.request("GET", "/version", headers={"Authorization": ""})
    assert status == 200 and json.loads(raw)["version"] == version()
