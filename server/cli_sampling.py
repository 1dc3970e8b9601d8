"""`ppserve generate`'s sampling flags, generated from SamplingParams's declaration: one flag per
field, with its type, default, and help (its description and range), so that a new field or a
changed range reaches the command line without being written again here."""

from __future__ import annotations

import argparse
from typing import Any

from ppserve.scheduler.sampling_params import FIELDS, SamplingParams

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


def sampling_params(args: argparse.Namespace, max_tokens: int) -> SamplingParams:
    """The SamplingParams the flags give (a ValueError naming the field if one is out of range)."""
    values: dict[str, Any] = {"max_tokens": max_tokens}
    for spec in FIELDS:
        if spec.name not in NOT_FLAGS:
            value = getattr(args, spec.name)
            values[spec.name] = tuple(value) if spec.many else value
    return SamplingParams(**values)
