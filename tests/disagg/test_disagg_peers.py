"""What a peer can do to a disaggregated pair: hostile rooms on the bootstrap port, junk on the
room and KV sockets, a prefill server that dies mid-room. The pair keeps serving exactly, holds
no more memory or sockets than its bounds, and frees every KV block."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from disagg_pair import GREEDY, KEY, collect, engine
from helpers import pipeline
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as seed_for
from hypothesis import strategies as st

from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.disagg.decode import DecodeRooms
from ppserve.engine.disagg.prefill import PrefillRooms
from ppserve.engine.disagg.rooms import DisaggregationError
from ppserve.transport.cluster_key import CurveKeys, Guard
from ppserve.transport.control import PullSocket, PushSocket, context
from ppserve.transport.messages import (
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

pytestmark = pytest.mark.slow

MESSAGES = 2600  # per mode (with the key, without it): over 5,000 in all
NUM_BLOCKS = 128
MAX_NEW_FDS = 400  # the prefill host's links are capped at 64 sockets (a few descriptors each)
MAX_STAGE_RSS_GROWTH = 256 << 20
PROMPT = [4, 5, 6, 7, 8, 9]
SHORT: dict[str, Any] = {"disagg_bootstrap_timeout_s": 1.0, "disagg_transfer_timeout_s": 1.0}

_junk_addresses = st.sampled_from(
    [
        "not an endpoint",
        "",
        "tcp://*:5555",
        "tcp://0.0.0.0:1",
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:99999",
        "ipc://relative",
        "udp://127.0.0.1:1",
        "inproc://x",
        "tcp://[zz]:1",
        "tcp://-bad-:1",
        "tcp://127.0.0.1:1\x00",
        "x" * 5000,
    ]
)
# Loopback ports below the kernel's range for outgoing connections, where nothing listens: a
# flood of distinct, well-formed reply addresses.
_nowhere = st.integers(20000, 29999).map(lambda port: f"tcp://127.0.0.1:{port}")
_addresses = st.one_of(_junk_addresses, _nowhere, st.text(max_size=40))
_floats = st.one_of(st.floats(), st.sampled_from([0.0, 0.5, 1.0]))
_wire = st.builds(
    WireSamplingParams,
    temperature=_floats,
    top_k=st.integers(-3, 2**40),
    top_p=_floats,
    min_p=_floats,
    presence_penalty=_floats,
    frequency_penalty=_floats,
    repetition_penalty=_floats,
    seed=st.none() | st.integers(-1, 2**63 - 1),
    logprobs=st.none() | st.integers(-1, 100),
    prompt_logprobs=st.none() | st.integers(-1, 30),
)
_names = st.one_of(st.text(max_size=12), st.sampled_from(["dup", "dup2", "r" * 1000]))
_targets = st.lists(
    st.builds(KvTarget, st.integers(-2, 4), _addresses, st.integers(-3, 40), st.integers(-3, 40)), max_size=4
)
_prompts = st.one_of(st.lists(st.integers(-10, 530), max_size=60), st.just(list(range(3000))))


def _hostile_room(layers: int) -> st.SearchStrategy[RoomOpen]:
    return st.builds(
        RoomOpen,
        _names,
        _prompts,
        _wire,
        _targets,
        st.one_of(st.just(16), st.integers(-1, 64)),
        st.one_of(st.just(layers), st.integers(-1, 64)),
        _addresses,
    )


def _decode_side_junk() -> st.SearchStrategy[Msg]:
    sampled = st.builds(Sampled, _names, st.integers(-5, 2**40), st.none() | st.floats())
    return st.one_of(
        st.builds(RoomProgress, st.lists(st.builds(RoomState, _names, st.integers(-5, 9), st.text()), max_size=20)),
        st.builds(RoomFirstToken, _names, sampled),
        st.builds(RoomFailed, _names, st.text(max_size=3000)),
    )


class Peer:
    """A stranger's sockets: PUSH to the pair's inboxes and KV ports, a PULL for replies."""

    def __init__(self, key: bytes | None, p: AsyncEngine, d: AsyncEngine) -> None:
        assert p.rooms is not None and d.rooms is not None
        self.ctx = context()
        self.guard = Guard(self.ctx, CurveKeys.from_secret(key), "peer") if key is not None else None
        self.inbox = PullSocket(self.ctx, "tcp://127.0.0.1:*", bind=True, guard=self.guard)
        self.to_prefill = PushSocket(self.ctx, p.rooms.address, bind=False, guard=self.guard)
        self.to_decode = PushSocket(self.ctx, d.rooms.address, bind=False, guard=self.guard)
        self.to_kv = [PushSocket(self.ctx, a, bind=False, guard=self.guard) for a in d.pool.kv_addresses]
        self.decode_ranges = d.config.layer_ranges
        self.replies = 0
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            await self.inbox.recv()
            self.replies += 1

    def close(self) -> None:
        self.reader.cancel()
        self.inbox.close()
        for push in (self.to_prefill, self.to_decode, *self.to_kv):
            push.close()
        if self.guard is not None:
            self.guard.stop()
        self.ctx.term()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


async def _settles(*checks: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not all(c() for c in checks):
        assert asyncio.get_running_loop().time() < deadline, "the pair did not settle"
        await asyncio.sleep(0.1)


Action = tuple[str, Any]  # what a peer does: ("room", RoomOpen), ("valid", (ports, prompt)), ...
KINDS = ("valid", "room", "failed", "decode", "junk", "kv")


@st.composite
def _valid(draw: st.DrawFn, stages: int) -> Action:
    """A well-formed room whose decode stages are nowhere: it is prefilled, then fails its transfer."""
    nowhere = draw(st.lists(_nowhere, min_size=stages, max_size=stages))
    return "valid", (nowhere, draw(st.lists(st.integers(0, 500), min_size=1, max_size=100)))


@st.composite
def _action(draw: st.DrawFn, layers: int) -> Action:
    kind = draw(st.integers(0, 99))
    if kind < 55:
        return "room", draw(_hostile_room(layers))
    if kind < 65:
        return "failed", RoomFailed(draw(_names), draw(st.text(max_size=5000)))
    if kind < 82:
        return "decode", draw(_decode_side_junk())
    if kind < 92:
        return "junk", (draw(st.booleans()), draw(st.binary(max_size=300)))
    return "kv", (draw(st.integers(0, 7)), draw(st.binary(max_size=80)), draw(st.binary(max_size=300)))


def _draw_actions(layers: int, stages: int, seed: int) -> list[Action]:
    """MESSAGES actions, drawn by hypothesis ahead of time (the engines then take them as fast as
    a network would bring them), from its generation phase only: its first examples are the
    simplest, the later ones are what a fuzzer is for."""
    actions: list[Action] = []
    batch = 50  # one valid room in each: 2% of the messages

    @given(st.tuples(_valid(stages)), st.lists(_action(layers), min_size=batch - 1, max_size=batch - 1))
    @settings(
        max_examples=MESSAGES // batch + 2,
        phases=[Phase.generate],
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @seed_for(seed)
    def take(valid: tuple[Action], hostile: list[Action]) -> None:
        actions.extend([*valid, *hostile])

    take()
    return actions[:MESSAGES]


async def _act(peer: Peer, action: Action, p: AsyncEngine, valid: int) -> None:
    kind, what = action
    if kind == "valid":
        nowhere, prompt = what
        pairs = enumerate(zip(nowhere, peer.decode_ranges, strict=True))
        stages = [KvTarget(j, a, r.start, r.stop) for j, (a, r) in pairs]
        layers = p.config.model_config.num_layers
        name = f"ok-{valid % 40}"  # names come back: some while still in use
        await peer.to_prefill.send(RoomOpen(name, prompt, GREEDY.wire(), stages, 16, layers, peer.inbox.address))
    elif kind in ("room", "failed"):
        await peer.to_prefill.send(what)
    elif kind == "decode":
        await peer.to_decode.send(what)
    elif kind == "junk":
        to_prefill, frame = what
        await (peer.to_prefill if to_prefill else peer.to_decode).send_frames([frame])
    else:
        i, header, data = what
        await peer.to_kv[i % len(peer.to_kv)].send_frames([header, data])


async def _fuzz(llama_dir: Path, keyed: bool) -> None:
    expected = pipeline(llama_dir).generate([PROMPT], GREEDY)[0].token_ids
    secure: dict[str, Any] = {} if keyed else {"disagg_insecure": True}
    async with engine(llama_dir, "prefill", 2, **SHORT, **secure) as p, engine(llama_dir, "decode", 1, **secure) as d:
        rooms = p.rooms
        assert isinstance(rooms, PrefillRooms)
        assert await collect(d, PROMPT, GREEDY, rooms.address) == expected
        layers = p.config.model_config.num_layers
        actions = _draw_actions(layers, d.config.pp_size, seed=1 if keyed else 2)
        kinds = {kind: sum(a[0] == kind for a in actions) for kind in KINDS}
        assert len(actions) == MESSAGES and min(kinds.values()) >= 20, kinds  # every kind, many times
        stage_pids = [proc.pid for proc in p.pool.procs if proc.pid is not None]
        fds, rss = _fds(), [_rss(pid) for pid in stage_pids]
        opened: list[str] = []
        real_open = rooms._open

        def spy(msg: RoomOpen) -> None:  # the rooms that reach the prefill host at all
            opened.append(msg.room)
            real_open(msg)

        rooms._open = spy  # type: ignore[method-assign]
        stranger = Peer(None, p, d) if keyed else None  # no key: refused at the handshake
        if stranger is not None:
            for i in range(400):
                try:
                    nokey = RoomOpen(f"nokey-{i}", PROMPT, GREEDY.wire(), [], 16, layers, "x")
                    await asyncio.wait_for(stranger.to_prefill.send(nokey), 1.0)
                except TimeoutError:
                    # Refused at the handshake, its socket may have no peer left to queue for: a
                    # send then waits forever. Shut out for good, which is the point.
                    break
        peer = Peer(KEY if keyed else None, p, d)
        try:
            valid = 0
            for i, action in enumerate(actions):
                await _act(peer, action, p, valid)
                valid += action[0] == "valid"
                if i % 200 == 0:
                    await asyncio.sleep(0)  # let the engines read as a network would
            # Settled: every room has reached the prefill host (on a loaded machine the last ones
            # are still on their way when the first have long been decided), and all are freed.
            await _settles(
                lambda: len(opened) == kinds["room"] + kinds["valid"],
                lambda: (
                    p.scheduler.allocator.num_free == NUM_BLOCKS and not rooms.rooms and not p.scheduler.handover.held
                ),
                lambda: d.scheduler.allocator.num_free == NUM_BLOCKS and not d.scheduler.handover.receiving,
            )
            # Still serving, exactly; nothing restarted; within bounds.
            assert await collect(d, PROMPT, GREEDY, rooms.address) == expected
            assert p.healthy and d.healthy and p.stage_restarts == [0, 0] and d.stage_restarts == [0]
            assert len(rooms.links.socks) <= rooms.links.max_links
            assert _fds() - fds < MAX_NEW_FDS, (fds, _fds())
            for pid, before in zip(stage_pids, rss, strict=True):
                assert _rss(pid) - before < MAX_STAGE_RSS_GROWTH
            # Every room reached the prefill host and was decided (the last one: the pair's own).
            assert len(opened) == kinds["room"] + kinds["valid"] + 1
            assert sum(name.startswith("ok-") for name in opened) == valid
            assert not any(name.startswith("nokey-") for name in opened)  # a stranger reaches nothing
        finally:
            peer.close()
            if stranger is not None:
                stranger.close()


@pytest.mark.parametrize("keyed", [True, False], ids=["with-key", "insecure"])
async def test_hostile_peers_on_the_bootstrap_and_room_sockets(llama_dir: Path, keyed: bool) -> None:
    await _fuzz(llama_dir, keyed)


async def test_a_prefill_server_that_dies_fails_its_rooms_within_the_bootstrap_timeout(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill side goes silent mid-room (its host is gone): the decode side fails the room
    after its bootstrap timeout (5 s here; its transfer timeout is 60 s), naming the prefill
    stage and the state it went silent in, and frees the room's KV."""
    monkeypatch.setenv("PPSERVE_DISAGG_FAULTS", "jitter_ms=20000-20000,seed=1")  # handshakes that take 20 s
    p = await engine(llama_dir, "prefill", 1, disagg_bootstrap_timeout_s=60.0).start()
    monkeypatch.delenv("PPSERVE_DISAGG_FAULTS")
    try:
        rooms = p.rooms
        assert isinstance(rooms, PrefillRooms)
        async with engine(llama_dir, "decode", 1, disagg_bootstrap_timeout_s=5.0, disagg_transfer_timeout_s=60.0) as d:
            room = asyncio.create_task(collect(d, PROMPT, GREEDY, rooms.address))
            decode_rooms = d.rooms
            assert isinstance(decode_rooms, DecodeRooms)
            # Once the prefill side has said where the room stands, the error can name its stage.
            await _settles(lambda: any(r.prefill_stage is not None for r in decode_rooms.rooms.values()))
            await p.close()  # gone without a word
            with pytest.raises(DisaggregationError) as failed:
                await room
            assert re.match(
                r"prefill stage 0 failed in state Bootstrapping: no word from the prefill server at \S+ for 5 s",
                str(failed.value),
            ), failed.value
            await _settles(lambda: d.scheduler.allocator.num_free == NUM_BLOCKS and not d.scheduler.handover.receiving)
    finally:
        await p.close()


class Insider:
    """A peer that holds the key (the decode side, or whoever stole its key): one PUSH to the
    prefill host, one PULL for its replies."""

    def __init__(self, rooms: PrefillRooms) -> None:
        self.ctx = context()
        self.guard = Guard(self.ctx, CurveKeys.from_secret(KEY), "insider")
        self.inbox = PullSocket(self.ctx, "tcp://127.0.0.1:*", bind=True, guard=self.guard)
        self.link = PushSocket(self.ctx, rooms.address, bind=False, guard=self.guard)

    async def reply(self, room: str) -> RoomFailed | RoomFirstToken:
        """The next word about `room` (progress reports skipped)."""
        while True:
            msg = await asyncio.wait_for(self.inbox.recv(), 30)
            if isinstance(msg, (RoomFailed, RoomFirstToken)) and msg.room == room:
                return msg

    def close(self) -> None:
        self.link.close()
        self.inbox.close()
        self.guard.stop()
        self.ctx.term()


def _room(p: AsyncEngine, name: str, reply_to: str, **changes: Any) -> RoomOpen:
    stages = [KvTarget(0, "tcp://127.0.0.1:21000", 0, p.config.model_config.num_layers)]
    room = RoomOpen(name, PROMPT, GREEDY.wire(), stages, 16, p.config.model_config.num_layers, reply_to)
    return msgspec.structs.replace(room, **changes)


async def test_a_reply_address_that_is_not_one_is_dropped_and_the_engine_serves_on(
    llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Item: one room whose reply_to was "not an endpoint" killed the prefill engine, and every
    junk message was a WARNING line of its own."""
    expected = pipeline(llama_dir).generate([PROMPT], GREEDY)[0].token_ids
    async with engine(llama_dir, "prefill", 1) as p, engine(llama_dir, "decode", 1) as d:
        rooms = p.rooms
        assert isinstance(rooms, PrefillRooms)
        insider = Insider(rooms)
        try:
            for i in range(50):
                await insider.link.send(_room(p, f"bad-{i}", "not an endpoint"))
            await insider.link.send(_room(p, "probe", insider.inbox.address, prompt_token_ids=[]))
            answer = await insider.reply("probe")  # read in order: all 50 were seen before it
            assert isinstance(answer, RoomFailed) and "refused the room" in answer.error
            assert p.healthy and not rooms.rooms
            assert await collect(d, PROMPT, GREEDY, rooms.address) == expected
            dropped = [r for r in caplog.records if "dropped room" in r.getMessage()]
            assert len(dropped) == 1 and "more like it" not in dropped[0].getMessage()  # one line per 10 s
        finally:
            insider.close()


async def test_a_flood_of_reply_addresses_holds_a_bounded_number_of_sockets(llama_dir: Path) -> None:
    """Item: 3,000 refused rooms, each with its own reply_to, took the prefill host from 51 to
    1,071 descriptors and then killed it (one socket per address, kept forever)."""
    async with engine(llama_dir, "prefill", 1, disagg_bootstrap_timeout_s=1.0) as p:
        rooms = p.rooms
        assert isinstance(rooms, PrefillRooms)
        insider = Insider(rooms)
        fds = _fds()
        try:
            for i in range(3000):  # refused (no prompt), answered at an address where nobody listens
                await insider.link.send(_room(p, f"r{i}", f"tcp://127.0.0.1:{20000 + i}", prompt_token_ids=[]))
            await insider.link.send(_room(p, "probe", insider.inbox.address, prompt_token_ids=[]))
            await insider.reply("probe")
            assert len(rooms.links.socks) <= rooms.links.max_links and _fds() - fds < MAX_NEW_FDS
            await _settles(lambda: not rooms.tasks.running)  # every undeliverable reply given up
            assert p.healthy and _fds() - fds < MAX_NEW_FDS
        finally:
            insider.close()


async def test_a_room_with_bad_fields_is_refused_by_name_and_its_name_is_free_again(llama_dir: Path) -> None:
    """Item: a room with a NaN temperature got no reply and kept its name "in use" forever; a bad
    decode-stage address was an exception in a task and a 30 s wait."""
    nan = msgspec.structs.replace(GREEDY.wire(), temperature=float("nan"))
    async with engine(llama_dir, "prefill", 1) as p:
        rooms = p.rooms
        assert isinstance(rooms, PrefillRooms)
        insider = Insider(rooms)
        try:
            at, layers = insider.inbox.address, p.config.model_config.num_layers
            refusals = {
                "temperature must be": _room(p, "x", at, params=nan),
                "not a host name": _room(p, "x", at, decode_stages=[KvTarget(0, "tcp://*:1", 0, layers)]),
                "outside the vocabulary": _room(p, "x", at, prompt_token_ids=[1, 10**6]),
                "do not cover its layers": _room(p, "x", at, decode_stages=[KvTarget(0, "tcp://h:1", 0, 1)]),
            }
            for reason, room in refusals.items():
                await insider.link.send(room)
                answer = await insider.reply(room.room)
                assert isinstance(answer, RoomFailed) and reason in answer.error, (reason, answer)
            # A name too long to be one is dropped unanswered (a reply would echo it back).
            await insider.link.send(_room(p, "x" * 300, at))
            await insider.link.send(_room(p, "probe", at, prompt_token_ids=[]))
            first = await asyncio.wait_for(insider.inbox.recv(), 30)
            while isinstance(first, RoomProgress):
                first = await asyncio.wait_for(insider.inbox.recv(), 30)
            assert isinstance(first, RoomFailed) and first.room == "probe"
            assert not rooms.rooms and p.healthy  # and "x" can be used again:
            await insider.link.send(_room(p, "x", at))
            assert isinstance(await insider.reply("x"), RoomFirstToken)
        finally:
            insider.close()


async def test_a_first_token_outside_the_vocabulary_fails_the_room_not_the_decode_engine(llama_dir: Path) -> None:
    """A prefill server whose model differs (another vocabulary) answers with a token the decode
    stages could not embed: the room fails by name, and the decode engine never sees the token."""
    expected = pipeline(llama_dir).generate([PROMPT], GREEDY)[0].token_ids
    async with engine(llama_dir, "decode", 1) as d:
        ctx = context()
        guard = Guard(ctx, CurveKeys.from_secret(KEY), "odd prefill host")
        bootstrap = PullSocket(ctx, "tcp://127.0.0.1:*", bind=True, guard=guard)
        reply = None
        try:
            room = asyncio.create_task(collect(d, PROMPT, GREEDY, bootstrap.address))
            opened = await asyncio.wait_for(bootstrap.recv(), 30)
            assert isinstance(opened, RoomOpen)
            reply = PushSocket(ctx, opened.reply_to, bind=False, guard=guard)
            vocab = d.config.model_config.vocab_size
            await reply.send(RoomFirstToken(opened.room, Sampled(opened.room, vocab + 7)))
            with pytest.raises(DisaggregationError, match=r"first token is outside this model's vocabulary"):
                await room
            await _settles(lambda: d.scheduler.allocator.num_free == NUM_BLOCKS and not d.scheduler.handover.receiving)
            assert d.healthy and d.stage_restarts == [0]
            assert [t async for out in d.generate(PROMPT, GREEDY) for t in out.token_ids] == expected
        finally:
            if reply is not None:
                reply.close()
            bootstrap.close()
            guard.stop()
            ctx.term()
