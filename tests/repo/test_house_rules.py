"""The house's size rules, so that a newcomer can read any piece in one sitting: no file of the
package over 500 lines, no function over 80; `scripts/` keeps what a user runs; and no code finds
its imports by editing sys.path (everything imports the installed package)."""

from __future__ import annotations

import ast
import re
import subprocess

from live_server import ROOT

FOLDERS = ("engine", "scheduler", "transport", "server")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _package_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_no_file_or_function_of_the_package_is_too_long() -> None:
    files = _package_files()
    assert len(files) > 100  # the walk found the package
    long_files, long_functions = [], []
    for name in files:
        text = (ROOT / name).read_text()
        if text.count("\n") > MAX_FILE_LINES:
            long_files.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def test_scripts_keep_what_a_user_runs() -> None:
    scripts = sorted(p.name for p in (ROOT / "scripts").iterdir())
    assert {"serve.sh", "test.sh", "venv.sh"} <= set(scripts) and len(scripts) <= 6, scripts


def test_nothing_edits_sys_path() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(tracked) > 200
    edit = re.compile(r"^\s*sys\.path\.(insert|append)\(", re.MULTILINE)  # a statement, not these words
    assert [name for name in tracked if edit.search((ROOT / name).read_text())] == []
