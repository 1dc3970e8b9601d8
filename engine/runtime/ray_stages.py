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
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ppserve.engine.cluster.remote_nodes import RemoteStage
from ppserve.engine.config import EngineConfig
from ppserve.engine.runtime.stage_actor import StageActor, StagePlace
from ppserve.engine.runtime.stage_pool import StageError, StagePool
from ppserve.engine.runtime.stage_worker import StageLaunch
from ppserve.transport.addresses import Addresses, tcp_address

log = logging.getLogger("ppserve.engine")

_PLACE_POLL_S = 0.5  # how often placing the stages looks at the placement group's state
_RESEND_KILL_S = 2.0  # how often placing them asks Ray again to end the actors they replace


class NoRoomError(StageError):
    """No node of the Ray cluster has room for a stage now; it may have later."""


def make_pool(config: EngineConfig, on_failure: Callable[[StageError], None]) -> StagePool:
    """The stages as processes, or under `--executor ray` as Ray actors (Ray is imported only then)."""
    return RayStagePool(config, on_failure) if config.ray is not None else StagePool(config, on_failure)


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

    def stage_nodes(self) -> tuple[tuple[str, str], ...]:
        return tuple((p.node_id, p.address) for p in self.places)

    @property
    def replaces_all(self) -> bool:
        return True  # the lost node's edges move with it: new addresses for its neighbours too

    async def _renew(self) -> None:
        if self.group is None:
            self._connect()  # on the loop's (main) thread, as Ray wants; nothing is served yet
        room_s = self.config.stage_start_timeout_s if not self.places else self.config.stage_timeout_s
        self.places = await self._place(room_s)
        edges = tuple(tcp_address(p.address, p.edge_port) for p in self.places[1:])
        self.addresses = Addresses(self.addresses.inbox_addr, self.addresses.plan_addrs, edges)

    def _connect(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        cfg, debug = self.ray_config, self.ray_config.ray_logs
        where = f"the Ray cluster at {cfg.address}" if cfg.address else "a Ray of this machine"
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
            raise StageError(f"cannot join {where}: {' '.join(str(e).split())[:300]}") from None
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
        if not debug:  # the driver prints the cluster's errors (a node marked dead, ...) by itself
            with contextlib.suppress(ImportError, AttributeError):
                import ray._private.worker as driver

                def to_debug_log(data: dict[str, Any], ignore_prefix: bool) -> None:
                    logging.getLogger("ray").debug("%s", " ".join(map(str, data.get("lines", []))))

                driver.print_to_stdstream = to_debug_log
        self.group = placement_group([self._bundle()] * self.config.pp_size, strategy=cfg.strategy)
        log.info("placing %d stages on %s (%s)", self.config.pp_size, where, cfg.strategy)

    def _bundle(self) -> dict[str, float]:
        return {"CPU": float(self.config.threads_per_stage), **({"GPU": 1.0} if self.config.device == "cuda" else {})}

    async def _place(self, room_s: float) -> list[StagePlace]:
        """An actor per stage, each in its bundle, and where each landed. Ray has `room_s` to give
        every bundle a node (after a node is lost it moves that node's bundles to one with room);
        once it has, the actors have `stage_start_timeout_s` to start there (a new worker process on
        a busy node takes a while, which is not a lack of room). An actor that dies as it starts
        (its bundle was on a node that was lost meanwhile) is made again. One that has not started
        when the time is up (no room) is kept for the next attempt, and NoRoomError names its stage:
        it starts where Ray moves its bundle once there is room (killing it instead races with Ray
        granting it that room, which can leave the room held by nobody)."""
        import ray

        started = killed_at = time.monotonic()
        placed_since: float | None = None  # since when every bundle has had a node
        warned = False
        previous = [proc for proc in self.procs if isinstance(proc, RayStage)]  # the stages replaced
        local = None if self.ray_config.address else self.ray_config.host_addr  # no key: loopback only
        places: dict[int, StagePlace] = {}
        refs: dict[int, Any] = {}  # per stage not placed yet: its actor's answer to come
        while True:
            for stage in range(self.config.pp_size):
                if stage not in places and stage not in refs:
                    if stage not in self._actors:
                        self._actors[stage] = self._new_actor(stage)
                    refs[stage] = self._actors[stage].where.remote(local)
            # In slices, to see the placement group's state between them.
            pending = list(refs.values())
            done, _ = await asyncio.to_thread(ray.wait, pending, num_returns=len(pending), timeout=_PLACE_POLL_S)
            died = False
            for stage, ref in list(refs.items()):
                if ref in done:
                    del refs[stage]
                    try:
                        places[stage] = ray.get(ref)  # ready: does not block
                    except ray.exceptions.RayError:
                        self._give_up(stage)
                        died = True
            if len(places) == self.config.pp_size:
                return [places[stage] for stage in range(self.config.pp_size)]
            now = time.monotonic()
            placed = await asyncio.to_thread(self._bundles_placed)
            placed_since = (placed_since or now) if placed else None
            if placed_since is not None and now - placed_since > self.config.stage_timeout_s and not warned:
                warned = True
                log.warning("stage(s) %s placed but not started after %.0f s", sorted(refs), now - placed_since)
            if now - killed_at >= _RESEND_KILL_S:
                killed_at = now
                for old in previous:  # again: until Ray has ended them, their bundles' room is theirs
                    old.kill()
            deadline = started + room_s
            if placed_since is not None:
                deadline = max(deadline, placed_since + self.config.stage_start_timeout_s)
            if now >= deadline:
                break
            if died:
                await asyncio.sleep(0.5)  # before a new actor where one just died
        missing = [stage for stage in range(self.config.pp_size) if stage not in places]
        if placed_since is not None:
            raise StageError(
                f"stage(s) {', '.join(map(str, missing))} did not start within "
                f"{self.config.stage_start_timeout_s:.0f} s of Ray placing them",
                missing[0],
            )
        needs = ", ".join(f"{v:g} {k}" for k, v in self._bundle().items())
        raise NoRoomError(
            f"stage(s) {', '.join(map(str, missing))} cannot be placed: no Ray node has room for "
            f"{needs} ({self.ray_config.strategy}); waited {room_s:.0f} s",
            missing[0],
        )

    def _bundles_placed(self) -> bool:
        """Whether Ray has a node for every bundle of the placement group now (its state CREATED;
        RESCHEDULING while a lost node's bundles look for room, PENDING before the first time)."""
        from ray.util.placement_group import placement_group_table

        try:
            return bool(placement_group_table(self.group).get("state") == "CREATED")
        except Exception:  # the GCS did not answer this time: as if not placed
            return False

    def _new_actor(self, stage: int) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self._bundle()
        where = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=stage)
        options = {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0.0), "max_restarts": 0}
        return ray.remote(StageActor).options(scheduling_strategy=where, **options).remote()

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
