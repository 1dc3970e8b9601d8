"""The wheel as a user installs it: one top-level package, `ppserve`, which an application's own
`server.py` and `engine/` cannot shadow, in the host or in the stage processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from live_server import ROOT

from ppserve.engine.model import cpu_kernels

pytestmark = pytest.mark.slow

SHADOW = "raise ImportError('the application\\'s own {name} was imported instead of ppserve\\'s')\n"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy, so the build leaves nothing in the checkout.
    src = out / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    for name in files.stdout.splitlines():
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    (built,) = out.glob("ppserve-*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv with the wheel installed. Its dependencies (torch and the rest) come from the
    test environment through a path entry, which puts their folder on sys.path without running
    the editable install's import hook that lives there."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    cmd = [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", str(wheel)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return python


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    """An application's folder with modules named like ppserve's folders, each failing on import."""
    (tmp_path / "server.py").write_text(SHADOW.format(name="server.py"))
    for pkg in ("engine", "scheduler", "transport"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text(SHADOW.format(name=f"{pkg}/"))
    return tmp_path


def test_wheel_holds_only_ppserve(wheel: Path) -> None:
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"
    assert {name.split("/")[0] for name in names} == {"ppserve", dist_info}
    for pkg in ("engine", "scheduler", "transport", "server"):
        assert f"ppserve/{pkg}/__init__.py" in names
    assert "ppserve/server/playground.html" in names  # package data: the page at /
    for source in (*cpu_kernels.SOURCES, cpu_kernels.HEADER):  # the CPU kernels, built at first use
        assert f"ppserve/engine/model/{source.name}" in names
    assert "ppserve = ppserve.server.cli:main" in archive.read(f"{dist_info}/entry_points.txt").decode()


def test_embedding_example_beside_shadowing_modules(fresh_python: Path, app_dir: Path, llama_dir: Path) -> None:
    script = app_dir / "app.py"
    script.write_text((ROOT / "scripts" / "embed_example.py").read_text())
    res = subprocess.run(
        [str(fresh_python), str(script), str(llama_dir)], cwd=app_dir, capture_output=True, text=True, timeout=180
    )
    assert res.returncode == 0, res.stderr
    assert sorted(line.split(":")[0] for line in res.stdout.splitlines()) == ["first", "second"]
    where = subprocess.run(
        [str(fresh_python), "-c", "import ppserve.engine; print(ppserve.engine.__file__)"],
        cwd=app_dir,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert Path(where.strip()).is_relative_to(fresh_python.parent.parent), where  # the wheel's copy


def test_console_script_generate_beside_shadowing_modules(fresh_python: Path, app_dir: Path, llama_dir: Path) -> None:
    cli = fresh_python.parent / "ppserve"
    args = ["generate", "--model", str(llama_dir), "--pp-size", "2", "--kv-cache-gb", "0.02"]
    args += ["--input-ids", "5,6,7", "--max-tokens", "4", "--ignore-eos", "--json"]
    # The application's folder on PYTHONPATH too, as when the CLI runs inside its environment.
    env = {**os.environ, "PYTHONPATH": str(app_dir)}
    res = subprocess.run([str(cli), *args], cwd=app_dir, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert len(out["token_ids"]) == 4 and out["finish_reason"] == "length"


def test_venv_script_says_why_it_installs(tmp_path: Path) -> None:
    """scripts/venv.sh installs again when pyproject.toml changed, and says so; a first use of
    another extra is said as such, not as a change (pip is a stand-in that records its calls)."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "venv.sh").write_bytes((ROOT / "scripts" / "venv.sh").read_bytes())
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls"\n')
    python.chmod(0o755)

    def run(extra: str) -> str:
        done = subprocess.run(
            ["bash", "scripts/venv.sh", extra], cwd=tmp_path, capture_output=True, text=True, check=True
        )
        return done.stderr

    assert "pyproject.toml changed" not in run("test")
    assert run("test") == ""  # installed, nothing changed: nothing to do
    first = run("client")
    assert "first use of the client extra" in first and "changed" not in first
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'y'\n")
    assert "pyproject.toml changed since the last install" in run("test")
    assert len((python.parent / "calls").read_text().splitlines()) == 3
