"""Process lifetime: no orphans and no socket files, however the host goes away."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import alive
from live_server import ROOT

pytestmark = pytest.mark.slow

StartHost = Callable[[], tuple[subprocess.Popen[str], dict[str, object]]]

HOST = """
import asyncio, json, signal, sys
from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.config import EngineConfig

async def main():
    config = EngineConfig.create(sys.argv[1], pp_size=2, num_kv_blocks=64, threads_per_stage=1)
    async with AsyncEngine(config) as engine:
        pool = engine._pool
        # The engine leaves process-wide signal handling to the application that embeds it.
        untouched = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        # This application stops on SIGTERM and on Ctrl-C alike. Its handlers are the loop's: a
        # signal that lands on another thread (the engine has a few) still wakes the loop, where
        # a handler of signal.signal would wait for the main thread's next wake-up.
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        info = {"pids": [p.pid for p in pool.procs], "ipc": pool.addresses.ipc_dir, "sigterm_untouched": untouched}
        print(json.dumps(info), flush=True)
        await stop.wait()

if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(130)
"""


def _wait_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"stage processes still alive: {[p for p in pids if alive(p)]}"
        time.sleep(0.05)


@pytest.fixture
def start_host(tmp_path: Path, llama_dir: Path) -> Iterator[StartHost]:
    """Starts the host application; whatever of its process group is left at the end is killed, so
    that a failing test leaves no host or stage behind."""
    started: list[subprocess.Popen[str]] = []

    def start() -> tuple[subprocess.Popen[str], dict[str, object]]:
        script = tmp_path / "host.py"
        script.write_text(HOST)
        proc = subprocess.Popen(
            [sys.executable, str(script), str(llama_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            start_new_session=True,  # its own process group, like a program started from a terminal
        )
        started.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else "host printed nothing"
        return proc, json.loads(line)

    yield start
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_cleanly(start_host: StartHost, sig: signal.Signals) -> None:
    proc, info = start_host()
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


def test_stages_exit_when_the_host_is_killed(start_host: StartHost) -> None:
    proc, info = start_host()
    pids = info["pids"]
    assert isinstance(pids, list)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    _wait_gone(pids, timeout_s=5)
    assert not Path(str(info["ipc"])).exists(), "socket files left behind"
