"""Prefill/decode disaggregation between two engines (each with its own stage processes): the
decode side continues exactly as one colocated engine would."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from disagg_pair import GREEDY, KEY, collect, engine
from helpers import pipeline

from ppserve.engine.disagg.prefill import PrefillRooms
from ppserve.engine.disagg.rooms import DisaggregationError
from ppserve.scheduler.bootstrap import KvState
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.transport.addresses import free_ports
from ppserve.transport.cluster_key import CurveKeys, Guard
from ppserve.transport.control import PullSocket, PushSocket, context
from ppserve.transport.messages import KvTarget, RoomFailed, RoomFirstToken, RoomOpen

pytestmark = pytest.mark.slow

SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, presence_penalty=0.5, ignore_eos=True)


@pytest.mark.parametrize(
    ("prefill", "decode"), [((2, None), (1, None)), ((3, "1,1,2"), (2, "3,1")), ((1, None), (2, None))]
)
async def test_decode_continues_exactly(
    llama_dir: Path, prefill: tuple[int, str | None], decode: tuple[int, str | None]
) -> None:
    prompts = [[(i * 13 + j) % 500 for j in range(n)] for i, n in enumerate((5, 40, 100))]  # 100: chunked prefill
    ref = pipeline(llama_dir)
    async with engine(llama_dir, "prefill", *prefill) as p, engine(llama_dir, "decode", *decode) as d:
        assert p.rooms is not None
        at = p.rooms.address
        for params in (GREEDY, SEEDED):
            expected = [g.token_ids for g in ref.generate(prompts, params)]
            got = [await collect(d, prompt, params, at) for prompt in prompts]
            assert got == expected
        assert d.scheduler.allocator.num_free == 128 and p.scheduler.allocator.num_free == 128
        assert not p.scheduler.handover.held and not d.scheduler.handover.receiving


async def test_a_refused_room_fails_cleanly_on_both_sides(llama_dir: Path) -> None:
    async with engine(llama_dir, "prefill", 1, block_size=8) as p, engine(llama_dir, "decode", 1) as d:
        assert p.rooms is not None
        with pytest.raises(DisaggregationError, match=r"the prefill side refused the room: .*blocks of 16"):
            await collect(d, [1, 2, 3], GREEDY, p.rooms.address)
        assert d.scheduler.allocator.num_free == 128 and not d.scheduler.handover.receiving
        # The decode engine still serves on its own.
        assert len([t async for out in d.generate([1, 2, 3], GREEDY) for t in out.token_ids]) == 12


async def _settles(*checks: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not all(c() for c in checks):
        assert asyncio.get_running_loop().time() < deadline, "the KV was not freed on both sides"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("faults", "message"),
    [
        ("drop_handshake=1,seed=1", r"prefill stage \d failed in state Bootstrapping: timed out after 2 s"),
        (
            "fail_transfer=1,seed=1",
            r"prefill stage \d failed in state Transferring: .*the transfer failed \(injected\)",
        ),
    ],
)
async def test_injected_faults_end_the_room_on_both_sides_with_its_state(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch, faults: str, message: str
) -> None:
    monkeypatch.setenv("PPSERVE_DISAGG_FAULTS", faults)  # the prefill engine's stages read it at start
    timeouts = {"disagg_bootstrap_timeout_s": 2.0, "disagg_transfer_timeout_s": 2.0}
    async with engine(llama_dir, "prefill", 2, None, **timeouts) as p:
        monkeypatch.delenv("PPSERVE_DISAGG_FAULTS")
        async with engine(llama_dir, "decode", 1, None, **timeouts) as d:
            rooms = p.rooms
            assert isinstance(rooms, PrefillRooms)
            with pytest.raises(DisaggregationError, match=message):
                await collect(d, [5, 6, 7, 8], GREEDY, rooms.address)
            await _settles(
                lambda: d.scheduler.allocator.num_free == 128 and not d.scheduler.handover.receiving,
                lambda: p.scheduler.allocator.num_free == 128 and not p.scheduler.handover.held and not rooms.rooms,
            )


async def test_a_client_gone_mid_room_frees_the_kv_on_both_sides(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PPSERVE_DISAGG_FAULTS", "jitter_ms=300-300,seed=2")  # slow handshakes and transfers
    async with engine(llama_dir, "prefill", 2, disagg_transfer_timeout_s=3.0) as p:
        monkeypatch.delenv("PPSERVE_DISAGG_FAULTS")
        async with engine(llama_dir, "decode", 1) as d:
            rooms = p.rooms
            assert isinstance(rooms, PrefillRooms)
            task = asyncio.create_task(collect(d, list(range(40)), GREEDY, rooms.address))
            await _settles(lambda: bool(rooms.rooms))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _settles(
                lambda: d.scheduler.allocator.num_free == 128 and not d.scheduler.handover.receiving,
                lambda: p.scheduler.allocator.num_free == 128 and not p.scheduler.handover.held and not rooms.rooms,
            )
            assert len(await collect(d, [1, 2, 3], GREEDY, rooms.address)) == 12  # and the pair serves on


async def test_chaos_every_request_is_exact_or_fails_clearly(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """200 requests with 0-500 ms of jitter on every handshake and chunk and 5% of handshakes
    dropped, on every stage of both sides: nothing dies or asserts, every request is exactly
    right or ends with the error naming side, stage and state, and all KV is free afterwards."""
    prompts = [[(i * 7 + j * 3) % 500 for j in range(4 + i % 29)] for i in range(200)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = [g.token_ids for g in pipeline(llama_dir, num_kv_blocks=1024).generate(prompts, params)]
    monkeypatch.setenv("PPSERVE_DISAGG_FAULTS", "jitter_ms=0-500,drop_handshake=0.05,seed=11")
    timeouts = {"disagg_bootstrap_timeout_s": 3.0, "disagg_transfer_timeout_s": 5.0, "num_kv_blocks": 512}
    async with (
        engine(llama_dir, "prefill", 2, None, **timeouts) as p,
        engine(llama_dir, "decode", 2, None, **timeouts) as d,
    ):
        rooms = p.rooms
        assert isinstance(rooms, PrefillRooms)

        async def one(prompt: list[int]) -> list[int] | str:
            try:
                return await collect(d, prompt, params, rooms.address)
            except DisaggregationError as e:
                return str(e)

        results = await asyncio.gather(*(one(prompt) for prompt in prompts))
        failed = [r for r in results if isinstance(r, str)]
        assert all(re.search(r"(prefill|decode) (stage \d|side) .*in state \w+|waited", e) for e in failed), failed
        assert [r for r, e in zip(results, expected, strict=True) if not isinstance(r, str) and r != e] == []
        assert len(failed) < len(results) // 2  # most get through
        await _settles(
            lambda: d.scheduler.allocator.num_free == 512 and not d.scheduler.handover.receiving,
            lambda: p.scheduler.allocator.num_free == 512 and not p.scheduler.handover.held and not rooms.rooms,
            timeout_s=30,
        )
        assert p.healthy and d.healthy and p.stage_restarts == [0, 0] and d.stage_restarts == [0, 0]


async def test_a_prefill_stage_killed_mid_transfer_fails_the_room_and_frees_the_kv(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PPSERVE_DISAGG_FAULTS", "jitter_ms=400-400,seed=3")  # transfers take a while
    timeouts = {"disagg_bootstrap_timeout_s": 5.0, "disagg_transfer_timeout_s": 2.0}
    async with engine(llama_dir, "prefill", 2, None, **timeouts) as p:
        monkeypatch.delenv("PPSERVE_DISAGG_FAULTS")
        async with engine(llama_dir, "decode", 1, None, **timeouts) as d:
            rooms = p.rooms
            assert isinstance(rooms, PrefillRooms)
            task = asyncio.create_task(collect(d, list(range(60)), GREEDY, rooms.address))
            await _settles(
                lambda: any(KvState.TRANSFERRING in r.states for r in rooms.table.rooms.values()), timeout_s=30
            )
            os.kill(p.pool.procs[1].pid or 0, signal.SIGKILL)
            with pytest.raises(DisaggregationError, match=r"prefill stage 1 failed in state Transferring: timed out"):
                await task
            await _settles(
                lambda: d.scheduler.allocator.num_free == 128 and not d.scheduler.handover.receiving,
                lambda: p.scheduler.allocator.num_free == 128 and not p.scheduler.handover.held and not rooms.rooms,
                timeout_s=30,
            )
            await _settles(lambda: p.stage_restarts == [0, 1] and not p.recovering, timeout_s=60)
            assert len(await collect(d, [1, 2, 3], GREEDY, rooms.address)) == 12  # the healed pair serves on


async def test_a_decode_side_that_vanishes_leaves_the_prefill_side_clean(llama_dir: Path) -> None:
    """A decode host opens a room and is gone (its stages' receivers never answer): the prefill
    side prefills, answers, hands the KV to its sockets and frees it; nothing waits on the dead."""
    async with engine(llama_dir, "prefill", 2, None, disagg_transfer_timeout_s=2.0) as p:
        rooms = p.rooms
        assert isinstance(rooms, PrefillRooms)
        nowhere = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
        ranges = p.config.layer_ranges
        stages = [KvTarget(0, nowhere[0], 0, 2), KvTarget(1, nowhere[1], 2, ranges[-1].stop)]
        ctx = context()
        guard = Guard(ctx, CurveKeys.from_secret(KEY), "decode host")
        inbox = PullSocket(ctx, "tcp://127.0.0.1:*", bind=True, guard=guard)  # the decode host, until it vanishes
        link = PushSocket(ctx, rooms.address, bind=False, guard=guard)
        try:
            room = RoomOpen("lost", list(range(60)), GREEDY.wire(), stages, 16, ranges[-1].stop, inbox.address)
            link.send_nowait(room)
            replies = [await asyncio.wait_for(inbox.recv(), 30)]
            while not isinstance(replies[-1], RoomFailed):
                replies.append(await asyncio.wait_for(inbox.recv(), 30))
            assert next(r for r in replies if isinstance(r, RoomFirstToken)).room == "lost"
            # Nobody took the KV: the transfer failed (never reported as done), and says where.
            assert re.match(r"prefill stage \d failed in state Transferring: .*took no KV for 2 s", replies[-1].error)
            await _settles(
                lambda: p.scheduler.allocator.num_free == 128 and not p.scheduler.handover.held and not rooms.rooms
            )
            assert p.healthy and p.stage_restarts == [0, 0]
        finally:
            link.close()
            inbox.close()
            guard.stop()
            ctx.term()


async def test_the_pair_under_a_cluster_key(llama_dir: Path) -> None:
    """With a secret, the pair's sockets speak CURVE: the keyed pair works, a keyless decode
    engine reaches nothing (its room times out) and the prefill side stays clean."""
    short = {"disagg_bootstrap_timeout_s": 1.0, "disagg_transfer_timeout_s": 1.0}
    async with engine(llama_dir, "prefill", 2) as p, engine(llama_dir, "decode", 1) as d:
        rooms = p.rooms
        assert isinstance(rooms, PrefillRooms)
        expected = pipeline(llama_dir).generate([[4, 5, 6, 7]], GREEDY)[0].token_ids
        assert await collect(d, [4, 5, 6, 7], GREEDY, rooms.address) == expected
        async with engine(llama_dir, "decode", 1, None, disagg_insecure=True, **short) as outsider:
            with pytest.raises(DisaggregationError, match=r"failed in state Bootstrapping: .* took no room"):
                await collect(outsider, [4, 5, 6, 7], GREEDY, rooms.address)
        assert not rooms.rooms and p.scheduler.allocator.num_free == 128


async def test_a_malformed_room_is_refused_and_the_prefill_engine_serves_on(llama_dir: Path) -> None:
    async with engine(llama_dir, "prefill", 1) as p:
        rooms = p.rooms
        assert isinstance(rooms, PrefillRooms)
        ctx = context()
        guard = Guard(ctx, CurveKeys.from_secret(KEY), "decode host")
        inbox = PullSocket(ctx, "tcp://127.0.0.1:*", bind=True, guard=guard)
        link = PushSocket(ctx, rooms.address, bind=False, guard=guard)
        try:
            layers = p.config.model_config.num_layers
            await link.send_frames([b"\xc1 not a ppserve message"])  # dropped with a warning
            link.send_nowait(RoomOpen("bad", [1, 2, 3], GREEDY.wire(), [], 16, layers, inbox.address))
            answer = await asyncio.wait_for(inbox.recv(), 10)
            assert isinstance(answer, RoomFailed) and "the prefill side refused the room" in answer.error
            assert p.healthy and not rooms.rooms
        finally:
            link.close()
            inbox.close()
            guard.stop()
            ctx.term()
