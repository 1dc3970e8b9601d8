"""python -m benchmarks NAME [ARGS...]: run one benchmark or tool (see --help for the names)."""

from __future__ import annotations

import importlib
import sys

from benchmarks.harness import record

# name: (module, what it does). Modules are imported only when run: some load torch.
COMMANDS: dict[str, tuple[str, str]] = {
    # Benchmarks, each writing benchmarks/results/*.json
    "ab": ("ab", "serving throughput of a base revision against this checkout, in alternating rounds"),
    "big-model": ("big_model", "a model bigger than one node, on four memory-capped namespace nodes (root)"),
    "chunking": ("chunking", "dynamic against fixed prefill chunks: time to first token of long prompts"),
    "embeddings": ("embeddings", "/v1/embeddings against the same inputs through /v1/completions"),
    "hostile": ("hostile", "a bystander's stream while hostile requests arrive"),
    "kernel-choice": ("kernel_choice", "the kernel chooser's table on this machine"),
    "kquant": ("kquant", "ppserve on two Q4_K_M files against llama.cpp on the same files"),
    "kquant-reference": ("kquant_reference", "llama.cpp's perplexity on the K-quant GGUFs: the reference figures"),
    "model": ("model", "model-core speed against transformers on the same weights"),
    "moe": ("moe", "ppserve against llama.cpp on a Qwen3-MoE-shaped GGUF"),
    "multinode": ("multinode", "PP=4 on one host against four network-namespace nodes, and with Ray (root)"),
    "pd": ("pd", "prefill/decode disaggregation against colocated serving"),
    "peers": ("peers", "ppserve against vLLM's CPU build and llama-server, side by side"),
    "pipeline": ("pipeline", "PP=2 over PP=1 decode, scheduler and transport overhead, tensor channels"),
    "prefix-cache": ("prefix_cache", "multi-turn chat with the prefix cache on and off"),
    "quant": ("quant", "weight-only quantized GEMMs against the packed float linears"),
    "quant-quality": ("quant_quality", "perplexity of the demo model's Q4_1 GGUF against llama.cpp's"),
    "serving": ("serving", "an OpenAI-API load generator; HTTP server against in-process AsyncEngine"),
    "speculative": ("speculative", "speculative decoding on and off, and llama-server's n-gram lookup"),
    "structured": ("structured", "what a JSON schema costs: constrained against unconstrained requests"),
    "all": ("run_all", "rerun the benchmarks that need neither the peers nor root, then the tables"),
    # Results and tools
    "tables": ("tables", "render the documentation's tables from the results JSONs (--check: compare only)"),
    "eval-perplexity": ("eval_perplexity", "the perplexity of a text through a server, against transformers"),
    "plot-timeline": ("plot_timeline", "draw a pipeline timeline (GET /debug/timeline or a saved trace)"),
    "make-tiny-checkpoint": ("make_tiny_checkpoint", "write a small random Hugging Face checkpoint"),
    "make-big-gguf": ("make_big_gguf", "write the Llama-3-8B-shaped random Q4_K_M GGUF, once per machine"),
    "make-moe-gguf": ("make_moe_gguf", "write the Qwen3-MoE-shaped random GGUF, once per machine"),
    "fetch-gemma3": ("fetch_gemma3", "fetch Gemma 3 270M's Q4_K_M GGUF into the cache, checked by sha256"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: python -m benchmarks NAME [ARGS...]   (from the repository root)",
        "       python -m benchmarks NAME --help      (that one's arguments)",
        "       python -m benchmarks --names          (the names alone, one a line)",
        "",
        "names:",
    ]
    lines += [f"  {name:{width}s}  {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    if args[0] == "--names":
        print("\n".join(COMMANDS))
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"benchmarks: unknown name {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{COMMANDS[name][0]}")
    record.SCRIPT = module.__file__
    # What the benchmark's argparse names itself, and what its record's `argv` holds.
    sys.argv = [f"python -m benchmarks {name}", *rest]
    code = module.main(rest)
    return int(code or 0)


if __name__ == "__main__":  # not when a stage process, spawned, re-imports this module
    sys.exit(main())
