"""The package's rooms and the one-way dependencies between them (DESIGN.md, engine/__init__.py).

Every import in the code folders counts, wherever it sits in a file (a function-level import or
one under TYPE_CHECKING is still a dependency a reader has to know about)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from live_server import ROOT

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


def graph() -> dict[str, set[str]]:
    """Each module -> the modules of ours it imports (`from pkg import name` counts as pkg.name
    where that is a module, else as pkg)."""
    names = modules()

    def owner(m: str) -> str | None:
        while m and m not in names:
            m = m.rpartition(".")[0]
        return m or None

    return {n: {o for m in imports(n, p) if (o := owner(m)) is not None and o != n} for n, p in names.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    """A circle of imports makes the order modules load in matter and hides which one owns what:
    any import counts, at the top, in a function or under TYPE_CHECKING."""
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_cycles() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert cycles(edges) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
