"""Multi-node pipelines on one machine: every node is its own network namespace (tests/netns.py).

Three nodes run `ppserve` as a user would, the same command on each: node 0 = host + stage 0,
node 1 = stages 1-2, node 2 = stage 3. Tokens must equal a one-stage run; a wrong key and a
differing checkpoint are refused by name; a node killed or cut off mid-generation fails the
request with an error naming it, turns /health red, and leaves no process on any node.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import Cluster, Node, assert_no_processes, child_env, cluster_or_skip, pids

pytestmark = pytest.mark.slow

PROMPTS = ["The pipeline", "Stages on three nodes", "a b c d e f g h i j k l m n o p"]
PORT = 29500
HTTP_PORT = 8000
WAIT_S = 120.0


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with cluster_or_skip(3) as c:
        yield c


@pytest.fixture(scope="module")
def key_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("keys")
    good, bad = root / "good.key", root / "bad.key"
    good.write_text("a-cluster-secret-for-the-tests\n")
    bad.write_text("another-secret-that-differs-from-it\n")
    return good, bad


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def ppserve(command: str, model: Path, rank: int, key: Path | None, *flags: str) -> list[str]:
    argv = [sys.executable, "-m", "ppserve.server.cli", command, "--model", str(model), "--pp-size", "4"]
    argv += ["--nnodes", "3", "--node-rank", str(rank), "--dist-init-addr", f"198.18.0.1:{PORT}"]
    argv += ["--stages-per-node", "1,2,1"]
    argv += ["--cluster-key-file", str(key)] if key else ["--insecure-cluster"]
    return argv + list(flags)


def generate_flags(prompts: Path, *extra: str) -> list[str]:
    return ["--prompts-file", str(prompts), "--max-tokens", "12", "--temperature", "0", "--json", *extra]


@pytest.fixture(scope="module")
def reference(llama_dir: Path, prompts_file: Path) -> list[list[int]]:
    """The prompts' tokens from one process on one host, as the same command makes them."""
    argv = [sys.executable, "-m", "ppserve.server.cli", "generate", "--model", str(llama_dir)]
    argv += generate_flags(prompts_file)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=WAIT_S, env=child_env(), check=True).stdout
    return [json.loads(line)["token_ids"] for line in out.splitlines()]


def tokens(node: Node) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in node.lines if line.startswith("{")]


@pytest.mark.parametrize(
    ("transport", "order"),
    [("auto", "host last"), ("gloo", "node 2 late"), ("zmq", "host first")],
)
def test_three_nodes_match_one_stage(
    cluster: Cluster,
    llama_dir: Path,
    key_files: tuple[Path, Path],
    prompts_file: Path,
    reference: list[list[int]],
    transport: str,
    order: str,
) -> None:
    """auto: gloo between nodes and shm inside node 1; gloo (without a key) and zmq everywhere."""
    flags = [*generate_flags(prompts_file), "--tensor-transport", transport]

    key = None if transport == "gloo" else key_files[0]  # gloo: --insecure-cluster (plain ZeroMQ sockets)

    def start(rank: int) -> Node:
        at = ["--node-addr", cluster.addr(rank)] if transport == "zmq" else []  # else found from the route
        return Node(cluster, rank, ppserve("generate", llama_dir, rank, key, *flags, *at))

    if order == "host last":
        others = [start(1), start(2)]
        for node in others:
            node.wait_for("waiting for node 0")
        host = start(0)
    elif order == "node 2 late":
        host, node1 = start(0), start(1)
        host.wait_for("node 1 joined")
        time.sleep(5.0)  # the scenario itself: node 2 comes up five seconds after the others
        others = [node1, start(2)]
    else:
        host = start(0)
        host.wait_for("waiting for node(s) 1, 2")
        others = [start(1), start(2)]
    assert host.wait() == 0, host.output
    for node in others:
        assert node.wait(30) == 0, node.output
        assert "joined" in node.output
    assert tokens(host) == reference
    assert_no_processes(cluster, [0, 1, 2])


def test_wrong_cluster_key_is_refused(
    cluster: Cluster, llama_dir: Path, key_files: tuple[Path, Path], prompts_file: Path
) -> None:
    good, bad = key_files
    flags = generate_flags(prompts_file)
    host = Node(cluster, 0, ppserve("generate", llama_dir, 0, good, *flags))
    intruder = Node(cluster, 1, ppserve("generate", llama_dir, 1, bad, *flags))
    node2 = Node(cluster, 2, ppserve("generate", llama_dir, 2, good, *flags))
    assert host.wait() == 1
    assert "refused node 1 (198.18.0.2" in host.output and "cluster key differs" in host.output, host.output
    assert intruder.wait() == 1
    assert "node 0 refused this node: its cluster key differs from node 0's" in intruder.output, intruder.output
    assert node2.wait() == 1, node2.output
    assert "Traceback" not in host.output + intruder.output + node2.output
    assert_no_processes(cluster, [0, 1, 2])


def test_differing_checkpoint_is_refused(
    cluster: Cluster, llama_dir: Path, key_files: tuple[Path, Path], prompts_file: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    shutil.copytree(llama_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-6) * 10
    (other / "config.json").write_text(json.dumps(config))
    flags = generate_flags(prompts_file)
    host = Node(cluster, 0, ppserve("generate", llama_dir, 0, key_files[0], *flags))
    node1 = Node(cluster, 1, ppserve("generate", llama_dir, 1, key_files[0], *flags))
    node2 = Node(cluster, 2, ppserve("generate", other, 2, key_files[0], *flags))
    assert host.wait() == 1 and node2.wait() == 1 and node1.wait() == 1
    assert "refused node 2 (198.18.0.3" in host.output and "config.json differs" in host.output, host.output
    assert "node 0 refused this node: its checkpoint differs from node 0's: config.json differs" in node2.output
    assert_no_processes(cluster, [0, 1, 2])


CLIENT = r"""
import http.client, json, sys, time
conn = http.client.HTTPConnection("198.18.0.1", %(port)d, timeout=60)
body = {"model": "m", "prompt": "tell me everything", "max_tokens": 1500, "ignore_eos": True, "stream": True}
conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
resp = conn.getresponse()
print(json.dumps({"status": resp.status}), flush=True)
for raw in resp:
    line = raw.decode().strip()
    if not line.startswith("data: ") or line == "data: [DONE]":
        continue
    event = json.loads(line[6:])
    out = {"error": event["error"]} if "error" in event else {"token": 1}
    print(json.dumps({"t": time.monotonic(), **out}), flush=True)
    if "error" in event:
        break
health = http.client.HTTPConnection("198.18.0.1", %(port)d, timeout=10)
health.request("GET", "/health")
print(json.dumps({"health": health.getresponse().status}), flush=True)
"""


# Node 1 (stages 1-2) killed, and node 2 (the last stage, which samples) cut off: each node once,
# and each way of losing one.
@pytest.mark.parametrize("fault", ["middle node killed", "link cut"])
def test_lost_node_fails_requests_by_name(
    cluster: Cluster, llama_dir: Path, key_files: tuple[Path, Path], fault: str
) -> None:
    lost = 1 if fault == "middle node killed" else 2
    flags = ["--host", "198.18.0.1", "--port", str(HTTP_PORT), "--no-playground", "--served-model-name", "m"]
    host = Node(cluster, 0, ppserve("serve", llama_dir, 0, key_files[0], *flags))
    nodes = {r: Node(cluster, r, ppserve("serve", llama_dir, r, key_files[0], *flags)) for r in (1, 2)}
    host.wait_for("ppserve: serving")
    client = Node(cluster, 0, [sys.executable, "-c", CLIENT % {"port": HTTP_PORT}])
    deadline = time.monotonic() + 60
    while client.output.count('"token"') < 20:  # mid-generation: tokens are flowing
        assert time.monotonic() < deadline and client.proc.poll() is None, client.output
        time.sleep(0.02)
    faulted_at = time.monotonic()
    if fault == "link cut":
        cluster.link(lost, up=False)
    else:
        for pid in pids(cluster, lost):
            os.kill(int(pid), signal.SIGKILL)
    assert client.wait(30) == 0, client.output
    events = [json.loads(line) for line in client.lines if line.startswith("{")]
    errors = [e["error"]["message"] for e in events if "error" in e]
    first_stage = {1: 1, 2: 3}[lost]
    assert errors and f"stage {first_stage} on node {lost}" in errors[0], client.output
    assert f"node {lost} is unreachable" in errors[0], client.output
    assert events[-1] == {"health": 503}, client.output
    failed_at = next(e["t"] for e in events if "error" in e)
    print(f"{fault}: the request failed {failed_at - faulted_at:.2f} s later: {errors[0]}")
    # The other node is told to stop; a node cut off stops by itself once it no longer hears node 0.
    assert_no_processes(cluster, [1, 2])
    survivor = 3 - lost
    assert nodes[survivor].wait(5) == 0, nodes[survivor].output
    if fault == "link cut":
        assert nodes[lost].wait(5) == 1 and "node 0 (198.18.0.1) is unreachable" in nodes[lost].output
    host.proc.send_signal(signal.SIGTERM)
    assert host.wait(30) == 0, host.output
    assert_no_processes(cluster, [0])


def test_nodes_stop_when_node_0_is_killed(cluster: Cluster, llama_dir: Path, key_files: tuple[Path, Path]) -> None:
    flags = ["--host", "198.18.0.1", "--port", str(HTTP_PORT), "--no-playground"]
    host = Node(cluster, 0, ppserve("serve", llama_dir, 0, key_files[0], *flags))
    nodes = [Node(cluster, r, ppserve("serve", llama_dir, r, key_files[0], *flags)) for r in (1, 2)]
    host.wait_for("ppserve: serving")
    for pid in pids(cluster, 0):
        os.kill(int(pid), signal.SIGKILL)
    for node in nodes:  # each stops its stages once node 0 has been silent for 2 s
        assert node.wait(30) == 1, node.output
        assert "node 0 (198.18.0.1) is unreachable" in node.output
    assert_no_processes(cluster, [0, 1, 2])
