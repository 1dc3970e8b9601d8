"""Opening a tensor channel: which kind an edge gets (`--tensor-transport`) and the factory that
builds either end of it. Kept apart from `tensor_channel.py` so that the base class does not
import its own subclasses."""

from __future__ import annotations

from concurrent.futures import Executor
from typing import TYPE_CHECKING

import zmq.asyncio

from ppserve.transport.dist_channel import DistChannel
from ppserve.transport.shm_channel import ShmChannel
from ppserve.transport.tensor_channel import ChannelSpec, TensorChannel
from ppserve.transport.zmq_channel import ZmqChannel

if TYPE_CHECKING:
    from ppserve.transport.cluster_key import Guard

KINDS = ("auto", "shm", "gloo", "nccl", "zmq")


def resolve_kind(kind: str, device: str, same_host: bool, shared_gpu: bool = False) -> str:
    """One edge's kind. `same_host`: both ends on one node; `shared_gpu`: some GPU of the
    pipeline holds two stages (NCCL then refuses the whole group). `auto`: nccl between CUDA
    stages each on its own GPU; otherwise shm within a node (on a shared GPU, through host
    memory), and across nodes gloo on CPU or zmq on CUDA."""
    if kind not in KINDS:
        raise ValueError(f"tensor transport must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "auto":
        if device == "cuda" and not shared_gpu:
            return "nccl"
        if same_host:
            return "shm"
        return "zmq" if device == "cuda" else "gloo"
    if kind == "nccl" and device != "cuda":
        raise ValueError("tensor transport 'nccl' needs --device cuda")
    if kind == "nccl" and shared_gpu:
        raise ValueError("tensor transport 'nccl' needs each stage on its own GPU (NCCL refuses two on one)")
    if kind == "shm" and not same_host:
        raise ValueError("tensor transport 'shm' works within one node only (use auto, gloo or zmq across nodes)")
    return kind


def open_channel(
    ctx: zmq.asyncio.Context,
    spec: ChannelSpec,
    *,
    sender: bool,
    guard: Guard | None = None,
    executor: Executor | None = None,
) -> TensorChannel:
    """One end of an edge: `sender` for rank `spec.src`, else for rank `spec.dst`; `guard`: the
    cluster key, across nodes; `executor`: where tensor copies run (see TensorChannel)."""
    if spec.kind == "shm":
        return ShmChannel(ctx, spec, sender=sender, guard=guard, executor=executor)
    if spec.kind in ("gloo", "nccl"):
        return DistChannel(ctx, spec, sender=sender, guard=guard, executor=executor)
    if spec.kind == "zmq":
        return ZmqChannel(ctx, spec, sender=sender, guard=guard, executor=executor)
    raise ValueError(f"unknown tensor channel kind {spec.kind!r}")
