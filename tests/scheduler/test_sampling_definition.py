"""SamplingParams is the one definition of the sampling parameters: every other form of them (the
wire struct, the HTTP request structs, the OpenAPI document, `ppserve generate`'s flags) agrees
with it field by field, default by default and bound by bound. A field added or a range changed
in one place only fails here."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import msgspec
import pytest

from ppserve.scheduler.sampling_fields import FieldSpec
from ppserve.scheduler.sampling_params import BY_NAME, FIELDS, HOST_ONLY, OWN_FORM, SamplingParams
from ppserve.server.cli import build_parser
from ppserve.server.cli_sampling import NOT_FLAGS, sampling_params
from ppserve.server.json_body import decode
from ppserve.server.openapi import openapi_schema
from ppserve.server.protocol import ChatRequest, CompletionRequest, NativeSampling
from ppserve.transport.messages import WireSamplingParams

# Every field set to a value other than its default (and within its range).
ODD = SamplingParams(
    max_tokens=7,
    temperature=0.7,
    top_k=5,
    top_p=0.9,
    min_p=0.05,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    repetition_penalty=1.2,
    seed=3,
    logprobs=2,
    prompt_logprobs=1,
    stop_token_ids=(9,),
    stop=("end",),
    ignore_eos=True,
    logit_bias=((5, -100.0), (9, 2.5)),
    grammar='start: "yes" | "no"',
)
# HTTP spellings: a list for a tuple, and OpenAI's own forms of some fields (checked below).
_HTTP_ONLY = {"max_tokens", "logprobs", "prompt_logprobs"}
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength")


def test_every_field_differs_from_its_default_in_odd() -> None:
    assert all(getattr(ODD, s.name) != s.default for s in FIELDS)


def test_the_wire_struct_is_every_field_the_last_stage_needs() -> None:
    wire = msgspec.structs.fields(WireSamplingParams)
    own = {f.name for f in dataclasses.fields(SamplingParams) if f.metadata == OWN_FORM}
    assert own == {"logit_bias", "grammar"}
    assert {f.name for f in wire} == {s.name for s in FIELDS} - HOST_ONLY | own
    hints = typing.get_type_hints(WireSamplingParams)
    for f in wire:
        if f.name in own:
            continue
        spec = BY_NAME[f.name]
        assert hints[f.name] == (spec.kind | None if spec.optional else spec.kind), f.name
        if f.default is not msgspec.NODEFAULT:
            assert f.default == spec.default, f.name
    host = {name: getattr(ODD, name) for name in HOST_ONLY}
    assert SamplingParams.from_wire(ODD.wire(), **host) == ODD
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ODD.wire()), type=WireSamplingParams) == ODD.wire()


@pytest.mark.parametrize("struct", [NativeSampling, CompletionRequest, ChatRequest])
def test_the_http_structs_have_every_field_with_its_default(struct: type[msgspec.Struct]) -> None:
    fields = {f.name: f for f in msgspec.structs.fields(struct)}
    for spec in FIELDS:
        if spec.name in _HTTP_ONLY:
            continue
        default = fields[spec.name].default
        if default is msgspec.NODEFAULT:
            default = fields[spec.name].default_factory()
        if spec.name == "stop":  # one string, a list of them, or null (none)
            assert default is None
        else:
            assert default == (list(spec.default) if spec.many else spec.default), spec.name


def test_an_http_body_reaches_the_engine_as_the_same_params() -> None:
    body = {f: getattr(ODD, f) for f in BY_NAME if f not in ("prompt_logprobs",)}
    native = decode(msgspec.json.encode(body), NativeSampling)
    assert native.params(ODD.max_tokens) == SamplingParams(**{**body, "prompt_logprobs": None})
    completion = decode(msgspec.json.encode({"prompt": "x", **body, "echo": True}), CompletionRequest)
    assert completion.sampling_params(7, completion.logprobs, completion.prompt_logprobs).prompt_logprobs == 2


def _branches(schema: dict[str, Any], json_type: str) -> list[dict[str, Any]]:
    """The nodes of `schema` of that JSON type, through anyOf and items."""
    found = [schema] if schema.get("type") == json_type else []
    for branch in schema.get("anyOf", []):
        found += _branches(branch, json_type)
    if isinstance(schema.get("items"), dict):
        found += _branches(schema["items"], json_type)
    return found


def _expected(spec: FieldSpec) -> tuple[str, dict[str, Any]]:
    schema = msgspec.json.schema(spec.value_type)
    return schema.pop("type"), {k: v for k, v in schema.items() if k in _BOUNDS}


@pytest.mark.parametrize("body", ["NativeSampling", "CompletionRequest", "ChatRequest"])
def test_the_openapi_document_has_the_declared_ranges(body: str) -> None:
    properties = openapi_schema()["components"]["schemas"][body]["properties"]
    named = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"}
    checked = set()
    for field, prop in properties.items():
        spec = BY_NAME.get(named.get(field, field))
        if spec is None:
            continue
        json_type, bounds = _expected(spec)
        if (body, field) == ("CompletionRequest", "max_tokens"):
            bounds["minimum"] = 0  # with echo, 0 scores the prompt only
        branches = _branches(prop, json_type)
        if field == "logprobs" and body == "ChatRequest":
            assert not branches and _branches(prop, "boolean")  # OpenAI's chat form: a flag
            continue
        assert branches, (body, field)
        for branch in branches:
            assert {k: v for k, v in branch.items() if k in _BOUNDS} == bounds, (body, field, branch)
        checked.add(spec.name)
    assert checked >= {s.name for s in FIELDS} - {"prompt_logprobs", "ignore_eos"}


def test_every_field_has_its_flag_with_its_default() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert sampling_params(args, ODD.max_tokens) == SamplingParams(max_tokens=ODD.max_tokens)
    argv = ["generate", "--prompt", "x"]
    for spec in FIELDS:
        if spec.name in NOT_FLAGS:
            continue
        flag = "--" + spec.name.replace("_", "-")
        value = getattr(ODD, spec.name)
        if spec.kind is bool:
            argv.append(flag)
        elif spec.many:
            argv += [a for v in value for a in (flag, str(v))]
        else:
            argv += [flag, str(value)]
    params = sampling_params(build_parser().parse_args(argv), ODD.max_tokens)
    assert params == SamplingParams(**{**{s.name: getattr(ODD, s.name) for s in FIELDS}, "stop_token_ids": ()})
