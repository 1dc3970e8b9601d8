"""Number and table formatting for the documentation's benchmark tables (`python -m benchmarks tables`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

Result = dict[str, Any]
Row = Sequence[str]


def num(x: float, digits: int = 1) -> str:
    """`x` rounded half up as written (so 2.145 gives 2.15, as a person rounds it)."""
    q = Decimal(1).scaleb(-digits)
    return str(Decimal(repr(float(x))).quantize(q, rounding=ROUND_HALF_UP))


def thousands(x: float) -> str:
    return f"{round(x):,}"


def bold(text: str, on: bool = True) -> str:
    return f"**{text}**" if on else text


def us_or_ms(us: float) -> str:
    return f"{num(us, 0)} µs" if us < 1000 else f"{num(us / 1000, 2)} ms"


def markdown(header: Row, rows: Iterable[Row]) -> list[str]:
    def line(cells: Row) -> str:
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"

    return [line(header), "|" + "---|" * len(header), *(line(row) for row in rows)]


# --- what a table was measured at -------------------------------------------------------------
