"""The `ppserve` command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from ppserve.engine.model.model_config import ConfigError
from ppserve.server.cli_clients import add_client_flags, server_options
from ppserve.server.cli_cluster import run_loop, serve_node
from ppserve.server.cli_engine import add_engine_flags, engine_settings
from ppserve.server.cli_sampling import add_sampling_flags, constraint_flag, sampling_params
from ppserve.server.listen import bind_http
from ppserve.server.version import installed_version

if TYPE_CHECKING:
    from ppserve.engine.async_engine import AsyncEngine
    from ppserve.engine.config import EngineConfig
    from ppserve.engine.outputs import TokenLogprob
    from ppserve.scheduler.sampling_params import SamplingParams
    from ppserve.server.state import ServerOptions

EXIT_USAGE = 2
GENERATE_MAX_TOKENS = 64  # `ppserve generate` without --max-tokens, for a model with no default of its own


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (no usage dump) and exit with code 2."""

    def error(self, message: str) -> NoReturn:
        fail(f"{self.prog}: error: {message}")


def fail(message: str) -> NoReturn:
    print(message, file=sys.stderr)
    sys.exit(EXIT_USAGE)


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError("token ids must be non-negative")
    return ids


def port(text: str) -> int:
    """A TCP port flag's value: 1 to 65535, or 0 for any free one (never wrapped: the OS takes a
    port modulo 65536, so 80000 would have bound 14464)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1 to 65535 (0: any free one), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ppserve", description="Pipeline-parallel LLM serving engine")
    parser.add_argument("--version", action="version", version=f"ppserve {installed_version()}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="{generate,serve,router}")
    gen = sub.add_parser("generate", help="one-shot generation from the terminal")
    add_engine_flags(gen, "generate")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--input-ids", type=_parse_ids, help="prompt token ids, e.g. 1,2,3")
    source.add_argument("--prompts-file", help="one prompt per line, generated as one batch ('-' reads stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    gen.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens to generate (default: the model's generation_config.json max_new_tokens, else "
        f"{GENERATE_MAX_TOKENS})",
    )
    add_sampling_flags(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")

    serve = sub.add_parser("serve", help="serve the HTTP API (OpenAI-compatible, /generate, websocket)")
    add_engine_flags(serve, "serve")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=port, default=8000, help="port (default 8000; 0 picks a free one)")
    add_client_flags(serve)
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    serve.add_argument(
        "--no-playground",
        dest="playground",
        action="store_false",
        help="do not serve the playground page (chat and live pipeline view) at /",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, let requests in flight finish for this long (default 10)",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the least severe messages logged (default info; warning also silences the access log)",
    )
    router = sub.add_parser("router", help="the front of a disaggregated deployment: prefill and decode servers")
    router.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers' HTTP URLs")
    router.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers' HTTP URLs")
    router.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    router.add_argument("--port", type=port, default=8000, help="port (default 8000; 0 picks a free one)")
    router.add_argument(
        "--cluster-key-file",
        default=None,
        metavar="PATH",
        help="the servers' shared secret (or env PPSERVE_CLUSTER_KEY): proves to decode servers that this "
        "router names their prefill server",
    )
    router.add_argument(
        "--insecure-cluster", action="store_true", help="the servers run without a key (--insecure-cluster)"
    )
    router.add_argument(
        "--upstream-read-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="the longest wait between two reads of a decode server's answer; streams have no total limit "
        "(default 600)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `ppserve`: what it can do
        parser.print_help()
        return
    try:
        if args.command == "generate":
            _generate(args)
        elif args.command == "serve":
            _serve(args)
        elif args.command == "router":
            _route(args)
    except (ConfigError, ValueError) as e:
        fail(f"ppserve {args.command}: error: {e}")
    except (RuntimeError, OSError) as e:  # a stage failed to start, the port is taken, ...
        print(f"ppserve {args.command}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C before the event loop took over the signal
        print(f"ppserve {args.command}: interrupted", file=sys.stderr)
        sys.exit(130)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    from ppserve.engine.config import EngineConfig
    from ppserve.server.demo import resolve_model

    return EngineConfig.create(resolve_model(args.model), **engine_settings(args))


def _generate(args: argparse.Namespace) -> None:
    config = _engine_config(args)
    if config.cluster is not None and not config.cluster.is_host:
        serve_node(config)
    max_tokens = args.max_tokens
    if max_tokens is None:
        max_tokens = config.model_config.max_new_tokens or GENERATE_MAX_TOKENS
    params = sampling_params(args, max_tokens)
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
    _sigterm_as_sigint()
    run_loop(_generate_all(config, prompts, params, args.chat, args.json, constraint_flag(args)))


async def _generate_all(
    config: EngineConfig,
    prompts: list[str | list[int]],
    params: SamplingParams,
    chat: bool,
    as_json: bool,
    constraint: str | None,
) -> None:
    """`constraint`: the flag that gave params.grammar, which its errors name."""
    from ppserve.engine.async_engine import AsyncEngine

    if config.synthetic_latency:
        print("ppserve generate: synthetic stages: timing model only, no real output", file=sys.stderr)
    async with AsyncEngine(config) as engine:
        if chat:
            prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": str(p)}]) for p in prompts]
        # Validate every prompt before starting any, so a bad one fails fast with exit code 2.
        encoded = [engine.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        for ids in encoded:
            engine.check_request(ids, params)
        if params.grammar is not None:
            try:
                await engine.check_grammar(params.grammar)
            except ValueError as e:
                raise ValueError(f"{constraint}: {' '.join(str(e).split())}") from None  # one line
        results = await asyncio.gather(*[_one(engine, ids, params) for ids in encoded])
    for ids, result in zip(encoded, results, strict=True):
        if not as_json:
            print(result["text"])
            continue
        print(json.dumps({**result, "prompt_token_ids": ids}))


async def _one(engine: AsyncEngine, prompt_ids: list[int], params: SamplingParams) -> dict[str, object]:
    text, token_ids, logprobs, reason = [], [], [], None
    result: dict[str, object] = {}
    async for out in engine.generate(prompt_ids, params):
        if out.prompt_logprobs is not None:
            result["prompt_logprobs"] = [_logprob_dict(lp) if lp else None for lp in out.prompt_logprobs]
        text.append(out.text)
        token_ids += out.token_ids
        logprobs += [_logprob_dict(lp) for lp in out.logprobs or []]
        reason = out.finish_reason
    result = {"text": "".join(text), "token_ids": token_ids, "finish_reason": reason, **result}
    if params.logprobs is not None:
        result["logprobs"] = logprobs
    return result


def _logprob_dict(lp: TokenLogprob) -> dict[str, object]:
    return {"token_id": lp.token_id, "logprob": lp.logprob, "top_logprobs": [list(t) for t in lp.top_logprobs]}


def _serve(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.node_rank > 0:  # no HTTP here (its flags, API key file included, are node 0's)
        serve_node(_engine_config(args))
    # Before loading anything: a bad key file or a port in use fails in a moment, not after the
    # stages start.
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    options = server_options(args)  # a bad key file or limit fails now, before anything loads
    sockets = bind_http(args.host, args.port)
    try:
        _serve_on(args, options, sockets)
    finally:
        for sock in sockets:  # aiohttp closes those it served on; this is for a failed start
            sock.close()


def _serve_on(args: argparse.Namespace, options: ServerOptions, sockets: list[socket.socket]) -> None:
    from ppserve.server.connections import raise_fd_limit

    config = _engine_config(args)
    raise_fd_limit(options.max_connections)
    run_loop(_serve_until_stopped(config, options, sockets))


async def _serve_until_stopped(config: EngineConfig, options: ServerOptions, sockets: list[socket.socket]) -> None:
    """Start the engine and the HTTP server, print the URL, serve until SIGINT or SIGTERM."""
    from aiohttp import web

    from ppserve.server.access_log import TrafficLogger
    from ppserve.server.app import STATE, create_app, shut_down
    from ppserve.server.connections import GuardedSite

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    # After the drain (shut_down, below), handlers get a moment to write their last events.
    runner = web.AppRunner(
        create_app(config, options),
        handler_cancellation=True,
        shutdown_timeout=options.shutdown_timeout_s + 5.0,
        access_log_class=TrafficLogger,
    )
    try:
        # The stages load here; a Ctrl-C meanwhile stops the start-up (and kills the stages).
        setup = asyncio.ensure_future(runner.setup())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([setup, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not setup.done():
            setup.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await setup
            print("ppserve: start-up interrupted", flush=True)
            return
        stopped.cancel()
        setup.result()
        for sock in sockets:
            await GuardedSite(runner, sock).start()
        for addr in runner.addresses:
            h, p = addr[0], addr[1]
            url = f"http://[{h}]:{p}" if ":" in h else f"http://{h}:{p}"
            synthetic = " (synthetic stages: timing model only, no real output)" if config.synthetic_latency else ""
            print(
                f"ppserve: serving {options.served_model_name!r} with {config.pp_size} pipeline stage(s) at {url}"
                + synthetic,
                flush=True,
            )
            if options.playground:
                print(f"ppserve: playground at {url}/", flush=True)
        if (pd := runner.app[STATE].disaggregation()) is not None:
            print(f"ppserve: {pd['mode']} side of a disaggregated pair; bootstrap at {pd['bootstrap']}", flush=True)
        await stop.wait()
        stop.clear()
        print(f"ppserve: shutting down (requests in flight get up to {options.shutdown_timeout_s:g} s; "
              "Ctrl-C again to stop at once)", flush=True)  # fmt: skip
        # Drain while still listening, so that /health answers 503 meanwhile (runner.cleanup
        # stops listening first, then shuts the app down). A second signal ends the drain: the
        # engine closes at once, its streams end with an error, its stages and memory are freed.
        drain = asyncio.ensure_future(shut_down(runner.app))
        again = asyncio.ensure_future(stop.wait())
        await asyncio.wait([drain, again], return_when=asyncio.FIRST_COMPLETED)
        again.cancel()
        if not drain.done():
            drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drain
            print("ppserve: stopping at once", flush=True)
            if (engine := runner.app[STATE].engine) is not None:
                await engine.close()
        else:
            drain.result()
    finally:
        await runner.cleanup()


def _route(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for url in [*args.prefill, *args.decode]:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"expected a server's URL such as http://10.0.0.2:8000, got {url!r}")
    from ppserve.transport.cluster_key import load_key

    key = load_key(args.cluster_key_file)
    if key is None and not args.insecure_cluster:
        raise ValueError(
            "the router needs the servers' shared secret: --cluster-key-file PATH or env PPSERVE_CLUSTER_KEY "
            "(or --insecure-cluster, as the servers)"
        )
    if key is not None and args.insecure_cluster:
        raise ValueError("--insecure-cluster and a cluster key exclude each other")
    if not (math.isfinite(args.upstream_read_timeout) and args.upstream_read_timeout > 0):
        raise ValueError(f"--upstream-read-timeout must be positive seconds, got {args.upstream_read_timeout}")
    sockets = bind_http(args.host, args.port)
    from ppserve.server.router import serve_router

    if key is None:
        logging.getLogger("ppserve.router").warning("--insecure-cluster: the servers behind take rooms from anyone")
    run_loop(serve_router(args.prefill, args.decode, sockets, key, args.upstream_read_timeout))


def _sigterm_as_sigint() -> None:
    """Treat SIGTERM like Ctrl-C, so that `ppserve generate` cleans up its stages either way."""
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))


if __name__ == "__main__":
    main()
