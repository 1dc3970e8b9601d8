"""Every ZeroMQ address of one engine, derived in one place.

On one host: `ipc://` sockets in a private temp dir (mode 0700, removed on close). Across hosts
(or when asked): `tcp://` on each stage's host, ports counted up from a base port.

Who binds: the host binds its inbox and one plan socket per stage; stage i+1 binds the edge from
stage i. Everyone else connects.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Addresses:
    pp_size: int
    ipc_dir: str | None = None  # set for ipc://
    host: str = "127.0.0.1"  # tcp: the host process's address
    stage_hosts: tuple[str, ...] = ()  # tcp: one address per stage
    base_port: int = 0  # tcp: host inbox at base_port, plans at +1.., edges after those

    @classmethod
    def ipc(cls, pp_size: int) -> Addresses:
        path = tempfile.mkdtemp(prefix="ppserve-")
        os.chmod(path, 0o700)
        return cls(pp_size=pp_size, ipc_dir=path)

    @classmethod
    def tcp(cls, pp_size: int, host: str, stage_hosts: tuple[str, ...], base_port: int = 0) -> Addresses:
        if len(stage_hosts) != pp_size:
            raise ValueError(f"need one host per stage: {pp_size} stages, {len(stage_hosts)} hosts")
        if base_port == 0:
            base_port = free_port_block(2 * pp_size)
        return cls(pp_size=pp_size, host=host, stage_hosts=stage_hosts, base_port=base_port)

    @property
    def is_ipc(self) -> bool:
        return self.ipc_dir is not None

    def _addr(self, name: str, host: str, offset: int) -> str:
        if self.ipc_dir is not None:
            return f"ipc://{self.ipc_dir}/{name}"
        return f"tcp://{host}:{self.base_port + offset}"

    def host_inbox(self) -> str:
        """Stages -> host: ready, results, heartbeats, failures."""
        return self._addr("host", self.host, 0)

    def plans(self, stage: int) -> str:
        """Host -> stage: StepPlans and shutdown."""
        return self._addr(f"plans-{stage}", self.host, 1 + stage)

    def edge(self, stage: int) -> str:
        """Stage `stage` -> stage `stage + 1`: headers (and, for the zmq channel, tensors)."""
        host = self.stage_hosts[stage + 1] if self.stage_hosts else self.host
        return self._addr(f"edge-{stage}", host, 1 + self.pp_size + stage)

    def cleanup(self) -> None:
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


def free_port_block(n: int, host: str = "127.0.0.1") -> int:
    """A base port with `n` consecutive free ports (best effort: checked, then released)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            socks = []
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no block of {n} free ports on {host}")
