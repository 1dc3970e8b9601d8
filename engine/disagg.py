"""Prefill/decode disaggregation, host side: the rooms of a prefill engine and of a decode engine.

    decode host                              prefill host                      prefill stages
    reserve blocks; KvExpect -> its stages
    RoomOpen (prompt, where each decode  ->  open the room (bootstrap table)
      stage receives, its layers)            KvBootstrap, highest stage first ->  connect; WaitingForInput
                                             all WaitingForInput: admit, prefill
                          <- RoomFirstToken  the first token is sampled; KvExport ->  Transferring ... Success
    its stages report Received                                                   (KV goes stage to stage)
    all Received + first token: decode on    all Success or Failed: free the KV

Every decision about a room is the prefill host's (scheduler/bootstrap.py) or, for its own half,
the decode host's; a failure or timeout on either side ends the room on both with the error
(side, stage, state) and frees its KV on both. Nothing a peer sends can crash either host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import zmq.asyncio

from ppserve.engine.kv_blocks import layer_slices
from ppserve.scheduler.bootstrap import BootstrapTable, KvState, handshake_order
from ppserve.scheduler.request import Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.transport.cluster_key import CurveKeys, Guard
from ppserve.transport.control import PullSocket, PushSocket, context
from ppserve.transport.messages import (
    ControlMsg,
    KvBootstrap,
    KvExpect,
    KvExport,
    KvForget,
    KvStatus,
    KvTarget,
    RoomFailed,
    RoomFirstToken,
    RoomOpen,
    Sampled,
)

if TYPE_CHECKING:
    from ppserve.engine.async_engine import AsyncEngine

log = logging.getLogger("ppserve.disagg")
TICK_S = 0.1


def _guard(ctx: zmq.asyncio.Context, key: bytes | None, who: str) -> Guard | None:
    """With a secret (--cluster-key-file), the pair's sockets speak CURVE, as a cluster's do."""
    return Guard(ctx, CurveKeys.from_secret(key), who) if key is not None else None


def _read(reader: asyncio.Future[ControlMsg]) -> ControlMsg | None:
    """A message off the inbox; None (and a warning) for anything that is not ppserve's."""
    try:
        return reader.result()
    except msgspec.DecodeError:
        log.warning("prefill host: dropped a message that is not ppserve's")
        return None


class DisaggregationError(RuntimeError):
    """A room failed: the message names the side, the stage and the state."""


class _Links:
    """PUSH sockets to peers by address, opened on first use."""

    def __init__(self, ctx: zmq.asyncio.Context, guard: Guard | None) -> None:
        self.ctx, self.guard = ctx, guard
        self.socks: dict[str, PushSocket] = {}

    def send(self, address: str, msg: RoomOpen | RoomFirstToken | RoomFailed) -> None:
        if address not in self.socks:
            self.socks[address] = PushSocket(self.ctx, address, bind=False, guard=self.guard)
        self.socks[address].send_nowait(msg)

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close(linger_ms=200)
        if self.guard is not None:
            self.guard.stop()


@dataclass
class _PrefillRoom:
    open: RoomOpen
    told_failure: bool = False
    task: asyncio.Task[None] | None = None


class PrefillRooms:
    """A prefill engine's rooms: admits them centrally, prefills, has the stages send the KV."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        cfg = self.config = engine.config
        self.table = BootstrapTable(cfg.pp_size, cfg.disagg_bootstrap_timeout_s, cfg.disagg_transfer_timeout_s)
        self.ctx = context()
        guard = _guard(self.ctx, cfg.socket_key, "prefill host")
        self.inbox = PullSocket(self.ctx, cfg.disagg_address(cfg.disagg_port), bind=True, guard=guard)
        self.address = self.inbox.address
        self.links = _Links(self.ctx, guard)
        self.rooms: dict[str, _PrefillRoom] = {}

    async def serve(self) -> None:
        """Read RoomOpen / RoomFailed, and apply the table's decisions every tick."""
        reader = asyncio.ensure_future(self.inbox.recv())
        try:
            while True:
                await asyncio.wait([reader], timeout=TICK_S)
                if reader.done():
                    msg = _read(reader)
                    reader = asyncio.ensure_future(self.inbox.recv())
                    if isinstance(msg, RoomOpen):
                        self._open(msg)
                    elif isinstance(msg, RoomFailed):
                        self._fail(msg.room, "decode", None, msg.error)
                self._decide()
        finally:
            reader.cancel()

    def _open(self, msg: RoomOpen) -> None:
        cfg = self.config
        problem = None
        if msg.room in self.rooms:
            problem = f"room {msg.room!r} is already in use"
        elif msg.num_layers != cfg.model_config.num_layers or msg.block_size != cfg.block_size:
            problem = (
                f"the decode side has {msg.num_layers} layers in blocks of {msg.block_size}, the prefill side "
                f"{cfg.model_config.num_layers} in blocks of {cfg.block_size}"
            )
        slices = []
        if problem is None:
            try:
                decode = [range(t.layer_start, t.layer_stop) for t in msg.decode_stages]
                slices = layer_slices(cfg.layer_ranges, decode)
                if any(not 0 <= s.dst < len(msg.decode_stages) for s in slices):
                    raise ValueError("its stages do not match their layers")
            except ValueError as e:
                problem = f"the decode side's layers do not fit: {e}"
        if problem is not None:  # a malformed room is refused; it never reaches the stages
            self.links.send(msg.reply_to, RoomFailed(msg.room, f"the prefill side refused the room: {problem}"))
            return
        self.table.open(msg.room, time.monotonic())
        self.rooms[msg.room] = _PrefillRoom(msg)
        pool = self.engine.pool
        for stage in handshake_order(cfg.pp_size):
            targets = [
                KvTarget(s.dst, msg.decode_stages[s.dst].address, s.layers.start, s.layers.stop)
                for s in slices
                if s.src == stage
            ]
            pool.send_to(stage, KvBootstrap(msg.room, targets))

    def on_kv_status(self, status: KvStatus) -> None:
        try:
            state = KvState(status.state)
        except ValueError:
            return
        self.table.report(status.room, status.stage, state, time.monotonic(), status.error)
        self._decide()

    def _decide(self) -> None:
        now = time.monotonic()
        for name in self.table.admit():
            room = self.rooms[name]
            room.task = asyncio.create_task(self._prefill(name, room.open))
        self.table.expire(now)
        for name, room in self.rooms.items():
            r = self.table.rooms.get(name)
            if r is not None and r.error is not None and not room.told_failure:
                room.told_failure = True
                log.warning("room %s failed: %s", name, r.error)
                self.links.send(room.open.reply_to, RoomFailed(name, str(r.error)))
                if room.task is not None:
                    room.task.cancel()
                for stage in self.table.pending(name):
                    self.engine.pool.send_to(stage, KvForget(name))
        for r in self.table.release(now):
            self.rooms.pop(r.room, None)
            if self.engine.scheduler.release_held(r.room):
                self.engine.wake()

    async def _prefill(self, name: str, msg: RoomOpen) -> None:
        w = msg.params
        params = SamplingParams(
            max_tokens=1,
            temperature=w.temperature,
            top_k=w.top_k,
            top_p=w.top_p,
            min_p=w.min_p,
            presence_penalty=w.presence_penalty,
            frequency_penalty=w.frequency_penalty,
            repetition_penalty=w.repetition_penalty,
            seed=w.seed,
            logprobs=w.logprobs,
            prompt_logprobs=w.prompt_logprobs,  # refused by the engine here: the room fails, naming it
            ignore_eos=True,  # the first token is sampled whatever it is: the decode side decides on EOS
        )
        try:
            sample = None
            async for out in self.engine.generate(msg.prompt_token_ids, params, request_id=name, hold_kv=True):
                if out.token_ids:
                    lp = out.logprobs[0] if out.logprobs else None
                    top = [(t, p) for t, p in lp.top_logprobs] if lp else []
                    sample = Sampled(name, out.token_ids[0], lp.logprob if lp else None, top)
            held = self.engine.scheduler.held.get(name)
            if sample is None or held is None:
                raise DisaggregationError("the prefill produced no token")
        except (DisaggregationError, RuntimeError, ValueError) as e:
            self._fail(name, "prefill", None, f"{type(e).__name__}: {e}")
            return
        self.links.send(msg.reply_to, RoomFirstToken(name, sample))
        for stage in range(self.config.pp_size):
            self.engine.pool.send_to(stage, KvExport(name, list(held.block_table)))

    def _fail(self, name: str, side: str, stage: int | None, reason: str) -> None:
        self.table.fail(name, side, stage, reason, time.monotonic())
        self._decide()

    def close(self) -> None:
        for room in self.rooms.values():
            if room.task is not None:
                room.task.cancel()
        self.inbox.close()
        self.links.close()
        self.ctx.term()


@dataclass
class _DecodeRoom:
    stages: int
    first: Sampled | None = None
    received: set[int] = field(default_factory=set)
    error: str | None = None
    from_prefill: bool = False  # the prefill side ended it (and needs no word back)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def check(self) -> None:
        if self.error is not None or (self.first is not None and len(self.received) == self.stages):
            self.done.set()


class DecodeRooms:
    """A decode engine's rooms: reserves the KV, asks a prefill engine for it, decodes on."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        cfg = self.config = engine.config
        self.timeout_s = cfg.disagg_bootstrap_timeout_s + cfg.disagg_transfer_timeout_s
        self.ctx = context()
        guard = _guard(self.ctx, cfg.socket_key, "decode host")
        self.inbox = PullSocket(self.ctx, cfg.disagg_address(), bind=True, guard=guard)
        self.address = self.inbox.address
        self.links = _Links(self.ctx, guard)
        self.rooms: dict[str, _DecodeRoom] = {}

    async def serve(self) -> None:
        while True:
            try:
                msg = await self.inbox.recv()
            except msgspec.DecodeError:
                log.warning("decode host: dropped a message that is not ppserve's")
                continue
            room = self.rooms.get(getattr(msg, "room", ""))
            if room is None:
                continue  # a room that ended here already
            if isinstance(msg, RoomFirstToken):
                room.first = msg.sample
            elif isinstance(msg, RoomFailed):
                room.error, room.from_prefill = msg.error, True
            room.check()

    def on_kv_status(self, status: KvStatus) -> None:
        room = self.rooms.get(status.room)
        if room is None:
            return
        if status.state == "Received":
            room.received.add(status.stage)
        elif status.state == "Failed":
            room.error = f"decode stage {status.stage} failed in state Receiving: {status.error}"
        room.check()

    async def prefill_remotely(self, request: Request, prefill: str) -> Sampled:
        """Reserve the request's KV here, have `prefill` compute it; returns the first token once
        the KV is in. Raises DisaggregationError (everything freed, both sides told)."""
        name, cfg, pool = request.request_id, self.config, self.engine.pool
        deadline = time.monotonic() + self.timeout_s
        while (blocks := self.engine.scheduler.reserve_prefilled(request)) is None:
            if time.monotonic() > deadline:
                raise DisaggregationError("the decode side has no room in its KV cache for the prompt")
            await asyncio.sleep(TICK_S)
        room = self.rooms[name] = _DecodeRoom(cfg.pp_size)
        try:
            for stage in range(cfg.pp_size):
                pool.send_to(stage, KvExpect(name, blocks))
            stages = [KvTarget(i, pool.kv_addresses[i], r.start, r.stop) for i, r in enumerate(cfg.layer_ranges)]
            self.links.send(
                prefill,
                RoomOpen(
                    name,
                    list(request.prompt_token_ids),
                    request.params.wire(),
                    stages,
                    cfg.block_size,
                    cfg.model_config.num_layers,
                    self.inbox.address,
                ),
            )
            try:
                await asyncio.wait_for(room.done.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                room.error = f"the decode side waited {self.timeout_s:g} s for the prefill side's KV"
            if room.error is not None:
                raise DisaggregationError(room.error)
            assert room.first is not None
            return room.first
        except BaseException:
            for stage in range(cfg.pp_size):
                pool.send_to(stage, KvForget(name))
            if not room.from_prefill:
                with contextlib.suppress(Exception):
                    self.links.send(prefill, RoomFailed(name, room.error or "the decode side's request ended"))
            raise
        finally:
            self.rooms.pop(name, None)

    def close(self) -> None:
        self.inbox.close()
        self.links.close()
        self.ctx.term()
