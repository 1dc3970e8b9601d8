"""Prefill/decode disaggregation, the decode host's half (engine/disagg/rooms.py has the picture): it
reserves a request's KV, opens a room at a prefill server, and decodes on once the first token
and every stage's KV are in, or fails the room when the prefill side goes silent."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field

import msgspec

from ppserve.engine.disagg.rooms import (
    PROGRESS_S,
    TICK_S,
    UNDELIVERED,
    Connector,
    DisaggregationError,
    RoomHost,
    RoomTasks,
    log,
    room_guard,
    room_inbox,
)
from ppserve.scheduler.bootstrap import KvState
from ppserve.scheduler.request import Request
from ppserve.scheduler.sampling_params import MAX_TOP_LOGPROBS
from ppserve.transport.control import context
from ppserve.transport.messages import (
    KvExpect,
    KvForget,
    KvStatus,
    KvTarget,
    Msg,
    RoomFailed,
    RoomFirstToken,
    RoomOpen,
    RoomProgress,
    Sampled,
)
from ppserve.transport.peers import AddressError, LogLimiter, PeerLinks, check_address


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


class DecodeRooms(Connector):
    """A decode engine's rooms: reserves the KV, asks a prefill engine for it, decodes on."""

    def __init__(self, host: RoomHost) -> None:
        self.host = host
        cfg = self.config = host.config
        self.ctx = context()
        self.guard = room_guard(self.ctx, cfg.socket_key, "decode host", cfg.disagg_address())
        self.inbox = room_inbox(self.ctx, cfg.disagg_address(), self.guard, cfg.max_model_len)
        self.address = self.inbox.address
        self.links = PeerLinks(self.ctx, self.guard, send_timeout_s=cfg.disagg_bootstrap_timeout_s)
        self.rooms: dict[str, _DecodeRoom] = {}
        self.tasks = RoomTasks("decode host")
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
                if (problem := self._bad_sample(msg.sample)) is None:
                    room.first = msg.sample
                else:  # never fed to the stages: a token outside the vocabulary would crash them
                    room.error = f"the prefill side failed in state Transferring: its first token {problem}"
            else:
                room.error, room.from_prefill = msg.error[:1000], True
            room.check()

    def _bad_sample(self, sample: Sampled) -> str | None:
        """What is wrong with a first token from the prefill side, checked as the last stage's
        own samples never need to be (a peer's model may differ: another vocabulary)."""
        vocab = self.config.model_config.vocab_size
        ids = [sample.token_id, *(t for t, _ in sample.top_logprobs)]
        logprobs = [lp for lp in (sample.logprob, *(p for _, p in sample.top_logprobs)) if lp is not None]
        if any(not 0 <= t < vocab for t in ids):
            return f"is outside this model's vocabulary (size {vocab})"
        if any(math.isnan(lp) or lp > 1e-3 for lp in logprobs) or len(sample.top_logprobs) > MAX_TOP_LOGPROBS:
            return "comes with logprobs that are not logprobs"
        return None

    def on_kv_status(self, status: KvStatus) -> None:
        room = self.rooms.get(status.room)
        if room is None:
            return
        if status.state == "Received":
            room.received.add(status.stage)
        elif status.state == "Failed":
            room.error = f"decode stage {status.stage} failed in state Receiving: {status.error}"
        room.check()

    async def prefill_remotely(self, request: Request, prefill: str) -> Sampled | None:
        """Reserve the request's KV here, have `prefill` compute it; returns the first token once
        the KV is in and the request may decode (None: it was aborted meanwhile). Raises
        DisaggregationError (everything freed, both sides told)."""
        name, cfg, host = request.request_id, self.config, self.host
        try:
            check_address(prefill, "the prefill server's bootstrap address")
        except AddressError as e:
            raise DisaggregationError(str(e)) from None
        deadline = time.monotonic() + cfg.disagg_bootstrap_timeout_s
        while (blocks := host.handover.reserve(request)) is None:
            if time.monotonic() > deadline:
                raise DisaggregationError("the decode side has no room in its KV cache for the prompt")
            await asyncio.sleep(TICK_S)
        room = self.rooms[name] = _DecodeRoom(cfg.pp_size, time.monotonic())
        try:
            for stage in range(cfg.pp_size):
                host.send_to(stage, KvExpect(name, blocks))
            addresses = host.kv_addresses()
            stages = [KvTarget(i, addresses[i], r.start, r.stop) for i, r in enumerate(cfg.layer_ranges)]
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
            # The KV is in: the request decodes from here (unless it was aborted meanwhile).
            return room.first if host.handover.activate(name, room.first.token_id) is not None else None
        except BaseException:
            for stage in range(cfg.pp_size):
                host.send_to(stage, KvForget(name))
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
