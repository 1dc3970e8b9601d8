"""Constrained decoding with llguidance: grammars built from the API's forms, checked, compiled once.

A constraint travels as one string, llguidance's grammar (`SamplingParams.grammar`), built on the
host from what the client asked for (`build_grammar`: a JSON schema, any JSON object, a regex, a
list of choices, an EBNF/Lark grammar). The host checks it against the model's tokenizer before
any compute (`Grammars.check`, a ValueError naming llguidance's reason); the last stage compiles it
into a matcher that says, at each step, which tokens may come next (engine/model/sampler.py).

Why llguidance (and not xgrammar): a 3 MB wheel with no dependencies, where xgrammar's pulls in
transformers' stack and triton on x86_64 Linux; masks in tens of microseconds per request (an
Earley parser over a token trie, no precomputed tables), and grammars compile in about a
millisecond, so compiling is never the long pole (docs/benchmarks.md#structured-outputs has the
figures).

Compiled grammars are cached by their text: a matcher for a new request is a copy of the cached
one (microseconds). Everything here is bounded: the text's length (MAX_SPEC_CHARS), its rules and
nesting (`precheck`, before anything compiles), the parser's work per grammar and per token
(llguidance's limits), and the cache's bytes (CACHE_BYTES). A grammar reaches a last stage only
after the host's grammar worker (engine/model/grammar_check.py) compiled it in a process of its
own, under a budget of CPU time, memory and stack, and measured what it costs to keep.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import llguidance as llg
import numpy as np

if TYPE_CHECKING:
    import torch
    from llguidance._lib import JsonCompileOptions

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar as the client sends it
MAX_CHOICES = 1024
MAX_RULES = 500  # rules of an EBNF/Lark grammar: the compiler recurses along chains of rules
MAX_NESTING = 100  # brackets inside brackets, in a regex or a grammar
MAX_REPEAT = 100_000  # times counted repeats ({n}, {n,m}), nested, may repeat one thing
CACHE_BYTES = 512 << 20  # compiled grammars kept on a last stage, by what each cost to compile
# A compiled grammar whose cost is not known (checked in this process, not by the grammar worker)
# counts as this much against CACHE_BYTES.
UNKNOWN_COST = 4 << 20
KINDS = ("json_object", "json", "regex", "choice", "grammar")

# JSON without free whitespace: a small model that may put spaces and newlines anywhere can fill
# max_tokens with them and never close the object. Keys and items are separated as json.dumps does.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Bounds on the parser's work, so that no grammar can stall a stage: lexer fuel for building the
# grammar and for each token's mask, Earley items per step (llguidance's defaults, stated here
# because they are part of the contract).
_LIMITS: dict[str, Any] = dict(
    initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000, max_grammar_size=500_000
)
# llguidance's slicer: the vocabulary is split into slices by these regexes (a token goes to the
# smallest that matches it whole), and where the grammar allows every string of a slice, the mask
# takes the slice whole instead of walking its tokens. Its default slices are plain string
# characters of lengths 1-10, 1-30 and any. Inside a string with a maxLength, fewer than 10 (or 30)
# characters may be left, and then most of the vocabulary is walked token by token: those states
# make the costliest masks. Finer lengths near the end keep them sliced, which makes the mean
# mask on the structured-outputs benchmark's schema much cheaper
# (docs/structured-outputs.md#how-it-works), for a longer build of the tokenizer's slices, once per
# model. The masks are the same either way: slices only skip work.
_STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'  # a character a JSON string may hold unescaped
SLICES = [r"[\x20\x0A\x0D\x09]+"]  # whitespace
SLICES += [f"{_STRING_CHAR}{{1,{n}}}" for n in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 30)] + [f"{_STRING_CHAR}+"]


def build_grammar(kind: str, spec: Any) -> str:
    """llguidance's grammar for a constraint of `kind` (see KINDS); ValueError naming the problem.

    - json_object: any JSON object (OpenAI's `response_format: {"type": "json_object"}`)
    - json: a JSON schema (a dict, or its JSON text)
    - regex: the whole output matches it
    - choice: the output is one of these strings
    - grammar: an EBNF grammar (llama.cpp's GBNF) or a Lark grammar
    """
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
    if kind == "json":
        text = spec if isinstance(spec, str) else json.dumps(spec)
        _check_size(text, "schema")
        if not isinstance(spec, (str, dict)):
            raise ValueError("a JSON schema must be an object")
        _check_patterns(text)
        try:
            return llg.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"invalid JSON schema: {e}") from None
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise ValueError("a regex must be a non-empty string")
        _check_size(spec, "regex")
        _check_nesting(spec, "regex")
        _check_repeats(spec, "regex")
        return llg.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        if len(spec) > MAX_CHOICES:
            raise ValueError(f"choice has {len(spec)} entries, more than {MAX_CHOICES}")
        _check_size(json.dumps(spec), "choice")
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
    if kind == "grammar":
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError("a grammar must be a non-empty string")
        _check_size(spec, "grammar")
        _check_nesting(spec, "grammar")
        _check_repeats(spec, "grammar")
        rules = len(_RULE.findall(spec))
        if rules > MAX_RULES:
            raise ValueError(f"the grammar has {rules} rules, more than {MAX_RULES}")
        try:
            return llg.grammar_from("grammar", spec)
        except ValueError as e:
            raise ValueError(f"invalid grammar: {e}") from None
    raise ValueError(f"unknown constraint {kind!r}; one of {', '.join(KINDS)}")


def _check_size(text: str, what: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"the {what} is {len(text)} characters long, more than {MAX_SPEC_CHARS}")


# A rule's definition starts a line: Lark's `name:` (with ?/! prefixes and a .priority) or GBNF's `name ::=`.
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?::|::=)", re.MULTILINE)


_COUNTED = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def _check_repeats(text: str, what: str) -> None:
    """ValueError if counted repeats multiply past MAX_REPEAT: `(a{1000}){100000}` is 17
    characters, and its lexer builds hundreds of MB before it gives up. A group's repeat times the
    largest repeat inside it; escapes and character classes are skipped."""
    stack = [1]  # per open group: the largest repeat inside it so far
    closed, after_group, i = 1, False, 0
    while i < len(text):
        char = text[i]
        if char == "\\":
            i, after_group = i + 2, False
            continue
        if char == "[":  # a class: nothing in it repeats (a ']' right after '[' is literal)
            end = text.find("]", i + 2)
            i, after_group = (len(text) if end < 0 else end + 1), False
            continue
        if char == "{" and (m := _COUNTED.match(text, i)):
            count = m.group(1) if not m.group(2) else m.group(2)
            times = (closed if after_group else 1) * (int(count) if len(count) <= 9 else 10**9)
            stack[-1] = max(stack[-1], times)
            if stack[-1] > MAX_REPEAT:
                raise ValueError(f"the {what} repeats one part {stack[-1]} times, more than {MAX_REPEAT}")
            i, after_group = m.end(), False
            continue
        after_group = False
        if char == "(":
            stack.append(1)
        elif char == ")" and len(stack) > 1:
            closed, after_group = stack.pop(), True
            stack[-1] = max(stack[-1], closed)
        i += 1


def _check_patterns(schema_text: str) -> None:
    """The regexes of a JSON schema (`pattern`, `patternProperties`' names) checked as a `regex`
    constraint's are. Invalid JSON is left to llguidance's own message."""
    try:
        stack: list[Any] = [json.loads(schema_text)]
    except ValueError:
        return
    while stack:  # iteratively: the schema may nest deeply
        node = stack.pop()
        if isinstance(node, list):
            stack += node
        elif isinstance(node, dict):
            for key, value in node.items():
                patterns = (
                    [value]
                    if key == "pattern"
                    else list(value)
                    if isinstance(value, dict) and key == "patternProperties"
                    else []
                )
                for pattern in patterns:
                    if isinstance(pattern, str):
                        _check_nesting(pattern, "schema's pattern")
                        _check_repeats(pattern, "schema's pattern")
                stack.append(value)


def _check_nesting(text: str, what: str) -> None:
    """ValueError if brackets nest deeper than MAX_NESTING. Counted over the whole text (quoted
    brackets and escapes included): an over-count only refuses a grammar no one writes by hand."""
    depth = deepest = 0
    for char in text:
        if char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth = max(depth - 1, 0)
    if deepest > MAX_NESTING:
        raise ValueError(f"the {what} nests brackets {deepest} deep, more than {MAX_NESTING}")


class Grammars:
    """llguidance over one model's tokenizer: checks grammars and hands out matchers, compiling
    each grammar once (an LRU cache keyed by its text, bounded in bytes). Thread-safe: a last
    stage compiles on its grammar thread, and the grammar worker in its own process."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_bytes: int = CACHE_BYTES) -> None:
        """`tokenizer`: a transformers fast tokenizer; `vocab_size`: the model's logits width
        (the masks' width), which may exceed the tokenizer's."""
        self.tokenizer = llg_tokenizer(*tokenizer_json(tokenizer), vocab_size)
        self.vocab_size = vocab_size
        self.eos_token_id = self.tokenizer.eos_token
        self._limits = llg.LLParserLimits(**_LIMITS)
        self.words = (vocab_size + 31) // 32  # int32 words of one token bitmask
        # grammar text -> (matcher at its start, its first token bitmask [words] int32, bytes it costs)
        self._compiled: OrderedDict[str, tuple[llg.LLMatcher, torch.Tensor, int]] = OrderedDict()
        self._cache_bytes = cache_bytes
        self.cached_bytes = 0
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (not found in the cache) since start

    @classmethod
    def for_model(cls, model_dir: str | Path, vocab_size: int, cache_bytes: int = CACHE_BYTES) -> Grammars:
        from ppserve.engine.model.tokenizer import Tokenizer

        return cls(Tokenizer(model_dir).hf, vocab_size, cache_bytes)

    def cached(self, grammar: str) -> bool:
        """Whether `grammar` is compiled already (so valid)."""
        return grammar in self._compiled

    def check(self, grammar: str, cost: int = UNKNOWN_COST) -> None:
        """ValueError with llguidance's reason unless `grammar` compiles for this tokenizer and its
        first mask can be computed, twice: some limits are met only there, and the lexer that the
        copies of one compiled grammar share may reach them only at a second request's mask (as
        `a{1000000}`'s does)."""
        second = self._compile(grammar, cost)[0].deep_copy()
        self.masks([second])
        if second.is_error():
            raise ValueError(first_line(second.get_error()))

    def matcher(self, grammar: str, cost: int = UNKNOWN_COST) -> llg.LLMatcher:
        """A fresh matcher at the grammar's start (ValueError if the grammar is invalid). `cost`:
        the bytes its compiled form takes, as the grammar worker measured them."""
        return self._compile(grammar, cost)[0].deep_copy()

    def first_mask(self, grammar: str, cost: int = UNKNOWN_COST) -> torch.Tensor:
        """The bitmask [words] int32 of the tokens a grammar allows first: the same for every
        request with this grammar, so computed once (it is also the costliest mask to compute)."""
        return self._compile(grammar, cost)[1]

    def masks(self, matchers: list[llg.LLMatcher]) -> torch.Tensor:
        """Each matcher's next-token bitmask: [len(matchers), words] int32, bit t of row i set
        when matcher i allows token t."""
        import torch  # here: the grammar worker (engine/model/grammar_check.py) checks without torch

        out = torch.empty(len(matchers), self.words, dtype=torch.int32)
        for i, m in enumerate(matchers):  # llguidance drops the GIL while it computes a mask
            m.unsafe_compute_mask_ptr(out[i].data_ptr(), self.words * 4)
        return out

    def _compile(self, grammar: str, cost: int) -> tuple[llg.LLMatcher, torch.Tensor, int]:
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled
        # Compiling drops the GIL (llguidance): other threads run meanwhile. Two threads may compile
        # the same grammar at once; both results are equal, the second one is kept.
        try:
            template = llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        except (ValueError, TypeError) as e:  # not llguidance's grammar format at all
            raise ValueError(f"invalid grammar: {e}") from None
        if template.is_error():
            raise ValueError(first_line(template.get_error()))
        first = template.deep_copy()
        mask = self.masks([first])[0]
        if first.is_error():  # a limit met building the lexer (too many states or expressions)
            raise ValueError(first_line(first.get_error()))
        compiled = (template, mask, max(cost, 1))
        with self._lock:
            self.compiles += 1
            if (old := self._compiled.pop(grammar, None)) is not None:
                self.cached_bytes -= old[2]
            self._compiled[grammar] = compiled
            self.cached_bytes += compiled[2]
            # The newest entry stays even when it alone is over the bound: it is in use.
            while self.cached_bytes > self._cache_bytes and len(self._compiled) > 1:
                self.cached_bytes -= self._compiled.popitem(last=False)[1][2]
        return compiled


def tokenizer_json(hf_tokenizer: Any) -> tuple[str, int | None]:
    """A transformers fast tokenizer as llguidance reads it (its Rust tokenizer's JSON, padding and
    truncation off, as `llguidance.hf.from_tokenizer` serializes it) and its EOS id: what the
    grammar worker builds the same LLTokenizer from, without transformers."""
    backend = copy.copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str(), hf_tokenizer.eos_token_id


def llg_tokenizer(text: str, eos: int | None, vocab_size: int) -> llg.LLTokenizer:
    return llg.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos, slices=SLICES)


def check_compiles(tokenizer: llg.LLTokenizer, grammar: str) -> llg.LLMatcher:
    """What `Grammars.check` checks, without torch or a cache (the grammar worker's check):
    ValueError unless `grammar` compiles and two copies' first masks can be computed. Returns
    the compiled grammar, whose memory (with its masks' lexer states) is what a stage keeps."""
    try:
        template = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=llg.LLParserLimits(**_LIMITS))
    except (ValueError, TypeError) as e:
        raise ValueError(f"invalid grammar: {e}") from None
    if template.is_error():
        raise ValueError(first_line(template.get_error()))
    mask = np.empty((tokenizer.vocab_size + 31) // 32, dtype=np.int32)
    for _ in range(2):
        matcher = template.deep_copy()
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if matcher.is_error():
            raise ValueError(first_line(matcher.get_error()))
    return template


def first_line(error: str) -> str:
    """llguidance's error on one line, without the parser's state dump (`<state>` and what follows)."""
    return " ".join(error.split("<state>", 1)[0].split())[:500]
