"""The `ppserve` flags and start-up of stages across machines: a cluster's nodes, and one side
of a disaggregated prefill/decode pair (kept apart from cli.py, which is about the commands)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from ppserve.engine.cluster.config import ClusterConfig
    from ppserve.engine.cluster.ray_config import RayConfig
    from ppserve.engine.config import EngineConfig


def cluster_key(args: argparse.Namespace) -> bytes | None:
    """The secret of `--cluster-key-file` (or PPSERVE_CLUSTER_KEY), which `--insecure-cluster` excludes."""
    from ppserve.transport.cluster_key import load_key

    key = load_key(args.cluster_key_file)
    if key is not None and args.insecure_cluster:
        raise ValueError("--insecure-cluster and a cluster key exclude each other")
    return key


def ray_config(args: argparse.Namespace) -> RayConfig | None:
    if args.executor != "ray":
        for flag, given in (
            ("--ray-address", args.ray_address),
            ("--placement-strategy", args.placement_strategy != "PACK"),
        ):
            if given:
                raise ValueError(f"{flag} needs --executor ray")
        return None
    from ppserve.engine.cluster.ray_config import RayConfig

    return RayConfig.create(
        address=args.ray_address,
        strategy=args.placement_strategy,
        node_addr=args.node_addr,
        key=cluster_key(args),
        insecure=args.insecure_cluster,
        ray_logs=getattr(args, "log_level", "info") == "debug",
    )


def cluster_config(args: argparse.Namespace) -> ClusterConfig | None:
    if args.nnodes == 1 and args.node_rank == 0:
        return None
    from ppserve.engine.cluster.config import ClusterConfig

    key = cluster_key(args)
    # Who joins, who is refused and why: said on the terminal of every node.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ppserve.cluster").setLevel(logging.INFO)
    return ClusterConfig.create(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        pp_size=args.pp_size,
        dist_init_addr=args.dist_init_addr,
        stages_per_node=args.stages_per_node,
        node_addr=args.node_addr,
        key=key,
        insecure=args.insecure_cluster,
    )


def disaggregation_options(args: argparse.Namespace) -> dict[str, Any]:
    from ppserve.transport.cluster_key import load_key

    if not getattr(args, "disaggregation", None):
        return {}
    return {
        "disagg_host": args.node_addr or args.host,
        "disagg_key": load_key(args.cluster_key_file),  # the pair's sockets speak CURVE
        "disagg_insecure": args.insecure_cluster,
    }


def serve_node(config: EngineConfig) -> NoReturn:
    """Node R > 0 of a cluster: run this node's stages until node 0 stops the cluster."""
    from ppserve.engine.runtime.node_agent import run_node

    print(
        f"ppserve: node {config.cluster.node_rank if config.cluster else 0} of a cluster; the host is node 0",
        flush=True,
    )
    code = 0

    async def node() -> None:
        nonlocal code
        code = await run_node(config)

    run_loop(node())
    sys.exit(code)


def run_loop(coro: Coroutine[object, object, None]) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)
