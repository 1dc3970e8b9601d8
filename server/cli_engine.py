"""The `ppserve` flags that set the engine (generate and serve), and the EngineConfig.create
keywords they make (kept apart from cli.py, which is about the commands)."""

from __future__ import annotations

import argparse
from typing import Any

from ppserve.server.cli_cluster import add_cluster_flags, cluster_config, disaggregation_options, ray_config

# The flags that set the engine: argparse dest -> EngineConfig.create's keyword. Each flag's default
# is the one create() takes (tests/test_config_chain.py), so a flag left out and a flag given its
# default make the same config.
ENGINE_FLAGS = {
    "pp_size": "pp_size",
    "layer_partition": "layer_partition",
    "dtype": "dtype",
    "quantization": "quantization",
    "device": "device",
    "gpu_ids": "gpu_ids",
    "block_size": "block_size",
    "kv_cache_gb": "kv_cache_gb",
    "max_model_len": "max_model_len",
    "chunked_prefill_size": "chunked_prefill_size",
    "max_batched_tokens": "max_batched_tokens",
    "tensor_transport": "tensor_transport",
    "max_running_requests": "max_running_requests",
    "enable_dynamic_chunking": "dynamic_chunking",
    "enable_prefix_caching": "enable_prefix_caching",
    "speculative": "speculative",
    "num_speculative_tokens": "num_speculative_tokens",
    "dynamic_chunking_smooth_factor": "chunk_smooth",
    "stage_timeout": "stage_timeout_s",
    "stage_start_timeout": "stage_start_timeout_s",
    "max_stage_restarts": "max_stage_restarts",
    "synthetic_latency": "synthetic_latency",
    "max_waiting_requests": "max_waiting_requests",  # serve only
    "max_requests_per_client": "max_requests_per_client",  # serve only
}


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="a Hugging Face checkpoint directory, a .gguf file, or tiny-random (a small random model for tests) "
        "(default: the demo model, SmolLM2-135M-Instruct, downloaded once)",
    )
    p.add_argument("--pp-size", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--layer-partition", default=None, help="layers per stage, e.g. 3,3,4 (default: even split)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (auto: float32 on CPU)")
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8"],
        help="weight-only quantized linears: auto keeps a GGUF's Q8_0/Q4_0/Q4_1 weights quantized (int8, int4), "
        "none dequantizes every weight to --dtype, int8 quantizes every linear to int8 (default: auto)",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the stages compute (default cpu)")
    p.add_argument(
        "--gpu-ids",
        type=_parse_gpu_ids,
        default=(),
        metavar="IDS",
        help="CUDA devices for the stages, e.g. 2,3 (default: every visible one); stage k runs on the k-th, "
        "neighbouring stages share when there are fewer devices than stages",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache memory per stage, GiB (default 1)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument(
        "--chunked-prefill-size", type=int, default=512, help="prompt tokens per prefill chunk (default 512)"
    )
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="new tokens per micro-batch, all requests together: what sizes a stage's activations (default 2048, "
        "or the prefill chunk size if larger)",
    )
    p.add_argument(
        "--tensor-transport",
        default="auto",
        choices=["auto", "shm", "gloo", "nccl", "zmq"],
        help="how activations travel between stages (auto: nccl on CUDA with a GPU per stage, else shm)",
    )
    p.add_argument("--max-running-requests", type=int, default=256, help="requests computed at once (default 256)")
    p.add_argument(
        "--enable-dynamic-chunking",
        action="store_true",
        help="shrink later prefill chunks of a long prompt so every chunk takes equal time (profiles at start-up)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of prompt prefixes seen before (a shared system prompt, a conversation's earlier "
        "turns) instead of computing it again (default: on)",
    )
    p.add_argument(
        "--speculative",
        default="ngram",
        choices=["off", "ngram", "suffix"],
        help="speculative decoding with drafts from the text already seen: ngram looks up the request's own "
        "prompt and output, suffix also recent requests' (per tenant); each request's draft length follows its "
        "acceptance and drops to 0 where the batch is compute-bound; output is the same as off (default: ngram)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=8,
        help="drafts per request and step at most (default 8)",
    )
    p.add_argument(
        "--dynamic-chunking-smooth-factor",
        type=float,
        default=None,
        help="0 = fixed chunks .. 1 = follow the latency model strictly (default 0.75, or env "
        "PPSERVE_DYNAMIC_CHUNKING_SMOOTH_FACTOR)",
    )
    p.add_argument(
        "--stage-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a live stage silent this long is declared hung, killed and replaced (default 10; a dead "
        "process is noticed at once)",
    )
    p.add_argument(
        "--stage-start-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="how long the stages may take to start (load, build the CPU kernels, profile) before the start "
        "fails (default 120)",
    )
    p.add_argument(
        "--max-stage-restarts",
        type=int,
        default=3,
        help="failed stages replaced per 10 minutes before the engine gives up (default 3; 0: never replace)",
    )
    add_cluster_flags(p)
    p.add_argument(
        "--synthetic-latency",
        type=_parse_latency,
        default=None,
        metavar="A,B,C",
        help="synthetic stages: no math, each micro-batch waits a*attention + b*tokens (whole model, split by "
        "layers) + c seconds per stage; output is labelled synthetic",
    )


def _parse_gpu_ids(text: str) -> tuple[int, ...]:
    from ppserve.engine.cluster.devices import parse_gpu_ids

    try:
        return parse_gpu_ids(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--gpu-ids: ")) from None


def _parse_latency(text: str) -> tuple[float, float, float]:
    try:
        a, b, c = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected three numbers A,B,C, got {text!r}") from None
    return a, b, c


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig.create's keywords from the parsed flags (a command's own flags only)."""
    settings = {kw: getattr(args, dest) for dest, kw in ENGINE_FLAGS.items() if hasattr(args, dest)}
    return {**settings, "cluster": cluster_config(args), "ray": ray_config(args), **disaggregation_options(args)}
