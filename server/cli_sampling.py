"""`ppserve generate`'s sampling flags, generated from SamplingParams's declaration: one flag per
field, with its type, default, and help (its description and range), so that a new field or a
changed range reaches the command line without being written again here. The fields with a form
of their own (a grammar, a logit bias) have flags written here: --json-schema, --regex, --choice,
--grammar, --json-object, --logit-bias."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ppserve.scheduler.sampling_params import FIELDS, SamplingParams
from ppserve.server.structured import strict_schema

# Fields without a flag of their own: max_tokens has one in cli.py, whose default is the model's
# rather than SamplingParams'; stop token ids are for programs (which use the API), a person at a
# terminal stops on text (--stop).
NOT_FLAGS = frozenset({"max_tokens", "stop_token_ids"})


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    for spec in FIELDS:
        if spec.name in NOT_FLAGS:
            continue
        flag = "--" + spec.name.replace("_", "-")
        if spec.kind is bool:
            parser.add_argument(flag, action="store_true", help=spec.description)
        elif spec.many:
            help = f"{spec.description}; each {spec.phrase()} (repeatable)"
            parser.add_argument(flag, type=spec.kind, action="append", default=[], help=help)
        else:
            default = "" if spec.optional else f"; default {spec.default}"
            help = f"{spec.description} ({spec.phrase()}{default})"
            parser.add_argument(flag, type=spec.kind, default=spec.default, help=help)
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema", metavar="SCHEMA", help="output JSON valid for this schema (@FILE reads one)"
    )
    constraint.add_argument("--json-object", action="store_true", help="output one JSON object")
    constraint.add_argument("--regex", help="output text matching this regular expression")
    constraint.add_argument("--choice", action="append", help="output exactly one of these texts (repeatable)")
    constraint.add_argument("--grammar", help="output text of this EBNF/Lark grammar (@FILE reads one)")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="with --json-schema: OpenAI's strict mode (every object closed, all its properties required)",
    )
    parser.add_argument(
        "--logit-bias", action="append", default=[], metavar="TOKEN=BIAS", help="add BIAS to TOKEN's logit (repeatable)"
    )


def sampling_params(args: argparse.Namespace, max_tokens: int) -> SamplingParams:
    """The SamplingParams the flags give (a ValueError naming the field if one is out of range)."""
    values: dict[str, Any] = {"max_tokens": max_tokens}
    for spec in FIELDS:
        if spec.name not in NOT_FLAGS:
            value = getattr(args, spec.name)
            values[spec.name] = tuple(value) if spec.many else value
    return SamplingParams(**values, grammar=_grammar(args), logit_bias=tuple(_bias(b) for b in args.logit_bias))


def constraint_flag(args: argparse.Namespace) -> str | None:
    """The constraint flag given (--json-schema, --regex, ...), if one is."""
    given = _given(args)
    return "--" + given[0].replace("_", "-") if given else None


def _grammar(args: argparse.Namespace) -> str | None:
    """The grammar text that the constraint flags ask for (ValueError naming the flag if invalid)."""
    given = _given(args)
    if getattr(args, "strict", False) and (given is None or given[0] != "json_schema"):
        raise ValueError("--strict applies to --json-schema")
    if given is None:
        return None
    from ppserve.engine.model.grammar import build_grammar  # (torch: not for --help or a bad flag)

    name, kind, read = given
    try:
        spec = read(getattr(args, name))
        return build_grammar(kind, strict_schema(spec) if args.strict else spec)
    except (ValueError, OSError) as e:
        raise ValueError(f"{constraint_flag(args)}: {e}") from None


def _given(args: argparse.Namespace) -> tuple[str, str, Callable[[Any], Any]] | None:
    """The CONSTRAINT_FLAGS entry of the constraint flag given (argparse lets at most one be)."""
    return next((c for c in CONSTRAINT_FLAGS if getattr(args, c[0]) not in (None, False)), None)


def _schema(value: str) -> Any:
    try:
        return json.loads(_text(value))
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None


def _text(value: str) -> str:
    """A flag's text, or with @FILE the file's."""
    return Path(value[1:]).read_text(encoding="utf-8") if value.startswith("@") else value


# (flag's attribute, build_grammar's kind, the flag's value -> its spec), one flag per kind.
CONSTRAINT_FLAGS: tuple[tuple[str, str, Callable[[Any], Any]], ...] = (
    ("json_schema", "json", _schema),
    ("json_object", "json_object", lambda _: None),
    ("regex", "regex", str),
    ("choice", "choice", list),
    ("grammar", "grammar", _text),
)


def _bias(entry: str) -> tuple[int, float]:
    token, _, bias = entry.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise ValueError(f"--logit-bias wants TOKEN=BIAS (e.g. 42=-100), got {entry!r}") from None
