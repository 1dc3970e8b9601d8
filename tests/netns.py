"""Test hosts on one machine: Linux network namespaces on a bridge, for what crosses a network.

Node i is namespace `<prefix>n<i>` with the address 198.18.0.<i+1>/24 (198.18.0.0/15 is reserved
for network tests) on its `eth0`, a veth whose other end sits on a bridge in a namespace of its
own, so nothing touches the machine's real interfaces. `link(i, up=False)` cuts node i off, as a
pulled cable would. Everything, processes started in the namespaces included, goes at `close()`.
Needs root and iproute2; `Cluster.create` raises `Unavailable` where they are missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

SUBNET = "198.18.0"
WAIT_S = 120.0


class Unavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, no kernel support)."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class Cluster:
    def __init__(self, size: int, prefix: str | None = None) -> None:
        # Interface and namespace names stay short (15 characters for interfaces) and unique per process.
        self.prefix = prefix or f"pp{os.getpid() % 100000}"
        self.size = size
        self.switch = f"{self.prefix}sw"
        self.nodes = [f"{self.prefix}n{i}" for i in range(size)]
        self.procs: list[subprocess.Popen[Any]] = []

    @classmethod
    def create(cls, size: int, wired: bool = True) -> Cluster:
        """`wired` False: namespaces with loopback only, for another network (tests/tun_switch.py)."""
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise Unavailable("network namespaces need root and iproute2 (ip)")
        cluster = cls(size)
        try:
            cluster._build() if wired else cluster._build_unwired()
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            cluster.close()
            stderr = getattr(e, "stderr", b"") or b""
            raise Unavailable(f"cannot create network namespaces: {stderr.decode(errors='replace').strip()}") from e
        return cluster

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.nodes):
            _ip("netns", "add", ns)
            _ip("-n", self.switch, "link", "add", f"h{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.switch, "link", "set", f"h{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def _build_unwired(self) -> None:
        _ip("netns", "add", self.switch)  # unused; keeps close() and existing() uniform
        for ns in self.nodes:
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")

    def addr(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def popen(self, node: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside node `node`'s namespace (ended at `close()` if still running)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.nodes[node], *argv], **kwargs)
        self.procs.append(proc)
        return proc

    def link(self, node: int, up: bool) -> None:
        """Connect or cut node `node`: its veth end on the bridge goes up or down."""
        _ip("-n", self.switch, "link", "set", f"h{node}", "up" if up else "down")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        for ns in [*self.nodes, self.switch]:
            # Whatever else still runs in a namespace (children of killed processes) goes too.
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout
            for pid in pids.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)

    @staticmethod
    def existing(prefix: str) -> list[str]:
        """Namespaces whose names start with `prefix` (to check that none are left)."""
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
        return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


@contextlib.contextmanager
def cluster_or_skip(size: int) -> Iterator[Cluster]:
    """A test's cluster of `size` nodes, removed (and checked gone) afterwards; the test is
    skipped, with the reason, where namespaces cannot be made."""
    import pytest

    try:
        cluster = Cluster.create(size)
    except Unavailable as e:
        pytest.skip(str(e))
    try:
        yield cluster
    finally:
        cluster.close()
    assert Cluster.existing(cluster.prefix) == [], "network namespaces left behind"


class Node:
    """A process in node `rank`'s namespace (a `ppserve` node, a client), its output collected
    line by line."""

    def __init__(self, cluster: Cluster, rank: int, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.rank = rank
        out = subprocess.PIPE
        self.proc = cluster.popen(rank, argv, stdout=out, stderr=subprocess.STDOUT, text=True, env=env or child_env())
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout_s: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output:
            assert self.proc.poll() is None or text in self.output, f"node {self.rank} exited:\n{self.output}"
            assert time.monotonic() < deadline, f"node {self.rank} never said {text!r}:\n{self.output}"
            time.sleep(0.05)

    def wait(self, timeout_s: float = WAIT_S) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=5)
        return code


def child_env() -> dict[str, str]:
    """This environment without a cluster key (each test names its own), output unbuffered."""
    env = dict(os.environ)
    env.pop("PPSERVE_CLUSTER_KEY", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def pids(cluster: Cluster, node: int) -> list[str]:
    return subprocess.run(
        ["ip", "netns", "pids", cluster.nodes[node]], capture_output=True, text=True, timeout=10
    ).stdout.split()


def assert_no_processes(cluster: Cluster, nodes: list[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        left = {n: pids(cluster, n) for n in nodes}
        if not any(left.values()):
            return
        assert time.monotonic() < deadline, f"processes left on nodes: {left}"
        time.sleep(0.1)
