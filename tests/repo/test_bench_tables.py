"""The documentation's benchmark tables are what the results JSONs say (`python -m benchmarks tables`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from live_server import ROOT

from benchmarks import tables as bench_tables
from benchmarks.harness import record as bench_record


def test_every_table_matches_its_json() -> None:
    stale = bench_tables.stale()
    assert not stale, f"tables that differ from their JSON (run python -m benchmarks tables): {stale}"


def test_every_table_is_shown_once_and_its_sources_exist() -> None:
    shown = [m["name"] for doc in bench_tables.doc_files() for m in bench_tables.MARKER.finditer(doc.read_text())]
    assert sorted(shown) == sorted(bench_tables.TABLES), "each table in benchmarks/tables/, once in the docs"
    for table in bench_tables.TABLES.values():
        for source in table.sources:
            assert (bench_tables.RESULTS / source).is_file(), source


def test_every_table_says_what_it_was_measured_at() -> None:
    for doc in bench_tables.doc_files():
        for m in bench_tables.MARKER.finditer(doc.read_text()):
            last = m["body"].rstrip("\n").splitlines()[-1]
            assert last.startswith("Measured at: "), (doc.name, m["name"])
            for source in bench_tables.TABLES[m["name"]].sources:
                assert f"[`{source}`]" in last, (doc.name, m["name"], source)


def copy_docs(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    return tmp_path


def test_a_changed_figure_is_caught_and_rewritten(tmp_path: Path) -> None:
    root = copy_docs(tmp_path)
    path = root / "benchmarks" / "results" / "pd.json"
    data = json.loads(path.read_text())
    data["colocated"]["itl_p99_ms"] = 1234.5
    path.write_text(json.dumps(data))
    assert bench_tables.stale(root) == ["docs/benchmarks.md: pd"]
    doc = root / "docs" / "benchmarks.md"
    doc.write_text(bench_tables.refresh(doc.read_text(), doc, root))
    assert bench_tables.stale(root) == []
    assert "1234.5 ms" in doc.read_text()


def test_an_unknown_table_name_is_an_error(tmp_path: Path) -> None:
    root = copy_docs(tmp_path)
    doc = root / "docs" / "benchmarks.md"
    doc.write_text(doc.read_text() + "\n<!-- bench-table: nonesuch -->\n<!-- /bench-table -->\n")
    assert "docs/benchmarks.md: nonesuch" in bench_tables.stale(root)
    with pytest.raises(KeyError, match="nonesuch"):
        bench_tables.refresh(doc.read_text(), doc, root)


def test_a_recorded_result_names_its_commit_and_machine(tmp_path: Path) -> None:
    """What write_result records is what the tables print."""
    root = copy_docs(tmp_path)
    path = root / "benchmarks" / "results" / "model.json"
    report = json.loads(path.read_text())
    for key in ("machine", "torch", "commit"):
        report.pop(key, None)
    settings = {"threads": 2, "reps": 5, "out": str(path)}
    bench_record.write_result(path, report, settings)
    data = json.loads(path.read_text())
    assert data["settings"] == settings and isinstance(data["argv"], list)
    assert data["machine"]["cpus"] and data["machine"]["cpu_model"] and "torch" in data["machine"]
    assert data["commit"] is None or len(data["commit"]) == 40
    if data["commit"] is None:
        return  # not a git checkout: nothing more to see
    doc = root / "docs" / "benchmarks.md"
    doc.write_text(bench_tables.refresh(doc.read_text(), doc, root))
    line = next(ln for ln in doc.read_text().splitlines() if ln.startswith("Measured at: [`model.json`]"))
    assert f"commit `{data['commit'][:12]}`" in line and f"{data['machine']['cpus']} cores" in line
