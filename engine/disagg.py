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
(side, stage, state) and frees its KV on both. The prefill host tells each decode host every
second where its rooms stand (RoomProgress), so a prefill server that dies is noticed within the
bootstrap or transfer timeout of the state it died in.

Nothing a peer sends can crash either host, or make it hold memory or sockets without bound:
the pair's sockets need the cluster key (unless --insecure-cluster), every field of a room is
checked as an HTTP request is (sampling parameters, prompt length and vocabulary, addresses),
replies go through bounded links (transport/peers.py), and every task is supervised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio

from ppserve.engine.kv_blocks import LayerSlice, layer_slices
from ppserve.scheduler.bootstrap import BootstrapTable, KvState, Room, handshake_order
from ppserve.scheduler.request import Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.transport.cluster_key import CurveKeys, Guard
from ppserve.transport.control import PullSocket, context
from ppserve.transport.messages import (
    ControlMsg,
    KvBootstrap,
    KvExpect,
    KvExport,
    KvForget,
    KvStatus,
    KvTarget,
    Msg,
    RoomFailed,
    RoomFirstToken,
    RoomOpen,
    RoomProgress,
    RoomState,
    Sampled,
    WireSamplingParams,
)
from ppserve.transport.peers import AddressError, LogLimiter, PeerLinks, check_address

if TYPE_CHECKING:
    from ppserve.engine.async_engine import AsyncEngine

log = logging.getLogger("ppserve.disagg")
TICK_S = 0.1
PROGRESS_S = 1.0  # how often the prefill host tells each decode host where its rooms stand
MAX_ROOM_CHARS = 256  # a room's name (the decode side's request id)
MAX_ROOM_MESSAGE_BYTES = 64 << 20  # one message on a room inbox (a prompt of millions of token ids fits)
UNDELIVERED = (AddressError, TimeoutError, zmq.ZMQError)  # a reply no peer took


class DisaggregationError(RuntimeError):
    """A room failed: the message names the side, the stage and the state."""


def _guard(ctx: zmq.asyncio.Context, key: bytes | None, who: str, address: str) -> Guard | None:
    """The pair's sockets speak CURVE under the cluster key; without one (--insecure-cluster,
    which EngineConfig requires then) anyone who reaches them is heard, and the log says so."""
    if key is None:
        log.warning("%s: --insecure-cluster: %s takes rooms from anyone who can reach it", who, address)
        return None
    return Guard(ctx, CurveKeys.from_secret(key), who)


def _inbox(ctx: zmq.asyncio.Context, address: str, guard: Guard | None) -> PullSocket:
    return PullSocket(ctx, address, bind=True, guard=guard, max_msg_bytes=MAX_ROOM_MESSAGE_BYTES)


def first_token_params(w: WireSamplingParams) -> SamplingParams:
    """The prefill side's request: the decode side's sampling parameters, checked as an HTTP
    request's are (ValueError naming the field), for one token, whatever it is (the decode side
    decides on EOS). prompt_logprobs are refused by the engine's check: the room is refused, naming them."""
    return SamplingParams.from_wire(w, max_tokens=1, ignore_eos=True)


class _Tasks:
    """A host's room tasks: held (so none is collected while it runs) and, should one raise
    what it does not handle itself, logged with its traceback rather than lost."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.running: set[asyncio.Task[None]] = set()

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self.running.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self.running.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("%s: a room task failed", self.who, exc_info=error)

    def cancel(self) -> None:
        for task in self.running:
            task.cancel()


def _slowest(r: Room) -> int:
    """The room's stage furthest behind (the one holding it up)."""
    order = list(KvState)
    return min(range(len(r.states)), key=lambda i: (order.index(r.states[i]), i))


@dataclass
class _PrefillRoom:
    open: RoomOpen
    params: SamplingParams
    told_failure: bool = False
    task: asyncio.Task[None] | None = None


class PrefillRooms:
    """A prefill engine's rooms: admits them centrally, prefills, has the stages send the KV."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        cfg = self.config = engine.config
        self.table = BootstrapTable(cfg.pp_size, cfg.disagg_bootstrap_timeout_s, cfg.disagg_transfer_timeout_s)
        self.ctx = context()
        self.guard = _guard(self.ctx, cfg.socket_key, "prefill host", cfg.disagg_address(cfg.disagg_port))
        self.inbox = _inbox(self.ctx, cfg.disagg_address(cfg.disagg_port), self.guard)
        self.address = self.inbox.address
        self.links = PeerLinks(self.ctx, self.guard, send_timeout_s=cfg.disagg_bootstrap_timeout_s)
        self.rooms: dict[str, _PrefillRoom] = {}
        self.tasks = _Tasks("prefill host")
        self.junk = LogLimiter(log)  # a peer can repeat these at will: one line per 10 s

    async def serve(self) -> None:
        """Read RoomOpen / RoomFailed, apply the table's decisions every tick, and tell each decode
        host where its rooms stand every PROGRESS_S."""
        reader = asyncio.ensure_future(self.inbox.recv())
        progress_at = 0.0
        try:
            while True:
                await asyncio.wait([reader], timeout=TICK_S)
                if reader.done():
                    msg = self._take(reader)
                    reader = asyncio.ensure_future(self.inbox.recv())
                    try:
                        if isinstance(msg, RoomOpen):
                            self._open(msg)
                        elif isinstance(msg, RoomFailed) and msg.room in self.rooms:
                            self._fail(msg.room, "decode", None, msg.error[:1000])
                    except Exception:  # a bug shows in the log; the room server goes on
                        log.exception("prefill host: a room message failed")
                self._decide()
                if (now := time.monotonic()) >= progress_at:
                    self._progress()
                    progress_at = now + PROGRESS_S
        finally:
            reader.cancel()

    def _take(self, reader: asyncio.Future[ControlMsg]) -> ControlMsg | None:
        try:
            return reader.result()
        except msgspec.DecodeError:
            self.junk.warning("prefill host: dropped a message that is not ppserve's")
            return None

    def _open(self, msg: RoomOpen) -> None:
        try:
            reply_to = check_address(msg.reply_to, "reply_to")
        except AddressError as e:  # nowhere to say so
            self.junk.warning("prefill host: dropped room %.80r: %s", msg.room, e)
            return
        try:
            params, slices = self._check(msg)
        except (ValueError, RuntimeError) as e:  # a malformed room is refused; it never reaches the stages
            self.junk.warning("prefill host: refused room %.80r: %s", msg.room, e)
            self._send(reply_to, RoomFailed(msg.room, f"the prefill side refused the room: {e}"))
            return
        self.table.open(msg.room, time.monotonic())
        self.rooms[msg.room] = _PrefillRoom(msg, params)
        for stage in handshake_order(self.config.pp_size):
            targets = [
                KvTarget(s.dst, msg.decode_stages[s.dst].address, s.layers.start, s.layers.stop)
                for s in slices
                if s.src == stage
            ]
            self.engine.pool.send_to(stage, KvBootstrap(msg.room, targets))

    def _check(self, msg: RoomOpen) -> tuple[SamplingParams, list[LayerSlice]]:
        """Every field of a room, as a peer sent it: ValueError (or the engine's refusal) says what is wrong."""
        cfg, num_layers = self.config, self.config.model_config.num_layers
        if not 0 < len(msg.room) <= MAX_ROOM_CHARS:
            raise ValueError(f"a room's name has 1 to {MAX_ROOM_CHARS} characters")
        if msg.room in self.rooms or msg.room in self.table.rooms:
            raise ValueError(f"room {msg.room!r} is already in use")
        if len(self.rooms) >= cfg.max_waiting_requests:
            raise ValueError(f"{len(self.rooms)} rooms are open here already (--max-waiting-requests)")
        if msg.num_layers != num_layers or msg.block_size != cfg.block_size:
            raise ValueError(
                f"the decode side has {msg.num_layers} layers in blocks of {msg.block_size}, the prefill side "
                f"{num_layers} in blocks of {cfg.block_size}"
            )
        stops = [0] + [t.layer_stop for t in msg.decode_stages]
        if not 0 < len(msg.decode_stages) <= num_layers or any(
            t.layer_start != stops[i] or t.layer_stop <= t.layer_start for i, t in enumerate(msg.decode_stages)
        ):
            raise ValueError("the decode side's stages do not cover its layers in order")
        for t in msg.decode_stages:
            check_address(t.address, "a decode stage's KV address")
        slices = layer_slices(cfg.layer_ranges, [range(t.layer_start, t.layer_stop) for t in msg.decode_stages])
        params = first_token_params(msg.params)
        self.engine.check_request(
            msg.prompt_token_ids, params, cache_salt=msg.cache_salt
        )  # length, vocabulary, salt, a queue with room
        return params, slices

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
            room.task = self.tasks.spawn(self._prefill(name, room))
        self.table.expire(now)
        for name, room in self.rooms.items():
            r = self.table.rooms.get(name)
            if r is not None and r.error is not None and not room.told_failure:
                room.told_failure = True
                log.warning("room %s failed: %s", name, r.error)
                self._send(room.open.reply_to, RoomFailed(name, str(r.error)))
                if room.task is not None:
                    room.task.cancel()
                for stage in self.table.pending(name):
                    self.engine.pool.send_to(stage, KvForget(name))
        for r in self.table.release(now):
            gone = self.rooms.pop(r.room, None)
            if gone is not None and r.succeeded:  # all sent: from here, what is missing is the decode side's
                self._send(gone.open.reply_to, RoomProgress([RoomState(r.room, 0, KvState.SUCCESS.value)]))
            if self.engine.scheduler.release_held(r.room):
                self.engine.wake()

    def _progress(self) -> None:
        """One RoomProgress per decode host, for its rooms still in progress here."""
        by_peer: dict[str, list[RoomState]] = {}
        for name, room in self.rooms.items():
            r = self.table.rooms.get(name)
            if r is not None and r.error is None:
                stage = _slowest(r)
                by_peer.setdefault(room.open.reply_to, []).append(RoomState(name, stage, r.states[stage].value))
        for peer, states in by_peer.items():
            self._send(peer, RoomProgress(states))

    async def _prefill(self, name: str, room: _PrefillRoom) -> None:
        msg = room.open
        try:
            sample = None
            prompt, salt = msg.prompt_token_ids, msg.cache_salt  # the decode side's tenant
            async for out in self.engine.generate(prompt, room.params, request_id=name, hold_kv=True, cache_salt=salt):
                if out.token_ids:
                    lp = out.logprobs[0] if out.logprobs else None
                    top = [(t, p) for t, p in lp.top_logprobs] if lp else []
                    sample = Sampled(name, out.token_ids[0], lp.logprob if lp else None, top)
            held = self.engine.scheduler.held.get(name)
            if sample is None or held is None:
                raise DisaggregationError("the prefill produced no token")
        except Exception as e:  # the room's failure, never the room server's
            self._fail(name, "prefill", None, f"{type(e).__name__}: {e}")
            return
        self._send(msg.reply_to, RoomFirstToken(name, sample))
        for stage in range(self.config.pp_size):
            self.engine.pool.send_to(stage, KvExport(name, list(held.block_table)))

    def _send(self, peer: str, msg: Msg) -> None:
        """To a decode host, in the background; a room whose decode host takes no word fails."""

        async def send() -> None:
            try:
                await self.links.send(peer, msg)
            except UNDELIVERED as e:
                self.junk.warning("prefill host: %s took no %s: %s", peer, type(msg).__name__, e or "timed out")
                if isinstance(msg, RoomFirstToken) and msg.room in self.rooms:
                    self._fail(msg.room, "decode", None, f"its host at {peer} took no first token")

        self.tasks.spawn(send())

    def _fail(self, name: str, side: str, stage: int | None, reason: str) -> None:
        self.table.fail(name, side, stage, reason, time.monotonic())
        self._decide()

    def close(self) -> None:
        self.tasks.cancel()
        self.inbox.close()
        self.links.close()
        if self.guard is not None:
            self.guard.stop()
        self.ctx.term()


@dataclass
class _DecodeRoom:
    stages: int
    heard_at: float  # the prefill side's last word about this room
    prefill_stage: int | None = None  # where the prefill side said the room stands
    prefill_state: str = KvState.BOOTSTRAPPING.value
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
        self.ctx = context()
        self.guard = _guard(self.ctx, cfg.socket_key, "decode host", cfg.disagg_address())
        self.inbox = _inbox(self.ctx, cfg.disagg_address(), self.guard)
        self.address = self.inbox.address
        self.links = PeerLinks(self.ctx, self.guard, send_timeout_s=cfg.disagg_bootstrap_timeout_s)
        self.rooms: dict[str, _DecodeRoom] = {}
        self.tasks = _Tasks("decode host")
        self.junk = LogLimiter(log)

    async def serve(self) -> None:
        while True:
            try:
                msg = await self.inbox.recv()
            except msgspec.DecodeError:
                self.junk.warning("decode host: dropped a message that is not ppserve's")
                continue
            now = time.monotonic()
            if isinstance(msg, RoomProgress):
                for s in msg.rooms:
                    if (room := self.rooms.get(s.room)) is not None:
                        room.heard_at, room.prefill_stage, room.prefill_state = now, s.stage, s.state[:40]
                continue
            if not isinstance(msg, (RoomFirstToken, RoomFailed)) or (room := self.rooms.get(msg.room)) is None:
                continue  # a room that ended here already
            room.heard_at = now
            if isinstance(msg, RoomFirstToken):
                room.first = msg.sample
            else:
                room.error, room.from_prefill = msg.error[:1000], True
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
        try:
            check_address(prefill, "the prefill server's bootstrap address")
        except AddressError as e:
            raise DisaggregationError(str(e)) from None
        deadline = time.monotonic() + cfg.disagg_bootstrap_timeout_s
        while (blocks := self.engine.scheduler.reserve_prefilled(request)) is None:
            if time.monotonic() > deadline:
                raise DisaggregationError("the decode side has no room in its KV cache for the prompt")
            await asyncio.sleep(TICK_S)
        room = self.rooms[name] = _DecodeRoom(cfg.pp_size, time.monotonic())
        try:
            for stage in range(cfg.pp_size):
                pool.send_to(stage, KvExpect(name, blocks))
            stages = [KvTarget(i, pool.kv_addresses[i], r.start, r.stop) for i, r in enumerate(cfg.layer_ranges)]
            opened = RoomOpen(
                name,
                list(request.prompt_token_ids),
                request.params.wire(),
                stages,
                cfg.block_size,
                cfg.model_config.num_layers,
                self.inbox.address,
                request.cache_salt,
            )
            try:
                await self.links.send(prefill, opened)
            except UNDELIVERED as e:
                room.error = (
                    f"the prefill side failed in state Bootstrapping: {prefill} took no room "
                    f"({e or 'timed out'}: is it up, with this cluster key?)"
                )
            room.heard_at = time.monotonic()
            while room.error is None and not room.done.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(room.done.wait(), PROGRESS_S)
                room.error = room.error or self._silence(room, prefill)
            if room.error is not None:
                raise DisaggregationError(room.error)
            assert room.first is not None
            return room.first
        except BaseException:
            for stage in range(cfg.pp_size):
                pool.send_to(stage, KvForget(name))
            if not room.from_prefill:
                failed = RoomFailed(name, room.error or "the decode side's request ended")
                self.tasks.spawn(self._tell(prefill, failed))
            raise
        finally:
            self.rooms.pop(name, None)

    def _silence(self, room: _DecodeRoom, prefill: str) -> str | None:
        """The room's error if the prefill side has been silent about it for longer than the
        timeout of the state it last reported (its KV all sent: what is still missing is ours)."""
        cfg, quiet = self.config, time.monotonic() - room.heard_at
        if room.prefill_state == KvState.SUCCESS.value:
            if quiet <= cfg.disagg_transfer_timeout_s:
                return None
            missing = [i for i in range(room.stages) if i not in room.received]
            return (
                f"decode stage {missing[0] if missing else 0} failed in state Receiving: the prefill side sent "
                f"the KV, but decode stages {missing} did not have it all within {cfg.disagg_transfer_timeout_s:g} s"
            )
        transferring = room.prefill_state == KvState.TRANSFERRING.value
        limit = cfg.disagg_transfer_timeout_s if transferring else cfg.disagg_bootstrap_timeout_s
        if quiet <= limit:
            return None
        who = "the prefill side" if room.prefill_stage is None else f"prefill stage {room.prefill_stage}"
        return (
            f"{who} failed in state {room.prefill_state}: no word from the prefill server at {prefill} "
            f"for {limit:g} s (is it down?)"
        )

    async def _tell(self, peer: str, msg: Msg) -> None:
        try:
            await self.links.send(peer, msg)
        except UNDELIVERED as e:
            self.junk.warning("decode host: %s took no %s: %s", peer, type(msg).__name__, e or "timed out")

    def close(self) -> None:
        self.tasks.cancel()
        self.inbox.close()
        self.links.close()
        if self.guard is not None:
            self.guard.stop()
        self.ctx.term()
