"""Tokenizer glue: round trips, chat template, streaming detokenization."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from ppserve.engine.model.tiny_checkpoint import EOS
from ppserve.engine.model.tokenizer import Tokenizer

TEXT = "Café in Zürich 東京 🙂🚀 -> the pipeline…"


def test_round_trip_and_special_tokens(llama_dir: Path) -> None:
    tok = Tokenizer(llama_dir)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert tok.eos_token_id == tok.encode(EOS, add_special_tokens=False)[0]
    assert tok.decode([*ids, tok.eos_token_id]) == TEXT  # special tokens skipped


def test_chat_template(llama_dir: Path) -> None:
    tok = Tokenizer(llama_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi there"}])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|user|>\nhi there<|eos|>") and text.endswith("<|assistant|>\n")
    assert tok.has_chat_template


def test_without_a_chat_template(llama_dir: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "base"
    shutil.copytree(llama_dir, ckpt)
    (ckpt / "chat_template.jinja").unlink()
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(ckpt)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_incremental_detokenizer_never_splits_characters(llama_dir: Path) -> None:
    tok = Tokenizer(llama_dir)
    # Valid text streamed token by token: multi-byte characters arrive in pieces, and no delta
    # ever shows a replacement character.
    detok = tok.detokenizer(prompt_token_ids=tok.encode("Prompt:"))
    streamed = [detok.push([i]) for i in tok.encode(TEXT)]
    assert all("\ufffd" not in d for d in streamed)
    assert "".join(streamed) + detok.flush() == TEXT
    assert any(d == "" for d in streamed)  # some tokens really were held back mid-character


def test_incremental_detokenizer_reassembles_any_sequence(llama_dir: Path) -> None:
    """Arbitrary token sequences (even invalid UTF-8) pushed in random groups add up to the full decode."""
    tok = Tokenizer(llama_dir)
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(6, tok.vocab_size) for _ in range(rng.randint(1, 50))]
        detok = tok.detokenizer(prompt_token_ids=tok.encode("The prompt ends in whole characters: é"))
        deltas, i = [], 0
        while i < len(ids):
            n = rng.choice([1, 1, 2, 5])
            deltas.append(detok.push(ids[i : i + n]))
            i += n
        deltas.append(detok.flush())
        assert "".join(deltas) == tok.decode(ids) == detok.text
