"""The `ppserve` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, NoReturn

from engine.model_config import ConfigError

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from scheduler.sampling_params import SamplingParams

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (no usage dump) and exit with code 2."""

    def error(self, message: str) -> NoReturn:
        fail(f"{self.prog}: error: {message}")


def fail(message: str) -> NoReturn:
    print(message, file=sys.stderr)
    sys.exit(EXIT_USAGE)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--pp-size", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--layer-partition", default=None, help="layers per stage, e.g. 3,3,4 (default: even split)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (auto: float32 on CPU)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache memory per stage, GiB")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--chunked-prefill-size", type=int, default=512, help="prompt tokens per prefill chunk")
    p.add_argument(
        "--tensor-transport",
        default="auto",
        choices=["auto", "shm", "gloo", "nccl", "zmq"],
        help="how activations travel between stages (auto: nccl on CUDA, else shm)",
    )
    p.add_argument("--max-running-requests", type=int, default=256)


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError("token ids must be non-negative")
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ppserve", description="Pipeline-parallel LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="one-shot generation from the terminal")
    _add_model_flags(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--input-ids", type=_parse_ids, help="prompt token ids, e.g. 1,2,3")
    source.add_argument("--prompts-file", help="one prompt per line, generated as one batch ('-' reads stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--logprobs", type=int, default=None, help="also return the top N logprobs (N <= 20)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            _generate(args)
    except (ConfigError, ValueError) as e:
        fail(f"ppserve {args.command}: error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)


def _generate(args: argparse.Namespace) -> None:
    from engine.config import EngineConfig
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        logprobs=args.logprobs,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    config = EngineConfig.create(
        args.model,
        pp_size=args.pp_size,
        layer_partition=args.layer_partition,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_gb=args.kv_cache_gb,
        max_model_len=args.max_model_len,
        tensor_transport=args.tensor_transport,
        chunked_prefill_size=args.chunked_prefill_size,
        max_running_requests=args.max_running_requests,
    )
    if args.chat and args.prompt is None:
        raise ValueError("--chat needs --prompt")
    if args.prompts_file is not None:
        stream = sys.stdin if args.prompts_file == "-" else open(args.prompts_file, encoding="utf-8")  # noqa: SIM115
        with stream:
            prompts: list[str | list[int]] = [line.rstrip("\n") for line in stream if line.strip()]
        if not prompts:
            raise ValueError(f"no prompts in {args.prompts_file}")
    else:
        prompts = [args.input_ids if args.input_ids is not None else args.prompt]
    if any(p == "" for p in prompts):
        raise ValueError("the prompt is empty")
    _run(_generate_all(config, prompts, params, args.chat, args.json))


async def _generate_all(
    config: EngineConfig, prompts: list[str | list[int]], params: SamplingParams, chat: bool, as_json: bool
) -> None:
    from engine.async_engine import AsyncEngine

    async with AsyncEngine(config) as engine:
        if chat:
            prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": str(p)}]) for p in prompts]
        # Validate every prompt before starting any, so a bad one fails fast with exit code 2.
        encoded = [engine.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        for ids in encoded:
            engine.check_prompt(ids, params)
        results = await asyncio.gather(*[_one(engine, ids, params) for ids in encoded])
    for ids, result in zip(encoded, results, strict=True):
        if not as_json:
            print(result["text"])
            continue
        print(json.dumps({**result, "prompt_token_ids": ids}))


async def _one(engine: AsyncEngine, prompt_ids: list[int], params: SamplingParams) -> dict[str, object]:
    text, token_ids, logprobs, reason = [], [], [], None
    async for out in engine.generate(prompt_ids, params):
        text.append(out.text)
        token_ids += out.token_ids
        logprobs += [
            {"token_id": lp.token_id, "logprob": lp.logprob, "top_logprobs": [list(t) for t in lp.top_logprobs]}
            for lp in out.logprobs or []
        ]
        reason = out.finish_reason
    result: dict[str, object] = {"text": "".join(text), "token_ids": token_ids, "finish_reason": reason}
    if params.logprobs is not None:
        result["logprobs"] = logprobs
    return result


def _run(coro: Coroutine[object, object, None]) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


if __name__ == "__main__":
    main()
