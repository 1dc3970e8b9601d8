"""Prefill/decode disaggregation, the prefill host's half (engine/disagg/rooms.py has the picture): it
checks each room a decode host opens, admits it centrally when every stage is ready
(scheduler/bootstrap.py), prefills it, has the stages send the KV, and tells the decode host
where the room stands every second."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import msgspec

from ppserve.engine.disagg.kv_blocks import LayerSlice, layer_slices
from ppserve.engine.disagg.rooms import (
    MAX_ROOM_CHARS,
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
from ppserve.scheduler.bootstrap import BootstrapTable, KvState, Room, handshake_order
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.transport.control import context
from ppserve.transport.messages import (
    ControlMsg,
    KvBootstrap,
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
from ppserve.transport.peers import LogLimiter, PeerLinks, check_address


def first_token_params(w: WireSamplingParams) -> SamplingParams:
    """The prefill side's request: the decode side's sampling parameters, checked as an HTTP
    request's are (ValueError naming the field), for one token, whatever it is (the decode side
    decides on EOS). prompt_logprobs are refused by the engine's check: the room is refused, naming them."""
    return SamplingParams.from_wire(w, max_tokens=1, ignore_eos=True)


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


class PrefillRooms(Connector):
    """A prefill engine's rooms: admits them centrally, prefills, has the stages send the KV."""

    def __init__(self, host: RoomHost) -> None:
        self.host = host
        cfg = self.config = host.config
        self.table = BootstrapTable(cfg.pp_size, cfg.disagg_bootstrap_timeout_s, cfg.disagg_transfer_timeout_s)
        self.ctx = context()
        self.guard = room_guard(self.ctx, cfg.socket_key, "prefill host", cfg.disagg_address(cfg.disagg_port))
        self.inbox = room_inbox(self.ctx, cfg.disagg_address(cfg.disagg_port), self.guard, cfg.max_model_len)
        self.address = self.inbox.address
        self.links = PeerLinks(self.ctx, self.guard, send_timeout_s=cfg.disagg_bootstrap_timeout_s)
        self.rooms: dict[str, _PrefillRoom] = {}
        self.tasks = RoomTasks("prefill host")
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
            if not 0 < len(msg.room) <= MAX_ROOM_CHARS:  # not echoed back, whatever its size
                raise ValueError(f"a room's name has 1 to {MAX_ROOM_CHARS} characters")
        except ValueError as e:  # no answer: nowhere to send it, or nothing to name it by
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
            self.host.send_to(stage, KvBootstrap(msg.room, targets))

    def _check(self, msg: RoomOpen) -> tuple[SamplingParams, list[LayerSlice]]:
        """Every field of a room, as a peer sent it: ValueError (or the engine's refusal) says what is wrong."""
        cfg, num_layers = self.config, self.config.model_config.num_layers
        if not 0 < len(msg.prompt_token_ids) < cfg.max_model_len:  # first: the checks below walk it
            raise ValueError(f"the prompt has {len(msg.prompt_token_ids)} tokens (1 to {cfg.max_model_len - 1})")
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
        if (
            not 0 < len(msg.decode_stages) <= num_layers
            or stops[-1] != num_layers
            or any(t.layer_start != stops[i] or t.layer_stop <= t.layer_start for i, t in enumerate(msg.decode_stages))
        ):
            raise ValueError("the decode side's stages do not cover its layers in order")
        for t in msg.decode_stages:
            check_address(t.address, "a decode stage's KV address")
        slices = layer_slices(cfg.layer_ranges, [range(t.layer_start, t.layer_stop) for t in msg.decode_stages])
        params = first_token_params(msg.params)
        # The prompt's vocabulary, the salt, a queue with room: as for an HTTP request.
        self.host.check_request(msg.prompt_token_ids, params, cache_salt=msg.cache_salt)
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
                    self.host.send_to(stage, KvForget(name))
        for r in self.table.release(now):
            gone = self.rooms.pop(r.room, None)
            if gone is not None and r.succeeded:  # all sent: from here, what is missing is the decode side's
                self._send(gone.open.reply_to, RoomProgress([RoomState(r.room, 0, KvState.SUCCESS.value)]))
            if self.host.handover.release(r.room):
                self.host.wake()

    def _progress(self) -> None:
        """One RoomProgress per decode host, for its rooms still in progress here."""
        by_peer: dict[str, list[RoomState]] = {}
        for name, room in self.rooms.items():
            r = self.table.rooms.get(name)
            if r is not None and r.error is None:
                stage = _slowest(r)
                by_peer.setdefault(room.open.reply_to, []).append(RoomState(name, stage, r.states[stage].value))
        for peer, states in by_peer.items():
            if not self.links.busy(peer):  # one waiting send per slow peer is enough
                self._send(peer, RoomProgress(states))

    async def _prefill(self, name: str, room: _PrefillRoom) -> None:
        msg = room.open
        try:
            sample = None
            prompt, salt = msg.prompt_token_ids, msg.cache_salt  # the decode side's tenant
            async for out in self.host.generate(prompt, room.params, request_id=name, hold_kv=True, cache_salt=salt):
                if out.token_ids:
                    lp = out.logprobs[0] if out.logprobs else None
                    top = [(t, p) for t, p in lp.top_logprobs] if lp else []
                    sample = Sampled(name, out.token_ids[0], lp.logprob if lp else None, top)
            blocks = self.host.handover.held_blocks(name)
            if sample is None or blocks is None:
                raise DisaggregationError("the prefill produced no token")
        except Exception as e:  # the room's failure, never the room server's
            self._fail(name, "prefill", None, f"{type(e).__name__}: {e}")
            return
        self._send(msg.reply_to, RoomFirstToken(name, sample))
        for stage in range(self.config.pp_size):
            self.host.send_to(stage, KvExport(name, blocks))
        self.table.exported(name, time.monotonic())

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
