"""The `ppserve` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import NoReturn

from engine.model_config import ConfigError

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
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            _generate(args)
    except (ConfigError, ValueError) as e:
        fail(f"ppserve {args.command}: error: {e}")


def _generate(args: argparse.Namespace) -> None:
    from engine.config import EngineConfig
    from engine.local_pipeline import LocalPipeline
    from engine.tokenizer import Tokenizer
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
        ignore_eos=args.ignore_eos,
    )
    if args.chunked_prefill_size < 1:
        raise ValueError(f"--chunked-prefill-size must be >= 1, got {args.chunked_prefill_size}")
    config = EngineConfig.create(
        args.model,
        pp_size=args.pp_size,
        layer_partition=args.layer_partition,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_gb=args.kv_cache_gb,
        max_model_len=args.max_model_len,
    )
    tokenizer = Tokenizer(args.model)
    if args.input_ids is not None:
        if args.chat:
            raise ValueError("--chat needs --prompt, not --input-ids")
        prompt_ids = args.input_ids
        vocab = config.model_config.vocab_size
        if max(prompt_ids) >= vocab:
            raise ValueError(f"--input-ids: token id {max(prompt_ids)} is outside the vocabulary (size {vocab})")
    elif args.chat:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    result = LocalPipeline(config).generate([prompt_ids], params, chunk_size=args.chunked_prefill_size)[0]
    text = tokenizer.decode(result.token_ids)
    if not args.json:
        print(text)
        return
    out: dict[str, object] = {
        "text": text,
        "token_ids": result.token_ids,
        "prompt_token_ids": prompt_ids,
        "finish_reason": result.finish_reason.value,
    }
    if params.logprobs is not None:
        out["logprobs"] = [
            {"token_id": s.token_id, "logprob": s.logprob, "top_logprobs": [list(t) for t in s.top_logprobs]}
            for s in result.samples
        ]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
