"""One core set per stage: each stage process, and so its OpenMP team, stays on its own cores.

Unpinned, the kernel moves a stage's compute threads between cores and lets two stages' teams
share a core for a while; an OpenMP team is only as fast as its slowest thread, so each such
moment stalls the whole team. When a node's stages fit its cores (stages x threads <= cores),
stage k of the node gets cores [k * threads, (k + 1) * threads) of the CPUs this process may use.
When they do not fit, nothing is pinned and the OS shares the cores. The host process is never
pinned: it floats to whichever core is free.

Pinning is opt-in (the config's `pin_stages`, from PPSERVE_PIN_STAGES=1 when the config is made):
on a two-core machine its gain did not stand out from the noise
(docs/benchmarks.md#where-a-decode-step-goes), and a pinned stage cannot move away from a core
that something else keeps busy.
"""

from __future__ import annotations

import os

from ppserve.engine.config import EngineConfig


def stage_cores(config: EngineConfig, stage: int, threads: int) -> set[int] | None:
    """The cores stage `stage` of this node should run on, or None to leave it unpinned."""
    if not config.pin_stages or config.ray is not None or not hasattr(os, "sched_getaffinity"):
        return None  # (under Ray, the stages sharing a node are not known here)
    cluster = config.cluster
    if cluster is None:
        local = list(range(config.pp_size))
    else:
        local = [s for s, node in enumerate(cluster.stage_nodes) if node == cluster.stage_nodes[stage]]
    cores = sorted(os.sched_getaffinity(0))
    if len(local) * threads > len(cores) or len(local) == 1:
        return None  # oversubscribed, or a single stage that may use every core anyway
    k = local.index(stage)
    return set(cores[k * threads : (k + 1) * threads])


def pin_stage(config: EngineConfig, stage: int, threads: int) -> set[int] | None:
    """Pin this process (a stage) to its cores; returns them, or None when left unpinned."""
    cores = stage_cores(config, stage, threads)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    return cores
