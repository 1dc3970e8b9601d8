"""llguidance against xgrammar, the two grammar engines vLLM offers: what each costs to install, to
compile a JSON schema, and to compute one token's mask per request at 32 streams.

Runs where both are installed (not ppserve's own venv, which has llguidance only: the peers'
venv of scripts/bench_peers.py has vLLM, which brings both):

    .venv-peers/bin/python scripts/bench_grammar_engines.py --tokenizer DIR [--streams 32]

`DIR` holds a tokenizer.json (e.g. the demo's converted GGUF, or build/peers/ckpt-smollm2).
Writes benchmarks/results/grammar_engines.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_record import RESULTS, write_result  # noqa: E402

# The schema both benchmarks constrain to, and a reply that follows it.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "employed"],
    "additionalProperties": False,
}
REPLY = {"name": "Ana Lopez", "age": 34, "city": "Porto", "hobbies": ["chess", "sailing"], "employed": True}


def installed_mb(dist: str) -> float:
    """Megabytes a distribution's files take on disk (its RECORD)."""
    files = importlib.metadata.distribution(dist).files or []
    paths = [Path(f.locate()) for f in files]
    return sum(p.stat().st_size for p in paths if p.is_file()) / 1e6


def requires(dist: str) -> list[str]:
    return [r for r in importlib.metadata.requires(dist) or [] if "extra ==" not in r]


def timed(fn: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def mask_times(reply_ids: list[int], fill: Callable[[], int], advance: Callable[[int], None]) -> dict[str, float]:
    """Microseconds per request to compute one token's mask, as the streams walk a reply token by
    token: `fill` computes every stream's mask (and says how many streams), `advance` feeds a token."""
    per_token = []
    for token in reply_ids:
        t = time.perf_counter()
        streams = fill()
        per_token.append((time.perf_counter() - t) / streams)
        advance(token)
    return {"mask_us_p50": statistics.median(per_token) * 1e6, "mask_us_max": max(per_token) * 1e6}


def bench_llguidance(hf: Any, vocab: int, schema: str, reply_ids: list[int], streams: int) -> dict[str, float]:
    import llguidance as llg
    import torch
    from llguidance.hf import from_tokenizer

    tok, tok_s = timed(lambda: from_tokenizer(hf, n_vocab=vocab))
    opts = {"whitespace_flexible": False}
    grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=opts)  # type: ignore[arg-type]
    first, compile_s = timed(lambda: llg.LLMatcher(tok, grammar, log_level=0))
    matchers = [first.deep_copy() for _ in range(streams)]
    words = (vocab + 31) // 32
    mask = torch.empty(streams, words, dtype=torch.int32)

    def fill() -> int:
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(mask[i].data_ptr(), words * 4)
        return streams

    def advance(token: int) -> None:
        for m in matchers:
            m.consume_token(token)

    return {"tokenizer_setup_ms": tok_s * 1e3, "compile_ms": compile_s * 1e3, **mask_times(reply_ids, fill, advance)}


def bench_xgrammar(hf: Any, vocab: int, schema: str, reply_ids: list[int], streams: int) -> dict[str, float]:
    import xgrammar as xgr

    info, tok_s = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled, compile_s = timed(lambda: compiler.compile_json_schema(schema, any_whitespace=False))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(streams)]
    mask = xgr.allocate_token_bitmask(streams, vocab)

    def fill() -> int:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)
        return streams

    def advance(token: int) -> None:
        for m in matchers:
            m.accept_token(token)

    return {"tokenizer_setup_ms": tok_s * 1e3, "compile_ms": compile_s * 1e3, **mask_times(reply_ids, fill, advance)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a directory with tokenizer.json")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS / "grammar_engines.json")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(args.tokenizer))
    vocab = len(hf)
    schema = json.dumps(SCHEMA)
    reply_ids = hf.encode(json.dumps(REPLY), add_special_tokens=False)
    report: dict[str, Any] = {"benchmark": "grammar engines", "schema": SCHEMA, "reply_tokens": len(reply_ids)}
    for name, fn, dists in (
        ("llguidance", bench_llguidance, ["llguidance"]),
        ("xgrammar", bench_xgrammar, ["xgrammar", "apache-tvm-ffi", "triton"]),
    ):
        result = fn(hf, vocab, schema, reply_ids, args.streams)
        result["version"] = importlib.metadata.version(name)  # type: ignore[assignment]
        result["requires"] = requires(name)  # type: ignore[assignment]
        result["installed_mb"] = {d: round(installed_mb(d), 1) for d in dists}  # type: ignore[assignment]
        report[name] = result
        print(name, json.dumps(result))
    print(write_result(args.out, report, args))


if __name__ == "__main__":
    main()
