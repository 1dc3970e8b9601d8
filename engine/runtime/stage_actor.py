"""A stage as a Ray actor (`--executor ray`): the same stage code as a stage process, in a process
that Ray starts on the node where the placement group put the stage's bundle.

The host creates the actors first and asks each where it landed (`where`: its node, and ports
free there); only then are all the addresses known, and each actor is told to run its stage
(`run`, which returns when the stage stops). Nothing of the pipeline passes through Ray: plans,
results and heartbeats use the stage's ZeroMQ sockets, activations its tensor channel.
"""

from __future__ import annotations

import os

import msgspec

from ppserve.engine.runtime.stage_worker import StageLaunch, run_stage
from ppserve.transport.addresses import free_ports


class StagePlace(msgspec.Struct, frozen=True):
    """Where a stage's actor runs."""

    node_id: str  # Ray's node id
    address: str  # the node's address: the stage's sockets bind it
    pid: int
    edge_port: int  # free on that node now: the stage's inbound edge binds it
    dist_port: int  # ... and, on stage 0, the torch.distributed store


class StageActor:
    """Wrapped with `ray.remote` by the host (engine/runtime/ray_stages.py); plain here, so that
    this module imports without Ray."""

    def where(self, address: str | None) -> StagePlace:
        """`address`: where to bind (a Ray of one machine: loopback); None: the node's own."""
        import ray

        address = address or ray.util.get_node_ip_address()
        edge_port, dist_port = free_ports(2, address)
        return StagePlace(ray.get_runtime_context().get_node_id(), address, os.getpid(), edge_port, dist_port)

    def run(self, launch: StageLaunch) -> int:
        """The stage, until it stops: 0 when the host shut it down, else 1."""
        return run_stage(launch)
