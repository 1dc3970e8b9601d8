"""Compute threads below the threads that carry tokens: a token is not held up behind a GEMM.

A stage's compute thread and its OpenMP team use every core they are given, without a pause,
while a request decodes. Everything that carries a token to its user (the stage's event loop and
ZeroMQ thread, the host's, the HTTP server) only wakes for a moment per step, but each time it
must take a core from that team, and at the default priority the kernel's scheduler may let the
team finish its time slice first: each of four or five hops can wait a slice. On SmolLM2 at batch 1
(two cores), the gaps between streamed tokens spread widely around the step's time; with the
compute threads at nice 10, a waking thread takes a core at once and the gaps stay close to it,
while the throughput at 32 streams stays the same (docs/benchmarks.md#against-vllm-and-llamacpp).

The compute threads keep the cores whenever nothing else wants them, so an idle machine gives
them everything; what a higher nice value gives up is their share against other busy programs on
the same machine (at nice 10 they get about a tenth of what a default-priority program gets).

Linux only: there the nice value belongs to a thread, and the threads it starts inherit it, so
setting it in the compute thread before it first runs a parallel region covers its OpenMP team.
Raising one's own nice value needs no privileges.
"""

from __future__ import annotations

import os
import sys
import threading


def lower_this_thread(nice: int) -> bool:
    """Run the calling thread (and the threads it starts from now on) at `nice`, where the OS gives
    each thread its own; returns whether it did. Never raises the thread's priority."""
    if sys.platform != "linux" or nice <= 0:
        return False
    tid = threading.get_native_id()
    if os.getpriority(os.PRIO_PROCESS, tid) >= nice:
        return False
    os.setpriority(os.PRIO_PROCESS, tid, nice)
    return True
