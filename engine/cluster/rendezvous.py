"""Nodes meet through torch.distributed's TCPStore at `--dist-init-addr`, run by node 0.

    node 0 (host)                                   node R
    store up; session = random ─────────────────>   connect (waits for node 0), read session
                                 <──────────────   node/R: NodeJoin (addr, key proof, checkpoint
    check key, checkpoint, settings                       fingerprint, settings, its ports)
    verdict/R: Verdict (error, or Layout + HMAC) ──>   check the HMAC; spawn its stages

Whatever goes wrong is said on both sides: node 0 raises naming the node (and tells it why),
the node raises with node 0's reason. The store is open to anyone who can reach it, so both
directions carry an HMAC keyed by the cluster secret, bound to this start-up's session, and a
node's entry is only trusted once its proof checks out. Later, the pipeline's own process
group (gloo, nccl) meets in the same store under its own prefix.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from datetime import timedelta

import msgspec
import torch.distributed as dist

from ppserve.engine.cluster.config import ClusterConfig
from ppserve.engine.cluster.fingerprint import describe_mismatch
from ppserve.transport.cluster_key import proof, proof_matches
from ppserve.transport.messages import Layout, NodeJoin, Verdict, decode_struct, encode_struct
from ppserve.transport.peers import AddressError, check_address

log = logging.getLogger("ppserve.cluster")
PREFIX = "ppserve/"
POLL_S = 0.2


class RendezvousError(RuntimeError):
    """This node cannot join the cluster (or node 0 refused one); the message says why."""


def _key(name: str) -> str:
    return PREFIX + name


class HostRendezvous:
    """Node 0's side: runs the store, admits every other node or refuses it by name."""

    def __init__(self, cluster: ClusterConfig, timeout_s: float) -> None:
        self.cluster = cluster
        self.timeout_s = timeout_s
        listener = socket.create_server(
            (cluster.dist_init_host, cluster.dist_init_port),
            family=socket.AF_INET6 if ":" in cluster.dist_init_host else socket.AF_INET,
            backlog=128,
        )
        try:
            # The store takes over a socket bound to the given address only (not every interface).
            self.store = dist.TCPStore(
                cluster.dist_init_host,
                cluster.dist_init_port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout_s),
                master_listen_fd=listener.fileno(),
            )
        except BaseException:
            listener.close()
            raise
        listener.detach()
        self.session = secrets.token_hex(16)
        self.store.set(_key("session"), self.session)

    async def admit(self, fingerprint: dict[str, str], settings: dict[str, str]) -> dict[int, NodeJoin]:
        """Wait for every other node to join (up to the timeout, naming those still missing);
        check each one's key, checkpoint and settings. Raises RendezvousError, after telling the
        nodes that came, if any check fails."""
        cluster = self.cluster
        waiting = set(range(1, cluster.nnodes))
        joined: dict[int, NodeJoin] = {}
        deadline = time.monotonic() + self.timeout_s
        log.info(
            "waiting for node(s) %s to join at %s (up to %.0f s)",
            ", ".join(map(str, sorted(waiting))),
            cluster.dist_init_addr,
            self.timeout_s,
        )
        try:
            while waiting:
                if time.monotonic() > deadline:
                    missing = ", ".join(map(str, sorted(waiting)))
                    raise RendezvousError(
                        f"node(s) {missing} did not join within {self.timeout_s:.0f} s "
                        f"(each runs the same command with its own --node-rank, reaching {cluster.dist_init_addr})"
                    )
                for node in sorted(waiting):
                    if not self.store.check([_key(f"node/{node}")]):
                        continue
                    join = self._read_join(node)
                    if error := self._check(join, fingerprint, settings):
                        self._answer(node, Verdict(error=error))
                        raise RendezvousError(f"refused node {node} ({join.addr}, {join.hostname}): {error}")
                    log.info("node %d joined from %s (%s)", node, join.addr, join.hostname)
                    joined[node] = join
                    waiting.discard(node)
                await asyncio.sleep(POLL_S)
        except RendezvousError as e:
            told = [n for n in range(1, cluster.nnodes) if self.store.check([_key(f"verdict/{n}")])]
            for node in joined:  # they wait for a verdict: tell them, rather than let them time out
                self._answer(node, Verdict(error=f"node 0 stopped the start-up: {e}"))
                told.append(node)
            await self._wait_read(told)
            raise
        return joined

    async def _wait_read(self, nodes: list[int], timeout_s: float = 2.0) -> None:
        """Until the nodes told of a failure have read it (the store goes when node 0 exits)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.store.check([_key(f"read/{n}") for n in nodes]):
            await asyncio.sleep(0.05)

    def _read_join(self, node: int) -> NodeJoin:
        data = self.store.get(_key(f"node/{node}"))
        try:
            join = decode_struct(data, NodeJoin)
        except msgspec.DecodeError:
            raise RendezvousError(
                f"node {node}'s entry in the store is not a ppserve join (another program?)"
            ) from None
        if join.node != node:
            raise RendezvousError(f"the store's entry for node {node} claims to be node {join.node}")
        return join

    def _check(self, join: NodeJoin, fingerprint: dict[str, str], settings: dict[str, str]) -> str | None:
        key = self.cluster.key
        if key is None and join.proof:
            return "it has a cluster key and node 0 runs with --insecure-cluster"
        if key is not None and not (join.proof and proof_matches(key, join.proof, *_join_parts(self.session, join))):
            return "its cluster key differs from node 0's" if join.proof else "it has no cluster key and node 0 has one"
        try:  # where the node says it listens: checked before anyone connects there
            for address in (join.control, *join.edges.values()):
                check_address(address, "its address")
        except AddressError as e:
            return str(e)
        if mismatch := describe_mismatch(fingerprint, join.fingerprint):
            return f"its checkpoint differs from node 0's: {mismatch}"
        differ = [
            f"{name} {settings.get(name)} on node 0, {join.settings.get(name)} there"
            for name in sorted(set(settings) | set(join.settings))
            if settings.get(name) != join.settings.get(name)
        ]
        if differ:
            return "its settings differ from node 0's (run the same command on every node): " + "; ".join(differ)
        return None

    def publish(self, layout: Layout) -> None:
        """Every node's go-ahead, with the addresses of the whole pipeline."""
        for node in range(1, self.cluster.nnodes):
            key = self.cluster.key
            tag = proof(key, self.session, str(node), _digest(layout)) if key else ""
            self._answer(node, Verdict(layout=layout, proof=tag))

    def _answer(self, node: int, verdict: Verdict) -> None:
        self.store.set(_key(f"verdict/{node}"), encode_struct(verdict))

    def close(self) -> None:
        del self.store


async def join_cluster(
    cluster: ClusterConfig,
    fingerprint: dict[str, str],
    settings: dict[str, str],
    control: str,
    edges: dict[int, str],
    timeout_s: float,
) -> tuple[Layout, dist.TCPStore]:
    """Node R's side: wait for node 0, join, and return the pipeline's layout. Raises
    RendezvousError with node 0's reason if refused, or if node 0 is not there in time."""
    where = cluster.dist_init_addr
    deadline = time.monotonic() + timeout_s
    await _wait_reachable(cluster.dist_init_host, cluster.dist_init_port, deadline)

    def connect() -> dist.TCPStore:
        return dist.TCPStore(
            cluster.dist_init_host, cluster.dist_init_port, is_master=False, timeout=timedelta(seconds=timeout_s)
        )

    try:
        store = await asyncio.to_thread(connect)
        session = (await asyncio.to_thread(store.get, _key("session"))).decode()
    except dist.DistError as e:
        raise RendezvousError(f"cannot join node 0 at {where}: {e}") from None
    key = cluster.key
    join = NodeJoin(
        node=cluster.node_rank,
        addr=cluster.node_addr,
        hostname=socket.gethostname(),
        proof="",
        fingerprint=fingerprint,
        settings=settings,
        control=control,
        edges=edges,
    )
    if key is not None:
        join = msgspec.structs.replace(join, proof=proof(key, *_join_parts(session, join)))
    verdict_key = _key(f"verdict/{cluster.node_rank}")
    # Store calls block: they run in a thread, each within a few seconds (node 0 may vanish).
    store.set_timeout(timedelta(seconds=5))
    try:
        await asyncio.to_thread(store.set, _key(f"node/{cluster.node_rank}"), encode_struct(join))
        while not await asyncio.to_thread(store.check, [verdict_key]):
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"node 0 at {where} gave no answer within {timeout_s:.0f} s (is it still waiting for other nodes?)"
                )
            await asyncio.sleep(0.05)
        verdict = decode_struct(await asyncio.to_thread(store.get, verdict_key), Verdict)
        await asyncio.to_thread(store.set, _key(f"read/{cluster.node_rank}"), "1")
    except dist.DistError:
        raise RendezvousError(f"node 0 at {where} went away during start-up (see its log for why)") from None
    except msgspec.DecodeError:
        raise RendezvousError(f"node 0's answer in the store at {where} is not a ppserve verdict") from None
    if verdict.error:
        raise RendezvousError(f"node 0 refused this node: {verdict.error}")
    layout = verdict.layout
    if layout is None or (
        key and not proof_matches(key, verdict.proof, session, str(cluster.node_rank), _digest(layout))
    ):
        raise RendezvousError(f"the answer from {where} is not signed with this node's cluster key; ignoring it")
    return layout, store


def _join_parts(session: str, join: NodeJoin) -> tuple[str, str, str]:
    """What a join's HMAC covers: this start-up, the node, and everything else it says."""
    return session, str(join.node), encode_struct(msgspec.structs.replace(join, proof=""))


def _digest(layout: Layout) -> str:
    return encode_struct(layout)


async def _wait_reachable(host: str, port: int, deadline: float) -> None:
    """Until node 0's store accepts connections (quietly: the store's own client logs every
    retry), or the deadline passes."""
    said = False
    while True:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2.0)
            writer.close()
            return
        except (OSError, TimeoutError):
            if time.monotonic() > deadline:
                raise RendezvousError(f"node 0 is not reachable at {host}:{port}") from None
            if not said:
                log.info("waiting for node 0 at %s:%d", host, port)
                said = True
            await asyncio.sleep(POLL_S)
