"""The package's rooms and the one-way dependencies between them (DESIGN.md, engine/__init__.py).

Every import in the code folders counts, wherever it sits in a file (a function-level import or
one under TYPE_CHECKING is still a dependency a reader has to know about)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {
    "engine": "ppserve.engine",
    "scheduler": "ppserve.scheduler",
    "transport": "ppserve.transport",
    "server": "ppserve.server",
}

# module prefix -> prefixes of ours it must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "ppserve.scheduler": ("ppserve.engine", "ppserve.server"),
    "ppserve.transport": ("ppserve.engine", "ppserve.scheduler", "ppserve.server"),
    "ppserve.engine": ("ppserve.server",),
    "ppserve.engine.model": (
        "ppserve.engine.runtime",
        "ppserve.engine.cluster",
        "ppserve.engine.disagg",
        "ppserve.engine.async_engine",
        "ppserve.engine.config",
    ),
    "ppserve.engine.cluster": ("ppserve.engine.runtime", "ppserve.engine.disagg", "ppserve.engine.async_engine"),
    "ppserve.engine.disagg": ("ppserve.engine.runtime", "ppserve.engine.cluster"),
    "ppserve.engine.runtime": ("ppserve.engine.async_engine",),
}


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            out[name] = path
    return out


def imports(name: str, path: Path) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])]
                )
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("ppserve")}


def test_the_rooms_exist() -> None:
    names = modules()
    for room in ("model", "runtime", "cluster", "disagg"):
        assert f"ppserve.engine.{room}" in names, f"engine/{room}/__init__.py is missing"
        assert ast.get_docstring(ast.parse(names[f"ppserve.engine.{room}"].read_text())), (
            f"engine/{room} needs a docstring"
        )


@pytest.mark.parametrize("name", sorted(modules()))
def test_dependencies_point_one_way(name: str) -> None:
    rules = [bad for prefix, bad in FORBIDDEN.items() if name == prefix or name.startswith(prefix + ".")]
    forbidden = tuple(b for bad in rules for b in bad)
    wrong = sorted(m for m in imports(name, modules()[name]) if m.startswith(forbidden))
    assert not wrong, f"{name} imports {wrong}, against the rooms' rules"


def test_the_checker_sees_imports() -> None:
    """The rule above would pass vacuously if `imports` found nothing."""
    names = modules()
    assert "ppserve.engine.model.model" in imports(
        "ppserve.engine.model.weights", names["ppserve.engine.model.weights"]
    )
    assert "ppserve.engine.config" in imports(
        "ppserve.engine.runtime.stage_worker", names["ppserve.engine.runtime.stage_worker"]
    )
