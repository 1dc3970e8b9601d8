"""The stages on a Ray cluster (`--executor ray`): one placement group for the pipeline, one bundle
and one actor (engine/runtime/stage_actor.py) per stage.

    connect (ray.init) -> placement group, by --placement-strategy -> an actor per bundle
        -> each says where it landed -> the layout (addresses) -> each runs its stage

Ray places; ppserve's own planes carry the pipeline: the host's ZeroMQ sockets (keyed with the
cluster secret) and each edge's tensor channel. There is no shared memory between two actors, so
every edge is a process-group channel (gloo on CPU, nccl on CUDA) or zmq.

A stage is lost when Ray reports its actor dead (its process or its node died) or when its
heartbeats stop, whichever comes first. Then every stage is replaced: the actors are killed, new
ones are created in the same placement group, which Ray has meanwhile re-placed on the nodes that
are left (a lost node's bundles move to one with room), and the requests replay exactly. Where no
node has room for a bundle, the replacement gives up after `stage_timeout_s` with an error naming
the stage and what it needs (the engine fails its requests and keeps trying; engine/async_engine.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ppserve.engine.cluster.remote_nodes import RemoteStage
from ppserve.engine.config import EngineConfig
from ppserve.engine.runtime.stage_actor import StageActor, StagePlace
from ppserve.engine.runtime.stage_pool import NoRoomError, StageError, StagePool
from ppserve.engine.runtime.stage_worker import StageLaunch
from ppserve.transport.addresses import Addresses, tcp_address

log = logging.getLogger("ppserve.engine")


class RayStage(RemoteStage):
    """A stage's actor, as StagePool sees a stage: alive until its `run` call ends or fails."""

    def __init__(self, stage: int, actor: Any, place: StagePlace, run: Future[int]) -> None:
        super().__init__(stage, -1, place.address)
        self.actor = actor
        self.place = place
        self.pid = place.pid
        run.add_done_callback(self._ended)  # called on a thread of Ray's

    def _ended(self, run: Future[int]) -> None:
        try:
            self.exitcode = run.result()
            why = f"its stage exited (code {self.exitcode})"
        except Exception as e:  # the actor died: Ray says why (its process, or its node)
            why = f"its actor died: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
        self.gone = self.gone or why

    def kill(self) -> None:
        import ray

        super().kill()
        with contextlib.suppress(Exception):  # gone already, or Ray shut down
            ray.kill(self.actor, no_restart=True)

    def describe(self) -> str:
        return f"stage {self.stage} on Ray node {self.place.node_id[:12]} ({self.addr}, pid {self.pid})"


class RayStagePool(StagePool):
    def __init__(self, config: EngineConfig, on_failure: Callable[[StageError], None]) -> None:
        assert config.ray is not None
        super().__init__(config, on_failure)
        self.ray_config = config.ray
        self.group: Any = None  # the placement group
        self._actors: dict[int, Any] = {}  # per stage: its actor that does not run a stage yet
        self.places: list[StagePlace] = []  # where each stage's actor runs now

    @property
    def replaces_all(self) -> bool:
        return True  # the lost node's edges move with it: new addresses for its neighbours too

    async def _renew(self) -> None:
        if self.group is None:
            self._connect()  # on the loop's (main) thread, as Ray wants; nothing is served yet
        timeout_s = self.config.stage_start_timeout_s if not self.places else self.config.stage_timeout_s
        self.places = await self._place(timeout_s)
        edges = tuple(tcp_address(p.address, p.edge_port) for p in self.places[1:])
        self.addresses = Addresses(self.addresses.inbox_addr, self.addresses.plan_addrs, edges)

    def _connect(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        cfg, debug = self.ray_config, self.ray_config.ray_logs
        logging.getLogger("ray").setLevel(logging.DEBUG if debug else logging.ERROR)
        # ray.init sets SIGTERM and SIGINT handlers of its own (exit at once); the server's, which
        # drain first, are put back.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        # Ray's own lines (its workers' output, its start-up notes) only when debugging.
        try:
            ray.init(
                address=cfg.address or "local",  # "local": a new Ray of this machine, never one found running
                include_dashboard=False,
                log_to_driver=debug,
                logging_level=logging.INFO if debug else logging.ERROR,
                configure_logging=debug,
                namespace="ppserve",
            )
        except Exception as e:  # unreachable, refused (its auth token), a version that differs, ...
            where = f"the Ray cluster at {cfg.address}" if cfg.address else "a Ray of this machine"
            raise StageError(f"cannot join {where}: {' '.join(str(e).split())[:300]}") from None
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
        self.group = placement_group([self._bundle()] * self.config.pp_size, strategy=cfg.strategy)
        where = f"the Ray cluster at {cfg.address}" if cfg.address else "a Ray of this machine"
        log.info("placing %d stages on %s (%s)", self.config.pp_size, where, cfg.strategy)

    def _bundle(self) -> dict[str, float]:
        return {"CPU": float(self.config.threads_per_stage), **({"GPU": 1.0} if self.config.device == "cuda" else {})}

    async def _place(self, timeout_s: float) -> list[StagePlace]:
        """An actor per stage, each in its bundle, and where each landed. An actor that has not
        started when the time is up (no room; or its bundle was on a node that died meanwhile) is
        given up, and NoRoomError names its stage; the next attempt makes a new one."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self._bundle()
        actor_class = ray.remote(StageActor)
        for stage in range(self.config.pp_size):
            if stage not in self._actors:
                where = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=stage)
                options = {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0.0), "max_restarts": 0}
                self._actors[stage] = actor_class.options(scheduling_strategy=where, **options).remote()
        local = None if self.ray_config.address else self.ray_config.host_addr  # no key: loopback only
        refs = [self._actors[stage].where.remote(local) for stage in range(self.config.pp_size)]
        _, waiting = await asyncio.to_thread(ray.wait, refs, num_returns=len(refs), timeout=timeout_s)
        if waiting:
            stages = [refs.index(r) for r in waiting]
            for stage in stages:
                self._give_up(stage)
            needs = ", ".join(f"{v:g} {k}" for k, v in bundle.items())
            raise NoRoomError(
                f"stage(s) {', '.join(map(str, stages))} cannot be placed: no Ray node has room for "
                f"{needs} ({self.ray_config.strategy}); waited {timeout_s:.0f} s",
                stages[0],
            )
        try:
            return await asyncio.to_thread(ray.get, refs)
        except ray.exceptions.RayError as e:  # an actor died as it started: try afresh next time
            for stage in range(self.config.pp_size):
                self._give_up(stage)
            raise StageError(f"a stage's actor failed to start: {e}") from None

    def _give_up(self, stage: int) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self._actors.pop(stage), no_restart=True)

    def _start_stage(self, launch: StageLaunch) -> RayStage:
        from dataclasses import replace

        stage = launch.stage
        place = self.places[stage]
        launch = replace(
            launch,
            parent_pid=0,  # an actor's parent is its node's raylet; Ray ends it when this host goes
            dist_host=self.places[0].address,
            dist_port=self.places[0].dist_port,
            node_addr=place.address,
        )
        actor = self._actors.pop(stage)  # runs its stage now: a later placement makes a new one
        return RayStage(stage, actor, place, actor.run.remote(launch).future())

    async def close(self, timeout_s: float = 5.0) -> None:
        await super().close(timeout_s)
        import ray

        for proc in self.procs:
            proc.kill()
        for stage in list(self._actors):
            self._give_up(stage)
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.group)
        ray.shutdown()
