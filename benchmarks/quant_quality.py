"""Perplexity of the demo model's Q4_1 GGUF kept quantized in ppserve, against llama.cpp's on the same file.

One text (benchmarks/data/perplexity_long.txt, 1795 tokens), one GGUF (the demo model,
SmolLM2-135M-Instruct in Q4_1), four perplexities:

    llama_cpp      llama.cpp's `llama-perplexity` on the GGUF, computing in Q4_1
    ppserve_auto   ppserve serving the GGUF with --quantization auto (int4 weights, groups of 32)
    ppserve_none   ppserve with --quantization none (the weights dequantized to float32)
    transformers   transformers on the dequantized weights (its own GGUF loader), float32

Scoring the same tokens: llama-perplexity cuts its input into windows of `-c` tokens and scores
only the second half of each (token j is scored for j in (c/2, c), so that every scored token has
at least c/2 tokens of context); it refuses input shorter than two windows. So it gets the text
three times over with `-c` = the text's token count, `-b` the same (one sequence per batch) and
`--chunks 1`: its one window is exactly the text. `--kl-divergence-base` makes it write the token
ids of that window to a file, with the log-probabilities of the tokens it scores; those ids are
what ppserve and transformers are given, and llama-perplexity's perplexity is compared with theirs
over the same scored tokens (the window's positions c/2 + 1 .. c - 1, with the same context). The
perplexity over every token but the first is recorded as well, for ppserve and transformers.

Why the long text: a perplexity is exp(-mean log-probability), so two engines' perplexities differ by
the mean of their per-token differences. Both quantized engines are off the float32 model by about
0.05 of a log-probability per token, either way, so the mean of n such differences moves by about
0.07 / sqrt(n): on the 201 tokens that benchmarks/eval_perplexity.py's 403-token text leaves scored, about
0.5%, half the 1% target; on this text's 897, about 0.2%. The per-token differences are recorded
too (against float32: mean, mean of their sizes, and the mean's standard error).

    .venv/bin/python -m benchmarks quant-quality                        # about a minute on 2 cores
    .venv/bin/python -m benchmarks quant-quality --pp-size 2 --out /tmp/quant_perplexity.json

Writes benchmarks/results/quant_perplexity.json (perplexities, relative differences, token counts,
the llama-perplexity command line); exits 1 when ppserve's quantized perplexity is more than
--tolerance (default 1%) away from llama.cpp's.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import serving
from benchmarks.eval_perplexity import perplexity, reference_logprobs, server_logprobs
from benchmarks.harness.peers_setup import CACHE, LLAMA_PERPLEXITY, setup_llama_perplexity
from benchmarks.harness.record import write_result

ROOT = Path(__file__).resolve().parent.parent

TEXT = ROOT / "benchmarks" / "data" / "perplexity_long.txt"
COPIES = 3  # of the text in llama-perplexity's input: it needs two windows' worth, and a margin
FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def llama_perplexity(model: Path, text: str, n_ctx: int, workdir: Path) -> dict[str, Any]:
    """llama-perplexity over one window of `n_ctx` tokens at the start of `text`: its perplexity,
    the window's token ids and the log-probabilities of the tokens it scored (both read back from
    the file --kl-divergence-base writes), and the command."""
    workdir.mkdir(parents=True, exist_ok=True)
    source, logits = workdir / "text.txt", workdir / "logits.bin"
    source.write_text(text * COPIES)
    cmd = [str(LLAMA_PERPLEXITY), "-m", str(model), "-f", str(source), "-c", str(n_ctx), "-b", str(n_ctx)]
    cmd += ["--chunks", "1", "-t", str(os.cpu_count() or 1), "--kl-divergence-base", str(logits)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    out = res.stdout + res.stderr
    match = FINAL.search(out)
    if res.returncode or not match:
        raise RuntimeError(f"{shlex.join(cmd)} exited {res.returncode}:\n{out[-3000:]}")
    return {"perplexity": float(match[1]), "plus_minus": float(match[2]), **read_logits(logits), "command": cmd}


def read_logits(path: Path) -> dict[str, Any]:
    """The window's token ids and the scored tokens' log-probabilities from llama-perplexity's
    --kl-divergence-base file (tools/perplexity/perplexity.cpp): b"_logits_", int32 n_ctx, n_vocab,
    n_chunk, the n_chunk * n_ctx token ids, then one row per scored token of 2 float32 (scale, lowest
    log-probability) and n_vocab uint16 log-probabilities, each lowest + scale * q (q = 0: lower)."""
    raw = path.read_bytes()
    if raw[:8] != b"_logits_":
        raise RuntimeError(f"{path}: not a llama-perplexity logits file")
    n_ctx, n_vocab, chunks = (int(v) for v in np.frombuffer(raw, np.int32, 3, 8))
    ids = np.frombuffer(raw, np.int32, n_ctx * chunks, 20)[:n_ctx]
    first, row = n_ctx // 2, 2 * ((n_vocab + 1) // 2) + 4  # row: in uint16s, padded to whole floats
    rows = np.frombuffer(raw, np.uint16, (n_ctx - 1 - first) * row, 20 + 4 * n_ctx * chunks).reshape(-1, row)
    scale, lowest = rows[:, :4].copy().view(np.float32).T
    q = rows[np.arange(len(rows)), 4 + ids[first + 1 :]]
    return {"ids": [int(t) for t in ids], "logprobs": [float(v) for v in lowest + scale * q]}


def scored(logprobs: list[float], n_ctx: int) -> list[float]:
    """Of the log-probabilities of tokens 1 .. n-1 of a window (as the server returns them), those
    llama-perplexity scores: tokens n_ctx // 2 + 1 .. n_ctx - 1."""
    return logprobs[n_ctx // 2 : n_ctx - 1]


def shown(path: Path) -> str:
    """`path` relative to the repository where it lies in it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def relative(a: float, b: float) -> float:
    return abs(a - b) / b


def per_token(a: list[float], b: list[float]) -> dict[str, float]:
    """How log-probabilities `a` differ from `b` token by token: the mean (what moves a perplexity:
    exp(-mean) is its ratio), the mean size, and the mean's standard error."""
    d = np.subtract(a, b)
    return {
        "mean": float(d.mean()),
        "mean_abs": float(np.abs(d).mean()),
        "standard_error": float(d.std(ddof=1) / math.sqrt(len(d))),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a quantized .gguf file (default: the demo model's Q4_1 GGUF)")
    p.add_argument("--text", default=str(TEXT))
    p.add_argument("--pp-size", type=int, default=1, help="ppserve's pipeline stages")
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--tolerance", type=float, default=0.01, help="largest relative difference to llama.cpp's")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/quant_perplexity.json"))
    args = p.parse_args(argv)

    from ppserve.engine.config import EngineConfig
    from ppserve.engine.model.tokenizer import Tokenizer
    from ppserve.server.demo import demo_model

    model = Path(args.model) if args.model else demo_model()
    text = Path(args.text).read_text()
    own_ids = Tokenizer(EngineConfig.create(model, num_kv_blocks=1).model).encode(text)
    setup_llama_perplexity()
    # Its input and logits stay in build/peers/ so that the recorded command can be run again.
    llama = llama_perplexity(model, text, len(own_ids), CACHE / "quant_perplexity")
    ids, n_ctx, llama_logprobs = llama.pop("ids"), len(own_ids), llama.pop("logprobs")
    print(f"llama-perplexity: PPL {llama['perplexity']:.4f} over tokens {n_ctx // 2 + 1}..{n_ctx - 1}")

    logprobs: dict[str, list[float]] = {}
    for quantization in ("auto", "none"):
        settings = argparse.Namespace(
            pp_size=args.pp_size,
            kv_cache_gb=0.1,
            max_running_requests=8,
            chunked_prefill_size=args.chunked_prefill_size,
            quantization=quantization,
        )
        with serving.served(settings, model) as (url, _):
            logprobs[f"ppserve_{quantization}"] = server_logprobs(url, ids)
    logprobs["transformers"] = reference_logprobs(model, ids)

    ppl = {"llama_cpp": llama["perplexity"]}
    # Its printed figure (4 decimals) and the same from its logits file: they agree when the file
    # was read right, which is what lines its log-probabilities up with ours.
    recomputed = perplexity(llama_logprobs)
    if abs(recomputed - ppl["llama_cpp"]) > 1e-3 * ppl["llama_cpp"]:
        raise RuntimeError(f"llama-perplexity printed {ppl['llama_cpp']}, its logits file gives {recomputed}")
    command = shlex.join(llama.pop("command"))
    figures: dict[str, Any] = {"llama_cpp": {**llama, "perplexity_from_logits_file": recomputed, "command": command}}
    for name, lp in logprobs.items():
        ppl[name] = perplexity(scored(lp, n_ctx))
        figures[name] = {"perplexity": ppl[name], "perplexity_all_tokens": perplexity(lp)}
        print(f"{name}: PPL {ppl[name]:.4f} on the same tokens, {perplexity(lp):.4f} on all {len(lp)}")
    differences = {
        "ppserve_auto_vs_llama_cpp": relative(ppl["ppserve_auto"], ppl["llama_cpp"]),  # the target
        "ppserve_none_vs_transformers": relative(ppl["ppserve_none"], ppl["transformers"]),
        "ppserve_auto_vs_ppserve_none": relative(ppl["ppserve_auto"], ppl["ppserve_none"]),
        "llama_cpp_vs_transformers": relative(ppl["llama_cpp"], ppl["transformers"]),
    }
    token_diff = {  # largest difference of one token's log-probability (llama.cpp's: to about 1e-4)
        "ppserve_auto_vs_llama_cpp": max(
            map(abs, np.subtract(scored(logprobs["ppserve_auto"], n_ctx), llama_logprobs))
        ),
        "ppserve_auto_vs_ppserve_none": max(map(abs, np.subtract(logprobs["ppserve_auto"], logprobs["ppserve_none"]))),
        "ppserve_none_vs_transformers": max(map(abs, np.subtract(logprobs["ppserve_none"], logprobs["transformers"]))),
    }
    float_lp = scored(logprobs["ppserve_none"], n_ctx)
    tokens = {  # against float32 on the scored tokens
        "ppserve_auto_vs_ppserve_none": per_token(scored(logprobs["ppserve_auto"], n_ctx), float_lp),
        "llama_cpp_vs_ppserve_none": per_token(llama_logprobs, float_lp),
        "ppserve_auto_vs_llama_cpp": per_token(scored(logprobs["ppserve_auto"], n_ctx), llama_logprobs),
    }
    met = differences["ppserve_auto_vs_llama_cpp"] <= args.tolerance
    report = {
        "benchmark": "quant_perplexity",
        "model": model.name,
        "text": shown(Path(args.text)),
        "tokens": {
            "text": len(own_ids),
            "window": len(ids),
            # llama-perplexity's scored half of the window, and so everyone's "perplexity"
            "scored": len(scored(logprobs["transformers"], n_ctx)),
            "scored_positions": [n_ctx // 2 + 1, n_ctx - 1],
            "same_tokenization": ids == own_ids,  # llama.cpp's ids of the text and ppserve's
        },
        "scoring": f"tokens {n_ctx // 2 + 1}..{n_ctx - 1} of a {n_ctx}-token window holding the text, each given "
        "every token before it in the window; llama-perplexity read the text "
        f"{COPIES} times over (it needs two windows' worth) with --chunks 1",
        **figures,
        "relative_difference": differences,
        "max_token_logprob_difference": {k: float(v) for k, v in token_diff.items()},
        "token_logprob_difference": tokens,
        "target": {"ppserve_auto_vs_llama_cpp_at_most": args.tolerance, "met": met},
    }
    write_result(Path(args.out), report, args)
    for key, value in differences.items():
        print(f"relative difference {key}: {value:.4%}")
    for key, st in tokens.items():
        mean, size, se = st["mean"], st["mean_abs"], st["standard_error"]
        print(f"per token {key}: mean {mean:+.4f}, mean size {size:.4f}, standard error {se:.4f}")
    print(f"target (ppserve quantized within {args.tolerance:.0%} of llama.cpp): {'met' if met else 'NOT met'}")
    print(f"wrote {args.out}")
    return 0 if met and math.isfinite(ppl["ppserve_auto"]) else 1
