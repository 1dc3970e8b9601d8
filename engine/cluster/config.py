"""Which node runs which stages, and where this node is on the network.

The same command runs on every node: `ppserve serve --nnodes N --node-rank R --dist-init-addr
HOST:PORT ...`. Node 0 runs the host (scheduler, tokenizer, HTTP) and its own stages; every other
node runs only its stages, which connect to node 0. Stages are dealt to nodes in pipeline order:
an even split (the remainder on the later nodes, since node 0 also runs the host) or
`--stages-per-node 1,2,1`.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from ppserve.engine.model.model_config import ConfigError
from ppserve.engine.settings import setting

MULTI_NODE = "multi-node (the same command on every node, each with its own --node-rank)"
RAY = "Ray (stages as Ray actors, placed on a Ray cluster; pip install 'ppserve[ray]')"
EXECUTORS = ("processes", "ray")
STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(frozen=True)
class ClusterInputs:
    """Where the stages run: the settings `ClusterConfig.create` and `RayConfig.create` are made
    from (their flags are generated from here, server/cli_engine.py)."""

    nnodes: int = setting(1, "nodes the stages are spread over", ge=1, group=MULTI_NODE)
    node_rank: int = setting(0, "this node: 0 runs the host (HTTP, scheduler) and its stages", ge=0, group=MULTI_NODE)
    dist_init_addr: str | None = setting(
        None, "node 0's address for the nodes to meet at", metavar="HOST:PORT", default_text="none, one node",
        group=MULTI_NODE,
    )  # fmt: skip
    stages_per_node: str | None = setting(
        None, "stages on each node, e.g. 1,2,1", metavar="COUNTS", default_text="even, the rest on later nodes",
        group=MULTI_NODE,
    )  # fmt: skip
    node_addr: str | None = setting(
        None,
        "this node's address: its sockets bind it, the others connect to it",
        metavar="ADDR",
        default_text="the local address of the route to --dist-init-addr",
        group=MULTI_NODE,
    )
    cluster_key_file: str | None = setting(
        None,
        "the cluster's shared secret, the same file on every node",
        metavar="PATH",
        default_text="env PPSERVE_CLUSTER_KEY, else none",
        group=MULTI_NODE,
    )
    insecure_cluster: bool = setting(
        False,
        "run a multi-node cluster or a disaggregated pair without a key: anyone who can reach their sockets can "
        "drive them",
        group=MULTI_NODE,
    )
    executor: str = setting(
        "processes",
        "how the stages run: processes of this machine (with --nnodes, of several), or Ray actors",
        choices=EXECUTORS,
        group=RAY,
    )
    ray_address: str | None = setting(
        None,
        "the Ray cluster to join, as `ray start --head` printed it",
        metavar="HOST:PORT",
        default_text="start a Ray of this machine",
        group=RAY,
    )
    placement_strategy: str = setting(
        "PACK",
        "how the stages spread over the Ray nodes: PACK (few nodes), SPREAD, STRICT_SPREAD (one per node)",
        choices=STRATEGIES,
        group=RAY,
    )


@dataclass(frozen=True)
class ClusterConfig:
    nnodes: int
    node_rank: int
    stage_nodes: tuple[int, ...]  # the node of each stage
    dist_init_host: str  # node 0's rendezvous address (torch.distributed's TCPStore)
    dist_init_port: int
    node_addr: str  # this node's address: its sockets bind it, the others connect to it
    key: bytes | None = field(default=None, repr=False)  # the cluster secret; None: --insecure-cluster

    @classmethod
    def create(
        cls,
        *,
        nnodes: int,
        node_rank: int,
        pp_size: int,
        dist_init_addr: str | None,
        stages_per_node: str | None = None,
        node_addr: str | None = None,
        key: bytes | None = None,
        insecure: bool = False,
    ) -> ClusterConfig:
        if nnodes < 1:
            raise ConfigError(f"--nnodes must be >= 1, got {nnodes}")
        if not 0 <= node_rank < nnodes:
            raise ConfigError(f"--node-rank must be in [0, {nnodes - 1}], got {node_rank}")
        if not dist_init_addr:
            raise ConfigError(
                "--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)"
            )
        host, port = parse_host_port(dist_init_addr)
        if key is None and not insecure:
            raise ConfigError(
                "a multi-node cluster needs a shared secret: --cluster-key-file PATH or env PPSERVE_CLUSTER_KEY "
                "(or --insecure-cluster on a network you trust)"
            )
        counts = split_stages(pp_size, nnodes, stages_per_node)
        stage_nodes = tuple(node for node, count in enumerate(counts) for _ in range(count))
        if node_addr:
            check_local(node_addr)
        return cls(
            nnodes=nnodes,
            node_rank=node_rank,
            stage_nodes=stage_nodes,
            dist_init_host=host,
            dist_init_port=port,
            node_addr=node_addr or route_source(host, port),
            key=key,
        )

    @property
    def is_host(self) -> bool:
        return self.node_rank == 0

    def stages_of(self, node: int) -> list[int]:
        return [s for s, n in enumerate(self.stage_nodes) if n == node]

    @property
    def local_stages(self) -> list[int]:
        return self.stages_of(self.node_rank)

    @property
    def dist_init_addr(self) -> str:
        return join_host_port(self.dist_init_host, self.dist_init_port)


def split_stages(pp_size: int, nnodes: int, spec: str | None = None) -> list[int]:
    """Stages per node: `spec` ("1,2,1": one positive count per node, summing to pp_size), or an
    even split with the remainder on the later nodes."""
    if spec is None or not spec.strip():
        if nnodes > pp_size:
            raise ConfigError(f"--nnodes {nnodes} is more than the {pp_size} pipeline stages: every node needs one")
        base, extra = divmod(pp_size, nnodes)
        return [base + (1 if i >= nnodes - extra else 0) for i in range(nnodes)]
    try:
        counts = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ConfigError(f"--stages-per-node: expected comma-separated counts such as 1,2,1, got {spec!r}") from None
    if len(counts) != nnodes or any(c < 1 for c in counts) or sum(counts) != pp_size:
        raise ConfigError(
            f"--stages-per-node {spec!r} must name one count >= 1 for each of the {nnodes} nodes, "
            f"summing to --pp-size {pp_size}"
        )
    return counts


def parse_host_port(text: str, flag: str = "--dist-init-addr") -> tuple[str, int]:
    """'10.0.0.1:29500' or '[fd00::1]:29500' (`flag`: whose value it is, for the error)."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{flag}: expected HOST:PORT such as 10.0.0.1:29500, got {text!r}")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def interface_of(addr: str) -> str | None:
    """The name of the network interface that holds IPv4 address `addr` (Linux), if any.
    gloo and NCCL pick their interface by name; by default they follow the hostname, which
    often resolves to loopback."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(raw[20:24]) == addr:
                return name
    return None


def check_local(addr: str) -> None:
    """`--node-addr` must be an IP address of this machine: its sockets bind it."""
    try:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        socket.inet_pton(family, addr)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
    except OSError as e:
        reason = e.strerror or "not an IP address"
        raise ConfigError(f"--node-addr {addr!r} is not an IP address of this machine ({reason})") from None


def route_source(host: str, port: int) -> str:
    """This machine's address on the route to host:port (a UDP connect sends nothing)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except OSError as e:
        raise ConfigError(f"no route to --dist-init-addr {host}:{port} ({e.strerror or e}); give --node-addr") from None
