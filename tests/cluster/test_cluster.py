"""Multi-node pieces without a network: stage placement, per-edge transports, checkpoint
fingerprints, the cluster key (CURVE on loopback sockets) and the rendezvous (in one process)."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch.distributed as dist
import zmq

from ppserve.engine.cluster.config import ClusterConfig, parse_host_port, split_stages
from ppserve.engine.cluster.fingerprint import checkpoint_fingerprint, describe_mismatch
from ppserve.engine.cluster.rendezvous import HostRendezvous, RendezvousError, _join_parts, join_cluster
from ppserve.engine.config import EngineConfig
from ppserve.engine.model.file_hash import file_fingerprint
from ppserve.engine.model.model_config import ConfigError
from ppserve.transport.addresses import free_ports
from ppserve.transport.cluster_key import CurveKeys, Guard, load_key, proof, proof_matches
from ppserve.transport.control import PullSocket, PushSocket, context
from ppserve.transport.messages import Heartbeat, Layout, NodeJoin, encode, encode_struct

KEY = b"a-cluster-secret-of-some-length"


def cluster(node_rank: int = 0, nnodes: int = 3, pp: int = 4, key: bytes | None = KEY, **kw: object) -> ClusterConfig:
    port = kw.pop("port", 29500)
    return ClusterConfig.create(
        nnodes=nnodes,
        node_rank=node_rank,
        pp_size=pp,
        dist_init_addr=f"127.0.0.1:{port}",
        key=key,
        **kw,  # type: ignore[arg-type]
    )


def test_split_stages() -> None:
    assert split_stages(4, 3) == [1, 1, 2]  # the rest on later nodes: node 0 also runs the host
    assert split_stages(4, 2) == [2, 2]
    assert split_stages(4, 3, "1,2,1") == [1, 2, 1]
    for spec in ("1,2", "0,2,2", "1,1,1", "a,b,c"):
        with pytest.raises(ConfigError, match="--stages-per-node"):
            split_stages(4, 3, spec)
    with pytest.raises(ConfigError, match="every node needs one"):
        split_stages(2, 3)


def test_cluster_config() -> None:
    c = cluster(node_rank=1, stages_per_node="1,2,1")
    assert c.stage_nodes == (0, 1, 1, 2) and c.local_stages == [1, 2] and not c.is_host
    assert c.node_addr == "127.0.0.1"  # the route to --dist-init-addr
    assert "a-cluster-secret" not in repr(c)
    assert parse_host_port("[fd00::1]:29500") == ("fd00::1", 29500)
    for bad in ("10.0.0.1", "10.0.0.1:x", ":29500", "10.0.0.1:70000"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            parse_host_port(bad)
    with pytest.raises(ConfigError, match="--node-rank"):
        cluster(node_rank=3)
    with pytest.raises(ConfigError, match="cluster-key-file"):
        cluster(key=None)
    assert cluster(key=None, insecure=True).key is None
    with pytest.raises(ConfigError, match="--dist-init-addr"):
        ClusterConfig.create(nnodes=2, node_rank=0, pp_size=2, dist_init_addr=None, key=KEY)


def test_edge_transports_per_edge(llama_dir: Path) -> None:
    c = cluster(stages_per_node="1,2,1")
    auto = EngineConfig.create(llama_dir, pp_size=4, cluster=c)
    assert auto.edge_transports == ("gloo", "shm", "gloo") and auto.process_group == "gloo"
    assert auto.tensor_transport == "gloo+shm"
    zmq_only = EngineConfig.create(llama_dir, pp_size=4, cluster=c, tensor_transport="zmq")
    assert zmq_only.edge_transports == ("zmq",) * 3 and zmq_only.process_group is None
    with pytest.raises(ConfigError, match="within one node"):
        EngineConfig.create(llama_dir, pp_size=4, cluster=c, tensor_transport="shm")
    with pytest.raises(ConfigError, match="places 4 stages"):
        EngineConfig.create(llama_dir, pp_size=2, cluster=c)
    one_host = EngineConfig.create(llama_dir, pp_size=4)
    assert one_host.edge_transports == ("shm",) * 3 and one_host.cluster is None
    assert auto.cluster_settings() != EngineConfig.create(llama_dir, pp_size=4, cluster=cluster()).cluster_settings()


def test_fingerprint(llama_dir: Path, sharded_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(llama_dir, copy)
    mine = checkpoint_fingerprint(llama_dir)
    assert checkpoint_fingerprint(copy) == mine
    assert describe_mismatch(mine, checkpoint_fingerprint(copy)) is None
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5}))
    mismatch = describe_mismatch(mine, checkpoint_fingerprint(copy))
    assert mismatch is not None and mismatch.startswith("config.json differs")
    sharded = checkpoint_fingerprint(sharded_dir)  # the index file, for a sharded checkpoint
    assert checkpoint_fingerprint(sharded_dir) == sharded
    assert describe_mismatch(mine, sharded) == (
        f"weights differs ({mine['weights']} here, {sharded['weights']} there)"
    )  # same config.json, weights laid out differently
    with pytest.raises(ConfigError, match="cannot fingerprint"):
        checkpoint_fingerprint(tmp_path / "missing")


def test_file_fingerprint_reads_samples_not_the_whole_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model file's fingerprint changes with its head, a sampled byte or its size, and reads a
    bounded part of a large file (a node never reads gigabytes to name its checkpoint)."""
    path = tmp_path / "big.gguf"
    with path.open("wb") as out:
        out.truncate(1 << 30)  # sparse: 1 GiB of zeros
    base = file_fingerprint(path)
    read: list[int] = []
    real_open = Path.open

    class Counting:  # the file, counting what is read from it
        def __init__(self, f: Any) -> None:
            self.f = f

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def read(self, n: int = -1) -> bytes:
            data: bytes = self.f.read(n)
            read.append(len(data))
            return data

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

    with monkeypatch.context() as m:
        m.setattr(Path, "open", lambda self, *a, **k: Counting(real_open(self, *a, **k)))
        assert file_fingerprint(path) == base
    assert 0 < sum(read) <= 21 << 20
    for offset in (100, (1 << 30) - 1):  # in the head; in the last sample
        with path.open("r+b") as f:
            f.seek(offset)
            f.write(b"\x01")
        assert file_fingerprint(path) != base
        with path.open("r+b") as f:
            f.seek(offset)
            f.write(b"\x00")
        assert file_fingerprint(path) == base
    with path.open("ab") as grown:
        grown.write(b"\x00")
    assert file_fingerprint(path) != base


def test_load_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "key"
    path.write_text(KEY.decode() + "\n")
    assert load_key(str(path)) == KEY
    monkeypatch.delenv("PPSERVE_CLUSTER_KEY", raising=False)
    assert load_key(None) is None
    monkeypatch.setenv("PPSERVE_CLUSTER_KEY", "from-the-environment-0123")
    assert load_key(None) == b"from-the-environment-0123"
    path.write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        load_key(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        load_key(str(tmp_path / "missing"))


def test_proof_is_bound_to_its_parts() -> None:
    tag = proof(KEY, "session", "1")
    assert proof_matches(KEY, tag, "session", "1")
    assert not proof_matches(KEY, tag, "session", "2")
    assert not proof_matches(b"another-secret-entirely!", tag, "session", "1")


@pytest.mark.parametrize("intruder", ["plain", "other secret", "own keypair"])
async def test_curve_refuses_and_logs_peers_without_the_key(intruder: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ppserve.cluster")
    keys = CurveKeys.from_secret(KEY)
    server_ctx, peer_ctx = context(), context()
    guard, peer_guard = Guard(server_ctx, keys, "host"), Guard(peer_ctx, keys, "stage 1")
    pull = PullSocket(server_ctx, "tcp://127.0.0.1:*", bind=True, guard=guard)
    sock = peer_ctx.socket(zmq.PUSH)
    sock.linger = 0
    if intruder == "other secret":
        CurveKeys.from_secret(b"not-the-cluster-secret-at-all").apply(sock, server=False)
    elif intruder == "own keypair":  # knows the server's public key, but not the secret
        public, secret = zmq.curve_keypair()
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, keys.public
    member = None
    try:
        sock.connect(pull.address)
        await sock.send(encode(Heartbeat(66)))  # a well-formed message: it never arrives
        member = PushSocket(peer_ctx, pull.address, bind=False, guard=peer_guard)
        await member.send(Heartbeat(1))
        assert await asyncio.wait_for(pull.recv(), 10) == Heartbeat(1)
        for _ in range(100):  # the refusal is logged (the monitor runs on this loop)
            if any("refused a connection" in r.message for r in caplog.records):
                break
            await asyncio.sleep(0.05)
        refused = [r.message for r in caplog.records if "refused a connection" in r.message]
        assert refused and refused[0].startswith(f"host: refused a connection on {pull.address}")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pull.recv(), 0.3)  # nothing from the intruder got through
    finally:  # a failed check must not leave a socket open: term() would wait for it
        for s in (sock, member, pull):
            if s is not None:
                s.close()
        guard.stop()
        peer_guard.stop()
        server_ctx.term()
        peer_ctx.term()


LAYOUT = Layout("tcp://127.0.0.1:1", ["tcp://127.0.0.1:2"] * 4, ["e0", "e1", "e2"], ["", "c1", "c2"])


async def _meet(
    host_cfg: ClusterConfig, nodes: list[ClusterConfig], settings: list[dict[str, str]], control: str = ""
) -> list[object]:
    """Node 0 admits the others; returns what each side ended with (a layout or an error).
    `control`: where every node says its control socket listens (default: a loopback port each)."""
    host = HostRendezvous(host_cfg, timeout_s=10)
    fp = {"config.json": "a", "weights": "b"}

    async def admit() -> object:
        try:
            await host.admit(fp, {"pp_size": "4"})
        except RendezvousError as e:
            return e
        host.publish(LAYOUT)
        return LAYOUT

    async def join(c: ClusterConfig, s: dict[str, str]) -> object:
        try:
            at = control or f"tcp://127.0.0.1:{40 + c.node_rank}"
            layout, _ = await join_cluster(c, fp, s, at, {}, timeout_s=10)
            return layout
        except RendezvousError as e:
            return e

    results = await asyncio.gather(admit(), *(join(c, s) for c, s in zip(nodes, settings, strict=True)))
    host.close()
    return list(results)


async def test_rendezvous_admits_nodes_with_the_key() -> None:
    port = free_ports(1)[0]
    nodes = [cluster(node_rank=r, port=port) for r in (1, 2)]
    results = await _meet(cluster(port=port), nodes, [{"pp_size": "4"}] * 2)
    assert results == [LAYOUT, LAYOUT, LAYOUT]


async def test_rendezvous_refuses_a_node_that_announces_a_bad_address() -> None:
    """Where a node says it listens is checked before anyone connects there, even with the key."""
    port = free_ports(1)[0]
    nodes = [cluster(node_rank=1, port=port)]
    host, node = await _meet(cluster(port=port), nodes, [{"pp_size": "4"}], control="tcp://*:9")
    assert isinstance(host, RendezvousError) and "refused node 1" in str(host)
    assert "'tcp://*:9'" in str(host) and "not a host name" in str(host) and isinstance(node, RendezvousError)


@pytest.mark.parametrize(
    ("node_key", "settings", "host_says", "node_says"),
    [
        (b"the-wrong-secret-0123456789", {"pp_size": "4"}, "its cluster key differs", "its cluster key differs"),
        (None, {"pp_size": "4"}, "it has no cluster key", "it has no cluster key"),
        (KEY, {"pp_size": "3"}, "pp_size 4 on node 0, 3 there", "settings differ"),
    ],
)
async def test_rendezvous_refuses_by_name(
    node_key: bytes | None, settings: dict[str, str], host_says: str, node_says: str
) -> None:
    port = free_ports(1)[0]
    node = cluster(node_rank=1, nnodes=2, pp=4, port=port, key=node_key, insecure=node_key is None)
    host_result, node_result = await _meet(cluster(nnodes=2, port=port), [node], [settings])
    assert isinstance(host_result, RendezvousError) and host_says in str(host_result)
    assert "refused node 1 (127.0.0.1" in str(host_result)
    assert isinstance(node_result, RendezvousError) and node_says in str(node_result)
    assert str(node_result).startswith("node 0 refused this node")


@pytest.mark.parametrize("entry", ["tampered", "garbage"])
async def test_rendezvous_refuses_forged_joins(entry: str) -> None:
    """The store is open to anyone who reaches it: a join whose body does not match its HMAC
    (a copied proof with another checkpoint), or that is not a join at all, is refused."""
    port = free_ports(1)[0]
    host = HostRendezvous(cluster(nnodes=2, port=port), timeout_s=10)
    honest = NodeJoin(1, "127.0.0.1", "h", "", {"config.json": "a", "weights": "b"}, {"pp_size": "4"}, "c", {})
    signed = msgspec.structs.replace(honest, proof=proof(KEY, *_join_parts(host.session, honest)))
    forged = msgspec.structs.replace(signed, fingerprint={"config.json": "x", "weights": "y"})
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    store.set("ppserve/node/1", encode_struct(forged) if entry == "tampered" else "\u00e9 not json")
    expected = "cluster key differs" if entry == "tampered" else "not a ppserve join"
    with pytest.raises(RendezvousError, match=expected):
        await host.admit({"config.json": "x", "weights": "y"}, {"pp_size": "4"})
    del store
    host.close()


async def test_rendezvous_names_missing_nodes() -> None:
    port = free_ports(1)[0]
    host = HostRendezvous(cluster(port=port), timeout_s=0.5)
    with pytest.raises(RendezvousError, match=r"node\(s\) 1, 2 did not join within"):
        await host.admit({}, {})
    host.close()


async def test_node_waits_for_node_0_then_gives_up() -> None:
    port = free_ports(1)[0]
    with pytest.raises(RendezvousError, match="not reachable"):
        await join_cluster(cluster(node_rank=1, port=port), {}, {}, "c", {}, timeout_s=0.5)
