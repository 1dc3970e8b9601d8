"""llama.cpp's perplexity on the K-quant GGUFs that ppserve is to serve: the reference figures.

Two Q4_K_M files, as people download them:

    gemma3_270m_q4_k_m     Gemma 3 270M, the Q4_K_M of llama.cpp's GGUF-my-repo (benchmarks/fetch_gemma3.py)
    smollm2_q4_k_m         the demo model's Q4_1 GGUF re-quantized by `llama-quantize --allow-requantize
                           ... Q4_K_M` (benchmarks/harness/peers_setup.py's smollm2_q4_k_m)

and two texts, benchmarks/data/perplexity.txt (benchmarks/eval_perplexity.py's) and perplexity_long.txt
(benchmarks/quant_quality.py's). Each is scored as benchmarks/quant_quality.py scores it (its
`llama_perplexity`): one window of `-c` = the text's token count, the text given three times over
with --chunks 1, so that the window is exactly the text; llama-perplexity scores the window's tokens
n_ctx // 2 + 1 .. n_ctx - 1, each with every token before it as context. The window's token ids and
the scored tokens' log-probabilities (read back from --kl-divergence-base's file) are recorded, so
that ppserve can be compared on the same ids without llama.cpp: its `/v1/completions` with
`echo: true, logprobs: 0, max_tokens: 0` on `ids` gives the log-probabilities of tokens 1 .. n-1,
of which bench_quant_quality.scored() keeps the same ones; perplexity = exp(-mean).

The text's token count is ppserve's (as in benchmarks/quant_quality.py) where ppserve reads the file,
else llama.cpp's own, which llama-perplexity reports when the input is shorter than two windows.

    .venv/bin/python -m benchmarks kquant-reference           # builds llama.cpp's tools on first use

Writes benchmarks/results/kquant_reference.json.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.eval_perplexity import perplexity
from benchmarks.fetch_gemma3 import gemma3_270m_q4_k_m
from benchmarks.harness.peers_setup import (
    CACHE,
    LLAMA_PERPLEXITY,
    llama_cpp_version,
    setup_llama_perplexity,
    smollm2_q4_k_m,
)
from benchmarks.harness.record import write_result
from benchmarks.quant_quality import llama_perplexity, shown

ROOT = Path(__file__).resolve().parent.parent

TEXTS = [ROOT / "benchmarks/data/perplexity.txt", ROOT / "benchmarks/data/perplexity_long.txt"]
MODELS = {"gemma3_270m_q4_k_m": gemma3_270m_q4_k_m, "smollm2_q4_k_m": smollm2_q4_k_m}
TOO_SHORT = re.compile(r"tokenizes to only (\d+) tokens")


def llama_token_count(model: Path, text: str, workdir: Path) -> int:
    """How many tokens llama.cpp makes of `text` (with the BOS it adds): llama-perplexity given the
    text once, with a window no text of this many bytes fills twice, says so and stops."""
    workdir.mkdir(parents=True, exist_ok=True)
    source = workdir / "count.txt"
    source.write_text(text + "\n")  # -f drops the file's last newline: what is left is the text
    n_ctx = len(text.encode()) + 2  # a token is at least a byte, and BOS/EOS
    cmd = [str(LLAMA_PERPLEXITY), "-m", str(model), "-f", str(source), "-c", str(n_ctx), "-t", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    match = TOO_SHORT.search(res.stdout + res.stderr)
    if not match:
        raise RuntimeError(f"{shlex.join(cmd)}: no token count in its output:\n{(res.stdout + res.stderr)[-2000:]}")
    return int(match[1])


def ppserve_ids(model: Path, text: str) -> list[int] | None:
    """ppserve's token ids of `text`, or None where ppserve does not read this model (yet)."""
    from ppserve.engine.config import EngineConfig
    from ppserve.engine.model.model_config import ConfigError
    from ppserve.engine.model.tokenizer import Tokenizer

    try:
        return list(Tokenizer(EngineConfig.create(model, num_kv_blocks=1).model).encode(text))
    except ConfigError as e:  # e.g. an architecture it does not serve yet
        print(f"ppserve does not tokenize {model.name} ({type(e).__name__}: {e}); counting with llama.cpp")
        return None


def tensor_types(model: Path) -> dict[str, dict[str, int]]:
    """Count and bytes of the file's tensors per GGML type (gguf-py's reader)."""
    from gguf import GGUFReader

    out: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0})
    for t in GGUFReader(model).tensors:
        out[t.tensor_type.name]["tensors"] += 1
        out[t.tensor_type.name]["bytes"] += int(t.n_bytes)
    return dict(sorted(out.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--texts", nargs="+", default=[str(t) for t in TEXTS])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/kquant_reference.json"))
    args = p.parse_args(argv)

    from ppserve.engine.model.file_hash import file_sha256

    setup_llama_perplexity()
    results: dict[str, Any] = {}
    for name in args.models:
        model = MODELS[name]()
        runs: dict[str, Any] = {}
        for text_path in map(Path, args.texts):
            text = text_path.read_text()
            work = CACHE / "kquant_reference" / f"{name}-{text_path.stem}"
            own = ppserve_ids(model, text)
            llama_count = llama_token_count(model, text, work)
            n_ctx = len(own) if own is not None else llama_count
            start = time.perf_counter()
            llama = llama_perplexity(model, text, n_ctx, work)
            seconds = time.perf_counter() - start
            ids, logprobs = llama.pop("ids"), llama.pop("logprobs")
            recomputed = perplexity(logprobs)
            if abs(recomputed - llama["perplexity"]) > 1e-3 * llama["perplexity"]:
                raise RuntimeError(
                    f"llama-perplexity printed {llama['perplexity']}, its logits file gives {recomputed}"
                )
            print(f"{name} on {text_path.name}: PPL {llama['perplexity']} +/- {llama['plus_minus']} ({seconds:.1f} s)")
            runs[text_path.stem] = {
                "text": shown(text_path),
                "perplexity": llama["perplexity"],
                "plus_minus": llama["plus_minus"],
                "perplexity_from_logits_file": recomputed,
                "n_ctx": n_ctx,
                "n_ctx_from": "ppserve's tokenizer" if own is not None else "llama.cpp's tokenizer",
                "tokens_llama_cpp": llama_count,
                "tokens_ppserve": None if own is None else len(own),
                "same_tokenization": None if own is None else own == ids,
                "scored_positions": [n_ctx // 2 + 1, n_ctx - 1],
                "scored": len(logprobs),
                "seconds": round(seconds, 2),
                "command": shlex.join(llama["command"]),
                "ids": ids,  # the window: what to give ppserve
                "logprobs": [round(v, 6) for v in logprobs],  # of tokens n_ctx // 2 + 1 .. n_ctx - 1
            }
        results[name] = {
            "file": model.name,
            "sha256": file_sha256(model),
            "bytes": model.stat().st_size,
            "tensor_types": tensor_types(model),
            "runs": runs,
        }
    report = {
        "benchmark": "kquant_reference",
        "llama_cpp": llama_cpp_version(),
        "threads": os.cpu_count() or 1,
        "scoring": "llama-perplexity -c n_ctx -b n_ctx --chunks 1 on the text three times over: tokens "
        "n_ctx // 2 + 1 .. n_ctx - 1 of a window holding the text, each given every token before it; "
        "n_ctx is the text's token count (see the script)",
        "models": results,
    }
    write_result(Path(args.out), report, args)
    print(f"wrote {args.out}")
    return 0
