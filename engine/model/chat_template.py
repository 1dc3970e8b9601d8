"""Chat templates rendered as transformers renders them, within a budget.

A chat template is code that comes with the model (`chat_template` in tokenizer_config.json, a
GGUF's `tokenizer.chat_template`), and it runs on every chat request. transformers runs it in
jinja2's `ImmutableSandboxedEnvironment`, which keeps it away from Python's internals but not
from running forever: two nested `range(100000)` loops are allowed, and so is `'x' * 10**9`.
This module sets up the same sandbox (trim_blocks, lstrip_blocks, the same filters, globals and
extensions, the same variables), so that a template renders to the same text, and bounds what
one render may do:

- iterations of `range` (where a runaway loop usually comes from) count against a per-render
  budget;
- `*` and `**` that would build a value past the output budget are refused before they run;
- the text is counted as it is produced, and a render past the output budget stops;
- a deadline is checked at every call, attribute and item lookup and piece of output.

Each breach raises `TemplateBudgetError`, which says what ran out. What the sandbox cannot
interrupt (a single huge operation in C, memory grown by concatenation, a loop that touches none
of the hooks) is bounded by the process that renders (`chat_template_worker.py`): a timer, a CPU
limit, a memory limit, and a parent that kills it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.runtime import Context, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import Namespace

# A render's output: a conversation is at most a request body (16 MiB) plus the template's
# markup, so twice that is more than any template needs for real messages.
MAX_OUTPUT_CHARS = 32 * 2**20
# Templates loop over messages, tools and their fields: thousands of iterations. A million is
# far above any real template, and quickly reached by a runaway one.
MAX_RANGE_ITERATIONS = 1_000_000
RENDER_SECONDS = 5.0  # a real template renders in milliseconds
_MAX_INT_BITS = 1 << 16  # `**` and `*` on integers: results up to ~20,000 digits
# The names transformers reads a message's reasoning from; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@dataclass(frozen=True)
class RenderBudget:
    seconds: float = RENDER_SECONDS
    iterations: int = MAX_RANGE_ITERATIONS
    chars: int = MAX_OUTPUT_CHARS
    # The rendering process's address space (enforced by chat_template_worker.py, not here): the
    # output budget in UCS-4 several times over, plus the interpreter.
    memory_bytes: int = 2 * 2**30


DEFAULT_BUDGET = RenderBudget()


class TemplateBudgetError(Exception):
    """The template ran past a bound of its render: the model's template is at fault, not the
    request. `what`: "time", "iterations", "output" or "memory"."""

    def __init__(self, what: str, message: str) -> None:
        super().__init__(message)
        self.what = what


class TemplateError(Exception):
    """The template failed on these messages (`raise_exception`, a syntax error, an undefined
    value): as transformers would have raised it."""


class _Tally:
    """One render's spending, checked by the sandbox's hooks."""

    def __init__(self, budget: RenderBudget) -> None:
        self.budget = budget
        self.deadline = time.monotonic() + budget.seconds
        self.iterations = 0
        self.chars = 0

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBudgetError("time", f"the chat template ran for more than {self.budget.seconds:g} s")

    def iterate(self) -> None:
        self.iterations += 1
        if self.iterations > self.budget.iterations:
            raise TemplateBudgetError(
                "iterations", f"the chat template looped over range() more than {self.budget.iterations} times"
            )
        if not self.iterations & 0xFFF:
            self.check_time()

    def would_build(self, size: int, what: str) -> None:
        if size > self.budget.chars:
            raise TemplateBudgetError(
                "output", f"the chat template built {what} of {size} items, more than {self.budget.chars}"
            )


_TALLY: ContextVar[_Tally | None] = ContextVar("chat_template_tally", default=None)


def _tally() -> _Tally:
    tally = _TALLY.get()
    if tally is None:  # rendered outside `render` (never here): no budget to spend
        raise RuntimeError("chat templates render through chat_template.render")
    return tally


class _BoundedRange(Sequence[int]):
    """`range` as templates see it (jinja's safe_range: at most 100,000 items), whose iterations
    count against the render's budget: nested loops multiply, and this is where they add up."""

    def __init__(self, r: range) -> None:
        self._range = r

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index: Any) -> Any:
        item = self._range[index]
        return _BoundedRange(item) if isinstance(item, range) else item

    def __iter__(self) -> Iterator[int]:
        tally = _tally()
        for i in self._range:
            tally.iterate()
            yield i

    def __reversed__(self) -> Iterator[int]:
        return iter(_BoundedRange(self._range[::-1]))

    def __contains__(self, value: object) -> bool:
        return value in self._range

    def __repr__(self) -> str:
        return repr(self._range)

    def __eq__(self, other: object) -> bool:
        return self._range == (other._range if isinstance(other, _BoundedRange) else other)

    def __hash__(self) -> int:
        return hash(self._range)

    @property
    def start(self) -> int:
        return self._range.start

    @property
    def stop(self) -> int:
        return self._range.stop

    @property
    def step(self) -> int:
        return self._range.step


def _range(*args: int) -> _BoundedRange:
    return _BoundedRange(safe_range(*args))


def _int_bits(value: Any) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


def _power_bits(base: Any, exponent: Any) -> float:
    """The size of the integer `base ** exponent` would make (0 for any other power)."""
    if not (isinstance(base, int) and isinstance(exponent, int)) or abs(base) < 2 or exponent < 1:
        return 0
    return exponent * math.log2(abs(base))


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, plus the budget's hooks."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        tally = _tally()
        tally.check_time()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    tally.would_build(len(seq) * max(n, 0), "a sequence")
            if _int_bits(left) + _int_bits(right) > _MAX_INT_BITS:
                raise TemplateBudgetError("output", "the chat template multiplied integers past its budget")
        elif operator == "**" and _power_bits(left, right) > _MAX_INT_BITS:
            raise TemplateBudgetError("output", f"the chat template raised {left} to the power {right}")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _tally().check_time()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tally().check_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tally().check_time()
        return super().getitem(obj, argument)


# What transformers adds to the sandbox (transformers/utils/chat_template_utils.py), mirrored here
# so that the process rendering templates need not import transformers.


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks;
    rendering, it is just its body."""

    tags = {"generation"}  # noqa: RUF012  # jinja declares it an instance variable

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Macro) -> str:
        return str(caller())


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' filter: jinja's own escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` for templates, without the class's attributes to climb through."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """`namespace` that refuses underscore names (they lead to Python's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_TemplateDict(),
        namespace=_TemplateNamespace,
        range=_range,
    )
    return env.from_string(template)


def chat_variables(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
) -> dict[str, Any]:
    """The variables a template sees, as transformers' `apply_chat_template` passes them: the
    messages without their None fields (and with their reasoning under each name templates read
    it by), the tools, no documents, the flag, and the special tokens (bos_token, eos_token...)."""
    chat = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        chat.append(m)
    return {
        **special_tokens,
        "messages": chat,
        "tools": tools,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
    }


def render(template: str, variables: dict[str, Any], budget: RenderBudget = DEFAULT_BUDGET) -> str:
    """The template's text for `variables` (see `chat_variables`), in this thread, within
    `budget` as far as the sandbox can see (the module's docstring says how far).
    TemplateBudgetError past the budget, TemplateError if the template fails."""
    tally = _Tally(budget)
    token = _TALLY.set(tally)
    try:
        pieces = []
        try:
            for piece in _compile(template).generate(**variables):
                tally.chars += len(piece)
                if tally.chars > budget.chars:
                    raise TemplateBudgetError("output", f"the chat template's text grew past {budget.chars} characters")
                tally.check_time()
                pieces.append(piece)
        except TemplateBudgetError:
            raise
        except MemoryError:
            raise TemplateBudgetError("memory", "the chat template ran out of memory") from None
        except Exception as e:  # jinja's errors, and whatever the template made Python raise
            raise TemplateError(str(e) or type(e).__name__) from None
        return "".join(pieces)
    finally:
        _TALLY.reset(token)
