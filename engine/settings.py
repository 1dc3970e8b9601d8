"""A setting's one declaration: its default, range, choices, help and flag live in the metadata of
its config field (`setting(...)`), and everything else derives from there: `EngineConfig.create`
checks values against it, the `ppserve` engine flags and their help are generated from it
(server/cli_engine.py), and tests/engine/test_config_chain.py compares the two.

    pp_size: int = setting(1, "pipeline stages", ge=1)

A field whose default is `None` is resolved by `create` from the checkpoint or the machine; its
`default_text` says how, for the help."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

SERVE_AND_GENERATE = ("generate", "serve")


@dataclass(frozen=True)
class Setting:
    help: str
    flag: str = ""  # the CLI flag; "": --name with dashes, without a trailing _s (seconds)
    aliases: tuple[str, ...] = ()  # older names of the flag, still accepted
    cli: bool = True  # False: set in Python or by the environment only
    commands: tuple[str, ...] = SERVE_AND_GENERATE  # the `ppserve` commands that have the flag
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None  # the flag's text -> the value (ValueError naming the problem)
    metavar: str | None = None
    default_text: str | None = None  # what a default of None means (create() resolves it)
    env: str | None = None  # the environment variable read when the setting is not given
    group: str = ""  # the --help section of its flag ("": the command's options)

    def check(self, name: str, value: Any) -> str | None:
        """What is wrong with `value` for this setting (None: nothing)."""
        if value is None or isinstance(value, bool):
            return None
        source = self.flag_name(name) if self.cli else self.env
        where = f"{name} ({source})" if source else name
        if self.choices and value not in self.choices:
            return f"{where} must be one of {', '.join(self.choices)}; got {value!r}"
        if isinstance(value, (int, float)):
            if isinstance(value, float) and not math.isfinite(value):
                return f"{where} must be a finite number, got {value}"
            if (self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt):
                return f"{where} must be {self.range()}, got {value}"
            if self.le is not None and value > self.le:
                return f"{where} must be {self.range()}, got {value}"
        return None

    def range(self) -> str:
        """The range as a reader writes it: ">= 1", "in [0, 1]", "> 0"."""
        low = self.ge if self.ge is not None else self.gt
        if low is not None and self.le is not None:
            return f"in {'[' if self.ge is not None else '('}{_num(low)}, {_num(self.le)}]"
        if low is not None:
            return f"{'>=' if self.ge is not None else '>'} {_num(low)}"
        return f"<= {_num(self.le)}" if self.le is not None else ""

    def flag_name(self, name: str) -> str:
        return self.flag or "--" + name.removesuffix("_s").replace("_", "-")


def setting(default: Any, help: str, **spec: Any) -> Any:
    """A config field declared with its setting (see the module's docstring)."""
    return field(default=default, metadata={"setting": Setting(help, **spec)})


def declared(cls: type) -> Iterator[tuple[Field[Any], Setting]]:
    """The fields of `cls` declared with `setting`, in their order."""
    for f in fields(cls):
        if (s := f.metadata.get("setting")) is not None:
            yield f, s


def default_of(f: Field[Any]) -> Any:
    return None if f.default is MISSING else f.default


def problems(cls: type, values: dict[str, Any]) -> list[str]:
    """What is wrong with `values` (by field name) against the settings of `cls`."""
    found = []
    for f, s in declared(cls):
        if f.name in values and (problem := s.check(f.name, values[f.name])) is not None:
            found.append(problem)
    return found


def _num(x: float) -> str:
    return f"{x:g}"
