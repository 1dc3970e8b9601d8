"""The perplexity of a text through a ppserve server, against transformers on the same weights.

The server scores the text as evaluation harnesses do (lm-evaluation-harness's
`local-completions`): `/v1/completions` with `echo: true`, `logprobs: 0` and `max_tokens: 0`
returns the log-probability of every prompt token after the first. transformers computes the same
from its own forward pass on the same token ids (for a GGUF, through its own GGUF loader).

    .venv/bin/python -m benchmarks eval-perplexity                     # the demo model, PP=2, starts the server
    .venv/bin/python -m benchmarks eval-perplexity --pp-size 3 --chunked-prefill-size 64
    .venv/bin/python -m benchmarks eval-perplexity --quantization auto --tolerance 0.01  # kept quantized
    .venv/bin/python -m benchmarks eval-perplexity --url http://127.0.0.1:8000 --no-reference

Prints both perplexities and their relative difference; exits 1 when it exceeds --tolerance
(default 1e-3).
"""

from __future__ import annotations

import argparse
import json
import math
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks import serving  # (its `served`: ppserve serve on a free port)

ROOT = Path(__file__).resolve().parent.parent

TEXT = ROOT / "benchmarks" / "data" / "perplexity.txt"


def server_logprobs(url: str, ids: list[int], api_key: str | None = None) -> list[float]:
    """Log-probabilities of ids[1:] given what precedes each, from the server."""
    body = {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0, "temperature": 0}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=600) as resp:
        choice = json.loads(resp.read())["choices"][0]
    scores: list[float | None] = choice["logprobs"]["token_logprobs"]
    if len(scores) != len(ids) or scores[0] is not None or any(s is None for s in scores[1:]):
        raise RuntimeError(f"expected {len(ids)} prompt logprobs, the first null; got {scores[:3]}...")
    return [float(s) for s in scores[1:] if s is not None]


def reference_logprobs(model: Path, ids: list[int], hf: Any = None) -> list[float]:
    """The same from transformers (float32), loaded here unless given."""
    import torch
    from transformers import AutoModelForCausalLM

    if hf is None:
        kwargs: dict[str, Any] = {"dtype": torch.float32}
        if model.suffix == ".gguf":
            hf = AutoModelForCausalLM.from_pretrained(str(model.parent), gguf_file=model.name, **kwargs)
        else:
            hf = AutoModelForCausalLM.from_pretrained(str(model), **kwargs)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    scores = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return [float(s) for s in scores]


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory or .gguf file (default: the demo model)")
    p.add_argument("--url", default=None, help="score through this running server (serving --model) instead")
    p.add_argument("--api-key", default=None, help="the --url server's API key")
    p.add_argument("--pp-size", type=int, default=2)
    p.add_argument("--chunked-prefill-size", type=int, default=128, help="so that the text spans several chunks")
    p.add_argument("--text", default=str(TEXT))
    p.add_argument(
        "--quantization",
        default="none",
        choices=["auto", "none", "int8"],
        help="the server's (default none: the float weights transformers runs; auto keeps a GGUF's types)",
    )
    p.add_argument("--no-reference", action="store_true", help="skip transformers")
    p.add_argument("--tolerance", type=float, default=1e-3, help="largest relative difference accepted")
    args = p.parse_args(argv)

    from ppserve.engine.config import EngineConfig
    from ppserve.engine.model.tokenizer import Tokenizer
    from ppserve.server.demo import resolve_model

    model = Path(resolve_model(args.model))
    tokenizer = Tokenizer(EngineConfig.create(model, num_kv_blocks=1).model)  # a GGUF's prepared directory
    ids = tokenizer.encode(Path(args.text).read_text())
    if args.url:
        ours = server_logprobs(args.url, ids, args.api_key)
    else:
        chunk = args.chunked_prefill_size
        settings = argparse.Namespace(
            pp_size=args.pp_size,
            kv_cache_gb=0.1,
            max_running_requests=8,
            chunked_prefill_size=chunk,
            quantization=args.quantization,
        )
        with serving.served(settings, model) as (url, _):
            ours = server_logprobs(url, ids)
    result: dict[str, Any] = {"tokens": len(ids), "ppserve": perplexity(ours)}
    if not args.no_reference:
        theirs = reference_logprobs(model, ids)
        result["transformers"] = perplexity(theirs)
        result["relative_difference"] = abs(result["ppserve"] - result["transformers"]) / result["transformers"]
        result["max_token_logprob_difference"] = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
    print(json.dumps(result, indent=2))
    return int(result.get("relative_difference", 0.0) > args.tolerance)
