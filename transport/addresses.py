"""Every ZeroMQ address of one engine, derived in one place.

On one host: `ipc://` sockets in a private temp dir (mode 0700, removed on close). Across nodes:
`tcp://` on each node's own address, with ports its owner picked; node 0 hands the list to every
node when they join (a `Layout`, engine/cluster/rendezvous.py).

Who binds: the host binds its inbox and one plan socket per stage; stage i+1 binds the edge from
stage i. Everyone else connects.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import tempfile
from dataclasses import dataclass

from ppserve.transport.messages import Layout


@dataclass(frozen=True)
class Addresses:
    inbox_addr: str
    plan_addrs: tuple[str, ...]
    edge_addrs: tuple[str, ...]  # edge i: stage i -> stage i + 1
    ipc_dir: str | None = None  # set for ipc://

    @classmethod
    def ipc(cls, pp_size: int) -> Addresses:
        path = tempfile.mkdtemp(prefix="ppserve-")
        os.chmod(path, 0o700)
        return cls(
            inbox_addr=f"ipc://{path}/host",
            plan_addrs=tuple(f"ipc://{path}/plans-{i}" for i in range(pp_size)),
            edge_addrs=tuple(f"ipc://{path}/edge-{i}" for i in range(pp_size - 1)),
            ipc_dir=path,
        )

    @classmethod
    def from_layout(cls, layout: Layout) -> Addresses:
        return cls(layout.host_inbox, tuple(layout.plans), tuple(layout.edges))

    def host_inbox(self) -> str:
        """Stages -> host: ready, results, heartbeats, failures."""
        return self.inbox_addr

    def plans(self, stage: int) -> str:
        """Host -> stage: StepPlans and shutdown."""
        return self.plan_addrs[stage]

    def edge(self, stage: int) -> str:
        """Stage `stage` -> stage `stage + 1`: headers (and, for the zmq channel, tensors)."""
        return self.edge_addrs[stage]

    def cleanup(self) -> None:
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


def tcp_address(host: str, port: int | str) -> str:
    """`port` "*": any free port, picked by the OS at bind (the socket's `address` says which)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` ports that are free on `host` now, for sockets bound later (checked, then released).
    They are taken from below the kernel's range for outgoing connections, whose ports it hands
    out by itself (gloo's, the rendezvous store's) and could otherwise give away meanwhile."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    candidates = random.sample(range(10000, low), min(low - 10000, 50 * n)) if low > 10000 + n else []
    ports: list[int] = []
    for port in candidates:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    # No room below the range: let the OS pick (best effort).
    socks = []
    try:
        for _ in range(n - len(ports)):
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind((host, 0))
        return ports + [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
