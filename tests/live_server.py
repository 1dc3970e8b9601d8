"""`ppserve serve` as a subprocess on a free loopback port, for tests that talk HTTP to it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, ClassVar

from procs import children, read

from ppserve.server.demo import DEMO_MODEL

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "test-key"


class LiveServer:
    started: ClassVar[list[LiveServer]] = []  # every server made here (the loop watch reads their output)

    def __init__(
        self,
        model_dir: Path | None,
        *flags: str,
        api_key: str | None = API_KEY,
        timeout_s: float = 120.0,
        env: dict[str, str] | None = None,
        command: str = "serve",
    ) -> None:
        """model_dir None: the built-in demo model. env: extra environment variables. command:
        `serve`, or `router` (no model)."""
        args = [sys.executable, "-m", "ppserve.server.cli", command, "--port", "0", *flags]
        if model_dir is not None:
            args += ["--model", str(model_dir)]
        if api_key:
            args += ["--api-key", api_key]
        self.api_key = api_key
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.output: list[str] = []
        LiveServer.started.append(self)
        self.url = self._wait_for_url(timeout_s)
        self.model = str(model_dir) if model_dir is not None else DEMO_MODEL

    def _wait_for_url(self, timeout_s: float) -> str:
        found: list[str] = []
        ready = threading.Event()

        def read() -> None:  # keep draining stdout so the server never blocks on a full pipe
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line)
                m = re.search(r"at (http://\S+)", line)
                if m and not found:
                    found.append(m.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout_s) or not found:
            self.stop()
            raise RuntimeError("ppserve serve did not start:\n" + "".join(self.output))
        return found[0]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """A blocking HTTP request: (status, headers, body), whatever the status."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        # urllib labels a body application/x-www-form-urlencoded, which the server refuses.
        content_type = {"Content-Type": "application/json"} if data is not None else {}
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={**self.headers, **content_type, **(headers or {})}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def stage_pids(self) -> list[int]:
        """The server's stage processes (its children named ppserve-stage-*)."""
        return [pid for pid in children(self.proc.pid) if read(pid, "comm").startswith(b"ppserve-stage")]

    def wait_until(self, predicate: Any, timeout_s: float = 30.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def stop(self) -> int:
        """SIGTERM, as a service manager would; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        """/metrics parsed by prometheus_client's own parser: {'name{label="v"}': value}."""
        from prometheus_client.parser import text_string_to_metric_families

        status, _, body = self.request("GET", "/metrics")
        assert status == 200
        out = {}
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out
