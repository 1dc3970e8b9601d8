"""What the declaration of SamplingParams says about each field, read once from its annotations.

Its consumers ask this module rather than repeating a range: SamplingParams's own check and its
error messages, the OpenAPI document's bounds (`value_type`), the CLI's flags and their help.
Only what SamplingParams declares is understood: an int, float, str or bool, maybe optional
(`X | None`, None meaning off) or a tuple of them, each with msgspec Meta constraints.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any

from msgspec import Meta

_BOUNDS = ("ge", "gt", "le", "lt", "min_length", "max_length")
_KINDS = (bool, int, float, str)  # bool before int: a bool is an int to isinstance


@dataclass(frozen=True)
class FieldSpec:
    name: str
    kind: type  # of one value: int, float, str or bool
    bounds: dict[str, Any]  # msgspec Meta's constraints on one value: ge, gt, le, lt, min_length...
    description: str
    default: Any
    optional: bool = False  # None is allowed (and means off)
    many: bool = False  # a tuple of values

    @property
    def value_type(self) -> Any:
        """One value's type with its constraints, as msgspec (and its JSON Schema) takes it."""
        return Annotated[self.kind, Meta(**self.bounds)] if self.bounds else self.kind

    def phrase(self, plural: bool = False) -> str:
        """The range in words: 'an integer in [0, 20]', '>= 0', 'in (0, 1]', 'non-empty strings'."""
        b = self.bounds
        if self.kind is bool:
            return "true or false"
        if self.kind is str:
            what = "strings" if plural else "a string"
            low, high = b.get("min_length", 0), b.get("max_length")
            if high is not None:
                return f"{what} of {low} to {high} characters"
            return ("non-empty " if plural else "a non-empty ") + what.removeprefix("a ") if low == 1 else what
        low = f"[{_num(b['ge'])}" if "ge" in b else f"({_num(b['gt'])}" if "gt" in b else None
        high = f"{_num(b['le'])}]" if "le" in b else f"{_num(b['lt'])})" if "lt" in b else None
        if low and high:
            interval = f"in {low}, {high}"
        elif low:
            interval = (">= " if "ge" in b else "> ") + low[1:]
        elif high:
            interval = ("<= " if "le" in b else "< ") + high[:-1]
        else:
            interval = ""
        if self.kind is int:
            return ("integers" if plural else "an integer") + (f" {interval}" if interval else "")
        return interval or "a finite number"

    def check(self, value: Any) -> None:
        """ValueError naming the field unless `value` is one this field takes."""
        if value is None and self.optional:
            return
        if self.many:
            if not all(self._fits(v) for v in value):
                raise ValueError(f"{self.name} must be {self.phrase(plural=True)}, got {value!r}")
        elif not self._fits(value):
            raise ValueError(f"{self.name} must be {self.phrase()}, got {value!r}")

    def _fits(self, v: Any) -> bool:
        b = self.bounds
        if self.kind is bool:
            return True  # flags are not checked: any truthy value means on, as it always has
        if self.kind is str:
            return isinstance(v, str) and b.get("min_length", 0) <= len(v) <= b.get("max_length", len(v))
        if isinstance(v, bool) or not isinstance(v, int if self.kind is int else (int, float)):
            return False
        if not math.isfinite(v):
            return False
        return (
            ("ge" not in b or v >= b["ge"])
            and ("gt" not in b or v > b["gt"])
            and ("le" not in b or v <= b["le"])
            and ("lt" not in b or v < b["lt"])
        )


def fields_of(cls: type) -> tuple[FieldSpec, ...]:
    """The FieldSpec of each field of the dataclass `cls`, in declaration order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("own_form"):  # a field each API spells its own way (see SamplingParams)
            continue
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        out.append(_spec(f.name, hints[f.name], default))
    return tuple(out)


def _spec(name: str, hint: Any, default: Any) -> FieldSpec:
    metas: list[Meta] = []
    hint = _strip(hint, metas)
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"SamplingParams.{name}: only `X | None` unions are understood")
        optional, hint = True, _strip(args[0], metas)
    many = typing.get_origin(hint) is tuple
    if many:
        element, dots = typing.get_args(hint)
        if dots is not Ellipsis:
            raise TypeError(f"SamplingParams.{name}: only `tuple[X, ...]` is understood")
        hint = _strip(element, metas)
    if hint not in _KINDS:
        raise TypeError(f"SamplingParams.{name}: {hint!r} is not one of {_KINDS}")
    bounds = {k: getattr(m, k) for m in metas for k in _BOUNDS if getattr(m, k) is not None}
    description = " ".join(m.description for m in metas if m.description)
    return FieldSpec(name, hint, bounds, description, default, optional, many)


def _strip(hint: Any, metas: list[Meta]) -> Any:
    """`hint` without its Annotated layers, whose Meta go to `metas`."""
    while typing.get_origin(hint) is Annotated:
        metas += [m for m in hint.__metadata__ if isinstance(m, Meta)]
        hint = hint.__origin__
    return hint


def _num(x: float) -> str:
    """A bound as people write it: 2147483647 (not 2.14748e+09), 2 (not 2.0), 0.5."""
    return str(x) if isinstance(x, int) else f"{x:g}"
