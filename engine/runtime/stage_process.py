"""A stage as an operating-system process: how it is spawned, named, and told to keep its memory.

The stage's own work is stage_worker.py; these are the few calls around it that only make sense
for a process of its own."""

from __future__ import annotations

import contextlib
import ctypes
import signal
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from multiprocessing.process import BaseProcess
from typing import Any

import torch.multiprocessing as mp

from ppserve.engine.config import EngineConfig
from ppserve.transport.addresses import Addresses
from ppserve.transport.tensor_channel import ChannelSpec


def spawn(target: Callable[..., Any], arg: object, name: str) -> BaseProcess:
    """Start `target(arg)` in a fresh (spawned) daemon process named `name`."""
    proc = mp.get_context("spawn").Process(target=target, args=(arg,), name=name, daemon=True)
    with _sigint_blocked():
        proc.start()
    return proc


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Block SIGINT while a stage process is spawned. Ctrl-C reaches the whole process group;
    the child inherits the blocked signal, so a stage interrupted while it still imports torch
    prints no KeyboardInterrupt traceback (the host decides when stages stop). In this process
    a Ctrl-C that comes meanwhile stays pending and is delivered when the block ends."""
    # Starting multiprocessing's resource tracker (which spawning does on first use) unblocks
    # SIGINT when it is done, so it is started before the block.
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def keep_freed_memory() -> None:
    """Tell glibc to serve big blocks from its heap and keep freed memory: a stage allocates
    and frees the same multi-MB activations every step, and handing them back to the OS each
    time turns every step into thousands of page faults.

    And one arena for every thread, called before the stage starts its threads: the compute
    thread's own arena would be made of heaps of at most 64 MB, so a bigger block (the 0.5B
    shape's gate/up output at a 2048-token prefill: 80 MB in float32) is mmap'd and unmapped on
    every call whatever the threshold, and that linear ran slower than on the main thread
    (docs/benchmarks.md#against-vllm-and-llamacpp)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
        libc.mallopt(-8, 1)  # M_ARENA_MAX


def set_process_name(name: str) -> None:
    """The OS-level name (what `ps -o comm` and `top` show), Linux only."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def channel_specs(config: EngineConfig, addresses: Addresses, local: list[int]) -> list[ChannelSpec]:
    """Every edge's spec; a shared-memory ring for each shm edge between two of the `local`
    stages (the ones this process spawns: both ends of an shm edge are on one node)."""
    specs = []
    for i, kind in enumerate(config.edge_transports):
        ring = None
        if kind == "shm" and i in local:
            from ppserve.transport.shm_channel import allocate_ring

            slot_bytes = config.max_batched_tokens * config.model_config.hidden_size * config.torch_dtype.itemsize
            ring = allocate_ring(config.pp_size + config.async_depth, slot_bytes)
        specs.append(ChannelSpec(kind, i, i + 1, addresses.edge(i), ring))
    return specs
