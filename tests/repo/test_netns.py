"""The network-namespace test hosts (tests/netns.py): nodes reach each other by address, a cut
link cuts them off, and nothing is left behind."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from netns import Cluster, cluster_or_skip

# A server on one node that answers one line; a client on another that sends one.
SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], 7000))
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(c.recv(100).upper())
    c.close()
"""
CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], 7000), timeout=2)
c.sendall(b"hello")
print(c.recv(100).decode())
"""


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with cluster_or_skip(2) as c:
        yield c


def _ask(cluster: Cluster, node: int, addr: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", cluster.nodes[node], sys.executable, "-c", CLIENT, addr],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_nodes_talk_across_the_bridge_until_the_link_is_cut(cluster: Cluster) -> None:
    server = cluster.popen(1, [sys.executable, "-c", SERVER, cluster.addr(1)], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "listening"
    answer = _ask(cluster, 0, cluster.addr(1))
    assert answer.returncode == 0 and answer.stdout.strip() == "HELLO", answer.stderr
    # The server is in its own namespace: not on this machine's loopback.
    assert _ask(cluster, 0, "127.0.0.1").returncode != 0

    cluster.link(1, up=False)
    cut = _ask(cluster, 0, cluster.addr(1))
    failure = cut.stderr.lower()
    assert cut.returncode != 0 and any(w in failure for w in ("timed out", "no route", "unreachable")), cut.stderr
    cluster.link(1, up=True)
    assert _ask(cluster, 0, cluster.addr(1)).stdout.strip() == "HELLO"
