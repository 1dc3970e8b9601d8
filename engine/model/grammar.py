"""Constrained decoding with llguidance: grammars built from the API's forms, checked, compiled once.

A constraint travels as one string, llguidance's grammar (`SamplingParams.grammar`), built on the
host from what the client asked for (`build_grammar`: a JSON schema, any JSON object, a regex, a
list of choices, an EBNF/Lark grammar). The host checks it against the model's tokenizer before
any compute (`Grammars.check`, a ValueError naming llguidance's reason); the last stage compiles it
into a matcher that says, at each step, which tokens may come next (engine/model/sampler.py).

Why llguidance (and not xgrammar): a 3 MB wheel with no dependencies, where xgrammar's pulls in
transformers' stack and triton on x86_64 Linux; masks in tens of microseconds per request (an
Earley parser over a token trie, no precomputed tables), and grammars compile in about a
millisecond, so compiling is never the long pole (docs/structured-outputs.md has the figures).

Compiled grammars are cached by their text: a matcher for a new request is a copy of the cached
one (microseconds). Everything here is bounded: the text's length (MAX_GRAMMAR_CHARS), the parser's
work per grammar and per token (llguidance's limits), the cache's size, and the host's wait for a
check (CHECK_TIMEOUT_S).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import llguidance as llg
import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar as the client sends it
MAX_CHOICES = 1024
CACHE_SIZE = 256  # compiled grammars kept (each is a few kB to a few MB for large schemas)
CHECK_TIMEOUT_S = 10.0  # the host's wait for one check; llguidance's own fuel limits bound the work
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
# cost 100-500 us a mask. Finer lengths near the end keep them sliced, and halve the mean mask on
# the benchmark's schema (scripts/bench_structured.py). Building the tokenizer's slices takes
# up to about 0.15 s more, once per model. The masks are the same either way: slices only skip work.
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
        try:
            return llg.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"invalid JSON schema: {e}") from None
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise ValueError("a regex must be a non-empty string")
        _check_size(spec, "regex")
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
        try:
            return llg.grammar_from("grammar", spec)
        except ValueError as e:
            raise ValueError(f"invalid grammar: {e}") from None
    raise ValueError(f"unknown constraint {kind!r}; one of {', '.join(KINDS)}")


def _check_size(text: str, what: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"the {what} is {len(text)} characters long, more than {MAX_SPEC_CHARS}")


class Grammars:
    """llguidance over one model's tokenizer: checks grammars and hands out matchers, compiling
    each grammar once (an LRU cache keyed by its text). Thread-safe: the host checks in worker
    threads, a last stage compiles on its grammar thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = CACHE_SIZE) -> None:
        """`tokenizer`: a transformers fast tokenizer; `vocab_size`: the model's logits width
        (the masks' width), which may exceed the tokenizer's."""
        from llguidance.hf import from_tokenizer

        self.tokenizer = from_tokenizer(tokenizer, n_vocab=vocab_size, slices=SLICES)
        self.vocab_size = vocab_size
        self.eos_token_id = self.tokenizer.eos_token
        self._limits = llg.LLParserLimits(**_LIMITS)
        self.words = (vocab_size + 31) // 32  # int32 words of one token bitmask
        # grammar text -> (matcher at its start, its first token bitmask [words] int32)
        self._compiled: OrderedDict[str, tuple[llg.LLMatcher, torch.Tensor]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (not found in the cache) since start

    @classmethod
    def for_model(cls, model_dir: str | Path, vocab_size: int) -> Grammars:
        from ppserve.engine.model.tokenizer import Tokenizer

        return cls(Tokenizer(model_dir).hf, vocab_size)

    def cached(self, grammar: str) -> bool:
        """Whether `grammar` is compiled already (so valid)."""
        return grammar in self._compiled

    def check(self, grammar: str) -> None:
        """ValueError with llguidance's reason unless `grammar` compiles for this tokenizer."""
        self.matcher(grammar)

    def matcher(self, grammar: str) -> llg.LLMatcher:
        """A fresh matcher at the grammar's start (ValueError if the grammar is invalid)."""
        return self._compile(grammar)[0].deep_copy()

    def first_mask(self, grammar: str) -> torch.Tensor:
        """The bitmask [words] int32 of the tokens a grammar allows first: the same for every
        request with this grammar, so computed once (it is also the costliest mask to compute)."""
        return self._compile(grammar)[1]

    def masks(self, matchers: list[llg.LLMatcher]) -> torch.Tensor:
        """Each matcher's next-token bitmask: [len(matchers), words] int32, bit t of row i set
        when matcher i allows token t."""
        out = torch.empty(len(matchers), self.words, dtype=torch.int32)
        for i, m in enumerate(matchers):  # llguidance drops the GIL while it computes a mask
            m.unsafe_compute_mask_ptr(out[i].data_ptr(), self.words * 4)
        return out

    def _compile(self, grammar: str) -> tuple[llg.LLMatcher, torch.Tensor]:
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
            raise ValueError(template.get_error())
        compiled = (template, self.masks([template.deep_copy()])[0])
        with self._lock:
            self.compiles += 1
            self._compiled[grammar] = compiled
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return compiled
