"""Grammars and schemas built by hypothesis, nested, recursive and repetitive, within and past the
limits: each is refused (a 400: `build_grammar` or the grammar worker says why), or it constrains
the output, which then ends valid or with a visible error, never as a normal stop that breaks it."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppserve.engine.model.grammar import Grammars, build_grammar
from ppserve.engine.model.grammar_check import GrammarChecker
from ppserve.engine.model.sampler import Sampler
from ppserve.engine.model.tokenizer import Tokenizer
from ppserve.scheduler.sampling_params import SamplingParams

STEPS = 24  # tokens sampled per accepted grammar

# ---- regexes: groups in groups, alternatives, repeats small and huge -------------------------

_ATOM = st.sampled_from(["a", "b", "[ab]", "[0-9]", "x"])


def _regex_node(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    repeat = st.sampled_from(["", "?", "*", "+", "{2}", "{1,3}", "{1000}", "{100000}"])
    return st.one_of(
        st.tuples(children, repeat).map(lambda t: f"({t[0]}){t[1]}"),
        st.lists(children, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")"),
        st.lists(children, min_size=2, max_size=3).map("".join),
    )


REGEXES = st.one_of(
    st.recursive(_ATOM, _regex_node, max_leaves=12),
    st.integers(1, 400).map(lambda depth: "(" * depth + "a" + ")" * depth),  # within and past the nesting limit
)

# ---- EBNF/Lark grammars: chains of rules, alternatives, recursion ---------------------------


def _chain(rules: int, recursive: bool) -> str:
    tail = 'a{n}: "x" | "y" a{n}' if recursive else 'a{n}: "x"'
    lines = ["start: a0", *(f"a{i}: a{i + 1}" for i in range(rules)), tail.format(n=rules)]
    return "\n".join(lines)


GRAMMARS = st.builds(_chain, st.one_of(st.integers(0, 30), st.integers(400, 800)), st.booleans())

# ---- JSON schemas: nested objects and arrays, bounded and not, $ref recursion ------------------

_LEAF = st.sampled_from(
    [
        {"type": "integer", "minimum": 0, "maximum": 99},
        {"type": "string", "maxLength": 6},
        {"type": "boolean"},
        {"enum": ["p", "q"]},
        {"type": "string", "pattern": "^(a+)+$", "maxLength": 5},
    ]
)


def _schema_node(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        children.map(lambda c: {"type": "array", "items": c, "maxItems": 2}),
        st.dictionaries(st.sampled_from(["k", "v", "w"]), children, min_size=1, max_size=2).map(
            lambda p: {"type": "object", "properties": p, "required": sorted(p), "additionalProperties": False}
        ),
        st.lists(children, min_size=2, max_size=3).map(lambda xs: {"anyOf": xs}),
    )


SCHEMAS = st.one_of(
    st.recursive(_LEAF, _schema_node, max_leaves=10),
    st.just({"$ref": "#"}),
    st.just({"type": "array", "items": {"$ref": "#"}, "maxItems": 2}),
    st.integers(1, 300).map(
        lambda n: {"type": "object", "patternProperties": {f"^(a+)+{i}$": {"type": "integer"} for i in range(n)}}
    ),
)

# What an attack sent, and the edges of the limits: drawn as often as the random ones.
KNOWN = st.sampled_from(
    [
        ("regex", "a{1000000}"),
        ("regex", "(a{1000}){100000}"),
        ("regex", "(a{1000}){3}"),
        ("regex", "(" * 100 + "a" + ")" * 100),
        ("grammar", _chain(498, False)),
        ("grammar", _chain(2700, False)),
        ("json", {"$ref": "#"}),
        ("json", {"type": "object", "patternProperties": {f"^(a+)+{i}$": {"type": "string"} for i in range(300)}}),
    ]
)
CONSTRAINTS = st.one_of(
    KNOWN,
    st.tuples(st.just("regex"), REGEXES),
    st.tuples(st.just("grammar"), GRAMMARS),
    st.tuples(st.just("json"), SCHEMAS),
)


@pytest.fixture(scope="module")
def setting(llama_dir: Path) -> Any:
    tok = Tokenizer(llama_dir)
    vocab = len(tok.hf)
    loop = asyncio.new_event_loop()
    checker = GrammarChecker(tok.hf, vocab)
    yield tok, vocab, Grammars(tok.hf, vocab), checker, loop
    loop.run_until_complete(checker.close())
    loop.close()


def _valid(kind: str, spec: Any, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "grammar":
        return re.fullmatch("y*x", text) is not None
    try:
        jsonschema.validate(json.loads(text), spec)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.slow
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(constraint=CONSTRAINTS, seed=st.integers(0, 2**31 - 1))
def test_every_grammar_is_refused_kept_or_fails_visibly(setting: Any, constraint: tuple[str, Any], seed: int) -> None:
    tok, vocab, grammars, checker, loop = setting
    kind, spec = constraint
    try:
        grammar = build_grammar(kind, spec)
        loop.run_until_complete(checker.check(grammar))
    except ValueError as e:  # the 400: a reason, one line
        assert str(e) and "\n" not in str(e)
        return
    sampler = Sampler(vocab, torch.device("cpu"), lambda: grammars)
    sampler.add_request("r", SamplingParams(temperature=1.0, seed=seed, grammar=grammar).wire())
    noise = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(STEPS):
        (sample,) = sampler.sample(["r"], torch.randn(1, vocab, generator=noise) * 3)
        if sample.error:  # visible: the request ends with finish_reason "error"
            assert "\n" not in sample.error
            return
        if sample.token_id == grammars.eos_token_id:
            text = tok.hf.decode(tokens)
            assert _valid(kind, spec, text), (kind, spec, text)
            return
        tokens.append(sample.token_id)
    # cut by the step budget: every token so far was one the grammar allowed
    assert sampler._requests["r"].matcher is not None and not sampler._requests["r"].matcher.is_error()
