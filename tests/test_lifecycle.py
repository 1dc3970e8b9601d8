"""Process lifetime: no orphans and no socket files, however the host goes away."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import alive

pytestmark = pytest.mark.slow

HOST = """
import asyncio, json, os, signal, sys
from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.config import EngineConfig

async def main():
    config = EngineConfig.create(sys.argv[1], pp_size=2, num_kv_blocks=64, threads_per_stage=1)
    async with AsyncEngine(config) as engine:
        pool = engine._pool
        # The engine leaves process-wide signal handling to the application that embeds it.
        untouched = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        # This application wants SIGTERM to clean up like Ctrl-C.
        signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
        info = {"pids": [p.pid for p in pool.procs], "ipc": pool.addresses.ipc_dir, "sigterm_untouched": untouched}
        print(json.dumps(info), flush=True)
        await asyncio.sleep(3600)

if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(130)
"""


def _wait_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"stage processes still alive: {[p for p in pids if alive(p)]}"
        time.sleep(0.05)


def _start_host(tmp_path: Path, model_dir: Path) -> tuple[subprocess.Popen[str], dict[str, object]]:
    script = tmp_path / "host.py"
    script.write_text(HOST)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(model_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        start_new_session=True,  # its own process group, like a program started from a terminal
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.stderr else "host printed nothing"
    info = json.loads(line)
    return proc, info


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_cleanly(tmp_path: Path, llama_dir: Path, sig: signal.Signals) -> None:
    proc, info = _start_host(tmp_path, llama_dir)
    pids = info["pids"]
    assert isinstance(pids, list) and all(alive(p) for p in pids)
    assert info["sigterm_untouched"] is True
    with open(f"/proc/{pids[0]}/comm") as f:
        assert f.read().strip() == "ppserve-stage-0"
    # To the whole process group, as Ctrl-C in a terminal does: the stages get it too, and leave
    # it to the host to stop them (no KeyboardInterrupt tracebacks from them).
    os.killpg(proc.pid, sig)
    assert proc.wait(timeout=20) == 130
    assert proc.stderr is not None
    assert "Traceback" not in proc.stderr.read()
    _wait_gone(pids)
    assert not Path(str(info["ipc"])).exists(), "socket files left behind"


def test_stages_exit_when_the_host_is_killed(tmp_path: Path, llama_dir: Path) -> None:
    proc, info = _start_host(tmp_path, llama_dir)
    pids = info["pids"]
    assert isinstance(pids, list)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    _wait_gone(pids, timeout_s=5)
    assert not Path(str(info["ipc"])).exists(), "socket files left behind"
