"""Stages as Ray actors (`--executor ray`, engine/runtime/ray_stages.py).

On a Ray cluster of network namespaces (tests/ray_cluster.py), one Ray node per namespace:
PP=3 with STRICT_SPREAD (one stage per node) gives the tokens of a single process; a node lost
mid-stream heals onto a spare node with identical tokens, or, with no spare, fails its requests
by name until a node joins. Without Ray installed, `--executor ray` is a one-line error.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import pipeline, random_prompt
from netns import Cluster, Node, child_env, cluster_or_skip
from ray_cluster import RayCluster
from ray_cluster import env as ray_env

from ppserve.engine.cluster.ray_config import MISSING
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.server.cli import main


def test_executor_ray_without_ray_is_one_line_error(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what an install without Ray looks like to imports
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--model", str(llama_dir), "--prompt", "x", "--executor", "ray", "--pp-size", "2"])
    assert exited.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and MISSING in lines[0], lines


# ---- on a Ray cluster of network namespaces ------------------------------------------------

STREAMS = 8
MAX_TOKENS = 160
HTTP_PORT = 8000

# Run in node 0's namespace: /health, then 8 streams at once over /generate, each printing a line
# per chunk and one with its tokens (or its error) at the end; then /health again.
CLIENT = r"""
import http.client, json, sys, threading, time
port, requests = int(sys.argv[1]), json.loads(sys.argv[2])
lock = threading.Lock()

def say(obj):
    with lock:  # one whole line at a time from 8 threads
        print(json.dumps(obj), flush=True)

def get(path):
    conn = http.client.HTTPConnection("198.18.0.1", port, timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"null")

def stream(i, body):
    conn = http.client.HTTPConnection("198.18.0.1", port, timeout=300)
    conn.request("POST", "/generate", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    resp, ids = conn.getresponse(), []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            say({"i": i, "error": event["error"]["message"]})
            return
        ids += event["token_ids"]
        say({"i": i, "tokens": len(ids)})
    say({"i": i, "token_ids": ids} if resp.status == 200 else {"i": i, "status": resp.status})

say({"health": get("/health")})
threads = [threading.Thread(target=stream, args=(i, body)) for i, body in enumerate(requests)]
for t in threads:
    t.start()
for t in threads:
    t.join()
say({"health": get("/health")})
conn = http.client.HTTPConnection("198.18.0.1", port, timeout=30)
conn.request("GET", "/metrics")
say({"metrics": [m for m in conn.getresponse().read().decode().splitlines() if m.startswith("ppserve_stage_node{")]})
"""

# Run in node 0's namespace after the server is gone: what is left on the Ray cluster.
LEFTOVERS = r"""
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
actors = [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
print(json.dumps({"actors": len(actors), "placement_groups": len(groups)}))
"""


def _requests() -> list[tuple[list[int], SamplingParams]]:
    """Half greedy, half seeded at temperature 0.8; all run to MAX_TOKENS."""
    rng = random.Random(26)
    out = []
    for i in range(STREAMS):
        sampled = {"temperature": 0.8, "seed": 100 + i} if i % 2 else {"temperature": 0.0}
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampled)  # type: ignore[arg-type]
        out.append((random_prompt(rng, 8 + 3 * i), params))
    return out


def _bodies() -> list[dict[str, object]]:
    return [
        {
            "input_ids": prompt,
            "sampling_params": {"max_tokens": p.max_tokens, "ignore_eos": True, "temperature": p.temperature}
            | ({"seed": p.seed} if p.seed is not None else {}),
        }
        for prompt, p in _requests()
    ]


@pytest.fixture(scope="module")
def one_process(llama_dir: Path) -> list[list[int]]:
    """The tokens of each stream from a single process (every stage in turn, one at a time)."""
    engine = pipeline(llama_dir)
    return [engine.generate([prompt], params)[0].token_ids for prompt, params in _requests()]


@pytest.fixture
def net() -> Iterator[Cluster]:
    with cluster_or_skip(4) as c:
        yield c


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("key") / "cluster.key"
    path.write_text("a-ray-cluster-secret-for-the-tests\n")
    return path


class Served:
    """`ppserve serve --executor ray` in node 0's namespace, on the Ray cluster `ray`."""

    def __init__(self, net: Cluster, ray: RayCluster, model: Path, key: Path, *flags: str) -> None:
        self.net, self.ray = net, ray
        self.shm = set(os.listdir("/dev/shm"))
        argv = [sys.executable, "-m", "ppserve.server.cli", "serve", "--model", str(model), "--pp-size", "3"]
        argv += ["--executor", "ray", "--ray-address", ray.address, "--placement-strategy", "STRICT_SPREAD"]
        argv += ["--cluster-key-file", str(key), "--host", "198.18.0.1", "--port", str(HTTP_PORT)]
        argv += ["--no-playground", "--max-running-requests", str(STREAMS), *flags]
        self.host = Node(net, 0, argv, _env())
        self.host.wait_for("ppserve: serving")

    def client(self) -> Node:
        return Node(self.net, 0, [sys.executable, "-c", CLIENT, str(HTTP_PORT), json.dumps(_bodies())], _env())

    def stop(self) -> None:
        """SIGTERM, then: no actor, no placement group, no new shared memory left behind."""
        self.host.proc.send_signal(signal.SIGTERM)
        assert self.host.wait(60) == 0, self.host.output
        ray_lines = [line for line in self.host.lines if " -- " in line and ".py:" in line]  # Ray's log format
        assert not ray_lines, "Ray's log lines in the server's output (only with --log-level debug)"
        left = Node(self.net, 0, [sys.executable, "-c", LEFTOVERS, self.ray.address], _env())
        assert left.wait(60) == 0, left.output
        assert json.loads(left.lines[-1]) == {"actors": 0, "placement_groups": 0}, left.output
        assert set(os.listdir("/dev/shm")) <= self.shm, "shared memory left behind"


def _env() -> dict[str, str]:
    return {**child_env(), **ray_env()}


def _events(client: Node) -> list[dict[str, Any]]:
    return [json.loads(line) for line in client.lines if line.startswith("{")]


def _finals(client: Node) -> dict[int, object]:
    """Each stream's tokens, or its error."""
    return {int(e["i"]): e.get("token_ids", e.get("error")) for e in _events(client) if "tokens" not in e and "i" in e}


def _stage_nodes(health: dict[str, Any]) -> dict[int, int]:
    """Stage -> the namespace it runs in, from /health's `stages`."""
    stages = health["stages"]
    assert isinstance(stages, list)
    return {s["stage"]: int(s["address"].rsplit(".", 1)[1]) - 1 for s in stages}


def _wait_tokens(client: Node, at_least: int) -> None:
    """Until the streams have produced `at_least` tokens in all: mid-generation."""
    deadline = time.monotonic() + 120
    while sum(1 for e in _events(client) if "tokens" in e) < at_least:
        assert time.monotonic() < deadline and client.proc.poll() is None, client.output
        time.sleep(0.02)


@pytest.mark.slow
def test_strict_spread_pp3_gives_the_tokens_of_one_process_and_heals_onto_the_spare(
    net: Cluster, llama_dir: Path, key_file: Path, one_process: list[list[int]]
) -> None:
    """Four nodes for three stages: one stage per node, the fourth node spare."""
    with RayCluster.start(net, nodes=(0, 1, 2, 3)) as ray:
        served = Served(net, ray, llama_dir, key_file)
        client = served.client()
        assert client.wait() == 0, client.output
        first, last = [e["health"] for e in _events(client) if "health" in e]
        assert first[0] == 200 and last[0] == 200, client.output
        nodes = _stage_nodes(first[1])
        assert len(set(nodes.values())) == 3, first  # STRICT_SPREAD
        metrics = next(e["metrics"] for e in _events(client) if "metrics" in e)
        for stage in first[1]["stages"]:
            labels = [f'{k}="{stage[k]}"' for k in ("stage", "node_id", "address")]
            assert any(all(label in m for label in labels) and m.endswith(" 1.0") for m in metrics), metrics
        assert _finals(client) == dict(enumerate(one_process)), client.output

        # The same streams again, and a stage's node lost in the middle of them.
        client = served.client()
        _wait_tokens(client, 2 * STREAMS)
        lost = nodes[2] if nodes[2] != 0 else nodes[1]  # not the head: the GCS lives there
        killed_at = time.monotonic()
        ray.kill_node(lost)
        served.host.wait_for("serving again")
        healed_s = time.monotonic() - killed_at
        assert client.wait() == 0, client.output
        assert _finals(client) == dict(enumerate(one_process)), client.output + served.host.output
        last = [e["health"] for e in _events(client) if "health" in e][-1]
        assert last[0] == 200 and lost not in _stage_nodes(last[1]).values(), last
        print(f"node {lost} lost mid-stream: healed in {healed_s:.1f} s (stages now on {_stage_nodes(last[1])})")
        served.stop()


@pytest.mark.slow
def test_with_no_room_requests_fail_by_name_until_a_node_joins(
    net: Cluster, llama_dir: Path, key_file: Path, one_process: list[list[int]]
) -> None:
    with RayCluster.start(net, nodes=(0, 1, 2)) as ray:
        served = Served(net, ray, llama_dir, key_file, "--stage-timeout", "3")
        client = served.client()
        _wait_tokens(client, 2 * STREAMS)
        nodes = _stage_nodes(next(e["health"] for e in _events(client) if "health" in e)[1])
        lost = nodes[2] if nodes[2] != 0 else nodes[1]
        ray.kill_node(lost)
        assert client.wait() == 0, client.output
        errors = [v for v in _finals(client).values() if isinstance(v, str)]
        assert len(errors) == STREAMS, client.output
        assert all("cannot be placed: no Ray node has room for 1 CPU (STRICT_SPREAD)" in e for e in errors), errors
        last = [e["health"] for e in _events(client) if "health" in e][-1]
        assert last[0] == 503 and "cannot be placed" in last[1]["error"], last
        ray.add_node(3)  # capacity returns: the pipeline heals by itself
        served.host.wait_for("serving again")
        again = served.client()
        assert again.wait() == 0, again.output
        assert _finals(again) == dict(enumerate(one_process)), again.output
        served.stop()
