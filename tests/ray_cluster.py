"""A Ray cluster for tests: one Ray node per network namespace of a tests/netns.py `Cluster`.

Ray nodes on one machine normally share an address and fight over ports; in namespaces each node
has its own address (198.18.0.<i+1>) and network stack, as on separate hosts, so cutting a link or
killing one node's processes looks to Ray like losing a machine. Kept small for a 2-core machine: one
CPU and the smallest object store Ray accepts per node, no dashboard, autoscaler monitor or log
monitor, and a GCS health check that declares a node dead in 2-3 s instead of about 16 s.
All Ray processes share the machine's PID namespace, so `ray stop` would end every Ray cluster on
it; `stop()` ends only the processes in this cluster's namespaces and removes its temp dirs and the
/dev/shm files they held. `stop()` leaves the namespaces to their owner's `close()`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from netns import Cluster

RAY = Path(sys.executable).parent / "ray"
PORT = 6379  # each namespace has its own ports, so Ray's default GCS port never clashes
OBJECT_STORE_BYTES = 75 * 1024 * 1024  # ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES
START_S = 60.0
STOP_S = 10.0
SHM = Path("/dev/shm")

# Read by every Ray process (RayConfig reads RAY_<name>); the health check ones matter to the GCS.
# RAY_AUTH_MODE pinned: `ray start --head` turns token auth on by itself when ~/.ray/auth_token
# exists (any local `ray.init()` writes one) but `ray start --address` does not, and then fails.
ENV = {
    "RAY_AUTH_MODE": "disabled",
    # A node whose raylet stops answering is dead after about 2-3 s (Ray's defaults: about 16 s);
    # four misses of a 1 s timeout, so that a busy 2-core machine does not kill a slow node.
    "RAY_health_check_initial_delay_ms": "0",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "4",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_enable_metrics_collection": "0",
    "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
}

# Run inside a namespace: prints "<ip> <ALIVE|DEAD>" per node the GCS knows, without a driver.
_NODES = """
import sys
from ray._raylet import GcsClient
for info in GcsClient(address=sys.argv[1]).get_all_node_info(timeout=10).values():
    print(info.node_manager_address, "ALIVE" if info.state == 0 else "DEAD")
"""


class RayCluster:
    def __init__(self, net: Cluster, num_cpus: int) -> None:
        self.net = net
        self.num_cpus = num_cpus
        self.root = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        self.started: list[int] = []

    @classmethod
    def start(cls, net: Cluster, nodes: Sequence[int] = (0, 1, 2), num_cpus: int = 1) -> RayCluster:
        """Head on `nodes[0]`, workers on the rest; returns once the GCS sees all of them alive."""
        ray = cls(net, num_cpus)
        try:
            ray._ray_start(nodes[0], ["--head", "--port", str(PORT), "--no-monitor", "--include-dashboard=false"])
            for node in nodes[1:]:
                ray._ray_start(node, ["--address", ray.address])
            ray.wait_alive(nodes)
        except BaseException:
            ray.stop()
            raise
        return ray

    @property
    def head(self) -> int:
        return self.started[0]

    @property
    def address(self) -> str:
        return f"{self.net.addr(self.head)}:{PORT}"

    def add_node(self, node: int) -> None:
        """Start a worker node in namespace `node` (a spare) and wait until it is alive."""
        self._ray_start(node, ["--address", self.address])
        self.wait_alive([node])

    def _ray_start(self, node: int, args: list[str]) -> None:
        temp_dir = self.root / f"n{node}"
        temp_dir.mkdir(exist_ok=True)
        argv = [str(RAY), "start", *args, "--node-ip-address", self.net.addr(node), "--num-cpus", str(self.num_cpus)]
        argv += ["--object-store-memory", str(OBJECT_STORE_BYTES), "--temp-dir", str(temp_dir)]
        argv += ["--disable-usage-stats", "--include-log-monitor=false"]
        self.started.append(node)
        # A file, not a pipe: the daemons `ray start` leaves behind would hold a pipe open.
        log = temp_dir / "ray-start.log"
        with log.open("w") as out:
            proc = self.net.popen(node, argv, env=env(), stdout=out, stderr=subprocess.STDOUT)
        assert proc.wait(timeout=START_S) == 0, f"ray start on node {node} failed:\n{log.read_text()}"

    def nodes(self) -> dict[str, bool]:
        """Node address -> alive, as the GCS sees it (asked from the head's namespace)."""
        argv = [sys.executable, "-c", _NODES, self.address]
        proc = self.net.popen(self.head, argv, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, f"cannot list Ray nodes:\n{err}"
        states: dict[str, bool] = {}
        for line in out.splitlines():  # a restarted node's address shows up once per registration
            ip, state = line.split()
            states[ip] = states.get(ip, False) or state == "ALIVE"
        return states

    def wait_alive(self, nodes: Sequence[int], alive: bool = True, timeout_s: float = START_S) -> None:
        """Until the GCS reports every node in `nodes` alive (or, `alive` False, dead)."""
        want = {self.net.addr(i) for i in nodes}
        deadline = time.monotonic() + timeout_s
        while True:
            states = self.nodes()
            if all(states.get(ip, False) == alive for ip in want) and (alive or want <= states.keys()):
                return
            assert time.monotonic() < deadline, f"nodes {sorted(want)} not {'alive' if alive else 'dead'}: {states}"
            time.sleep(0.2)

    def pids(self, node: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.net.nodes[node]], capture_output=True, text=True, timeout=10)
        return [int(pid) for pid in out.stdout.split()]

    def kill_node(self, node: int) -> None:
        """SIGKILL every process of node `node` (its raylet, workers and agents), as when its
        machine goes. Killing the raylet alone is not enough here: its workers leave when they see
        it gone, but a SIGKILLed raylet stays a zombie where PID 1 reaps no orphans (as on this
        machine), so a stage's actor kept serving until the GCS declared the node dead, and a
        short request could finish first."""
        self._kill([node])

    def stop(self) -> None:
        """End every process in this cluster's namespaces and remove what Ray left on disk."""
        self._kill(set(self.started))
        shutil.rmtree(self.root, ignore_errors=True)

    def _kill(self, nodes: Iterable[int]) -> None:
        """SIGKILL every process of `nodes` and unlink the /dev/shm files they held. SIGKILL at
        once: on SIGTERM a raylet takes about 10 s to go and the GCS over 15 s, and nothing needs
        their goodbyes (plasma unlinks its /dev/shm file as soon as it maps it)."""
        nodes = list(nodes)
        shm = self._shm_files(nodes)
        deadline = time.monotonic() + STOP_S
        while pids := [pid for node in nodes for pid in self.pids(node)]:
            assert time.monotonic() < deadline, f"Ray processes survive SIGKILL: {pids}"
            for pid in pids:  # again each round: a raylet may have forked a worker meanwhile
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        for path in shm:
            path.unlink(missing_ok=True)

    def _shm_files(self, nodes: Iterable[int]) -> set[Path]:
        """Named /dev/shm files mapped by this cluster's processes: none of Ray's own (plasma unlinks
        its file once mapped), but a worker's shared memory (torch, multiprocessing) outlives SIGKILL."""
        found: set[Path] = set()
        for pid in [pid for node in nodes for pid in self.pids(node)]:
            with contextlib.suppress(OSError):
                for fields in (line.split(maxsplit=5) for line in Path(f"/proc/{pid}/maps").read_text().splitlines()):
                    if len(fields) == 6 and fields[5].startswith(f"{SHM}/") and not fields[5].endswith(" (deleted)"):
                        found.add(Path(fields[5]))
        return found

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def env() -> dict[str, str]:
    """The environment for this cluster's Ray processes, and for drivers connecting to it."""
    return {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **ENV}
