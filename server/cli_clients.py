"""The `ppserve serve` flags about clients, and the ServerOptions they make: API keys (one
tenant each), which browser pages may open /ws, limits on what a request may send, and on the
connections clients hold (kept apart from cli.py, which is about the commands)."""

from __future__ import annotations

import argparse
import functools
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when used: `ppserve router` and `--help` need no engine
    from ppserve.server.limits import RequestLimits
    from ppserve.server.state import ServerOptions


def add_client_flags(serve: argparse.ArgumentParser) -> None:
    key = serve.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' (or env PPSERVE_API_KEY, or --api-key-file); repeat it for "
        "several keys, one tenant each",
    )
    key.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="read the API keys from PATH, one per non-empty line (unlike --api-key, not visible in the process "
        "list; default: none)",
    )
    serve.add_argument(
        "--admin-key",
        default=None,
        help="the key of admin endpoints (or env PPSERVE_ADMIN_KEY): /flush_cache with it empties every tenant's "
        "cached prefixes; with a tenant's API key, only that tenant's (default: none)",
    )
    serve.add_argument(
        "--prefix-cache-scope",
        choices=["api-key", "shared"],
        default="api-key",
        help="who shares cached prompt prefixes: requests with the same API key (a tenant), or all; a request's "
        "cache_salt separates further either way (default: api-key)",
    )
    serve.add_argument(
        "--allowed-origins",
        type=_parse_origins,
        default=(),
        metavar="ORIGINS",
        help="comma-separated origins (https://app.example.com) whose web pages may open /ws, besides the "
        "server's own; * allows all (default: none)",
    )
    _add_limit_flags(serve)
    serve.add_argument(
        "--keepalive-timeout", type=float, default=30.0, metavar="S", help="close idle connections after S (default 30)"
    )
    serve.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="a request's headers, then its body, must arrive within this (default 30)",
    )
    serve.add_argument(
        "--max-connections", type=int, default=4096, metavar="N", help="past N open connections, 503 (default 4096)"
    )
    serve.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    """Limits on the lists and strings of a request (server/limits.py says why each default)."""
    from ppserve.server.limits import RequestLimits

    d = RequestLimits()
    limit = functools.partial(p.add_argument, type=int, metavar="N")
    limit("--max-stop", default=d.max_stop, help=f"stop strings per request (default {d.max_stop})")
    limit("--max-stop-chars", default=d.max_stop_chars, help=f"characters per stop string (default {d.max_stop_chars})")
    limit(
        "--max-stop-token-ids",
        default=d.max_stop_token_ids,
        help=f"stop token ids per request (default {d.max_stop_token_ids})",
    )
    limit("--max-messages", default=d.max_messages, help=f"chat messages per request (default {d.max_messages})")
    limit(
        "--max-content-parts",
        default=d.max_content_parts,
        help=f"content parts per chat message (default {d.max_content_parts})",
    )


def _limits(args: argparse.Namespace) -> RequestLimits:
    from ppserve.server.limits import RequestLimits

    return RequestLimits(
        max_stop=args.max_stop,
        max_stop_chars=args.max_stop_chars,
        max_stop_token_ids=args.max_stop_token_ids,
        max_messages=args.max_messages,
        max_content_parts=args.max_content_parts,
    )


def server_options(args: argparse.Namespace) -> ServerOptions:
    """ValueError (a usage error) for a bad key file, limit or timeout."""
    from ppserve.server.demo import model_name
    from ppserve.server.state import ServerOptions

    api_keys = args.api_key or (_read_key_file(args.api_key_file) if args.api_key_file else [])
    if any(not key.strip() for key in api_keys):
        raise ValueError("--api-key must not be empty")
    admin_key = args.admin_key if args.admin_key is not None else os.environ.get("PPSERVE_ADMIN_KEY") or None
    if admin_key is not None and (not admin_key.strip() or admin_key in api_keys):
        raise ValueError("--admin-key must be non-empty and differ from every --api-key")
    return ServerOptions(
        shutdown_timeout_s=args.shutdown_timeout,
        served_model_name=args.served_model_name or model_name(args.model),
        # The variable holds one key (several tenants: --api-key-file).
        api_keys=tuple(api_keys) or tuple(filter(None, [os.environ.get("PPSERVE_API_KEY")])),
        prefix_cache_scope=args.prefix_cache_scope,
        admin_key=admin_key,
        host=args.host,
        allowed_origins=args.allowed_origins,
        playground=args.playground,
        limits=_limits(args),
        metrics_public=args.metrics_public,
        keepalive_timeout_s=args.keepalive_timeout,
        read_timeout_s=args.read_timeout,
        max_connections=args.max_connections,
    )


def _parse_origins(text: str) -> tuple[str, ...]:
    from ppserve.server.security import parse_origins

    try:
        return parse_origins(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--allowed-origins: ")) from None


def _read_key_file(path: str) -> list[str]:
    """The API keys: one per non-empty line of `path`, stripped (one tenant each). A missing
    file, or one without a key, is a usage error."""
    try:
        with open(path, encoding="utf-8") as f:
            keys = [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    if not keys:
        raise ValueError(f"--api-key-file: {path} is empty (it needs one key per line)")
    return keys
