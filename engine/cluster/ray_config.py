"""Where the stages run when Ray places them (`--executor ray`): which cluster, how the stages
spread over its nodes, and where the host's sockets listen.

Ray is optional (`pip install 'ppserve[ray]'`); nothing here imports it, so the flags are checked,
and a missing Ray is named, before any stage starts.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from ppserve.engine.cluster.config import STRATEGIES, check_local, parse_host_port, route_source
from ppserve.engine.model.model_config import ConfigError

MISSING = "--executor ray needs Ray, which is not installed: pip install 'ppserve[ray]'"


@dataclass(frozen=True)
class RayConfig:
    address: str | None  # an existing cluster's GCS, HOST:PORT; None: start a local Ray on this machine
    strategy: str  # how the placement group spreads the stages' bundles: one of STRATEGIES
    host_addr: str  # this machine's address: the host's sockets bind it, the stages connect to it
    key: bytes | None = field(default=None, repr=False)  # the cluster secret; None: --insecure-cluster or local
    ray_logs: bool = False  # Ray's own log lines on the host's terminal (--log-level debug)

    @classmethod
    def create(
        cls,
        *,
        address: str | None,
        strategy: str = "PACK",
        node_addr: str | None = None,
        key: bytes | None = None,
        insecure: bool = False,
        ray_logs: bool = False,
    ) -> RayConfig:
        if not ray_installed():
            raise ConfigError(MISSING)
        if strategy not in STRATEGIES:
            raise ConfigError(f"--placement-strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if node_addr:
            check_local(node_addr)
        if not address:
            # A Ray of this machine only: every socket on loopback, so no key is needed.
            return cls(None, strategy, node_addr or "127.0.0.1", key, ray_logs)
        if "://" in address:  # Ray Client: this host would not be on the cluster's network
            raise ConfigError(f"--ray-address: expected the cluster's HOST:PORT (as `ray start` says), got {address!r}")
        host, port = parse_host_port(address, "--ray-address")
        if key is None and not insecure:
            raise ConfigError(
                "stages on a Ray cluster need a shared secret: --cluster-key-file PATH or env PPSERVE_CLUSTER_KEY "
                "(or --insecure-cluster on a network you trust)"
            )
        return cls(f"{host}:{port}", strategy, node_addr or route_source(host, port), key, ray_logs)


def ray_installed() -> bool:
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):  # ValueError: blocked (None in sys.modules)
        return False
