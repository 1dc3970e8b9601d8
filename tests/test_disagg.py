"""Prefill/decode disaggregation between two engines (each with its own stage processes): the
decode side continues exactly as one colocated engine would."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import pipeline

from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.config import EngineConfig
from ppserve.engine.disagg import DisaggregationError, PrefillRooms
from ppserve.scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, presence_penalty=0.5, ignore_eos=True)


def engine(model: Path, mode: str, pp: int, partition: str | None = None, **kw: float) -> AsyncEngine:
    config = EngineConfig.create(
        model, pp_size=pp, layer_partition=partition, disaggregation=mode, num_kv_blocks=128, threads_per_stage=1,
        chunked_prefill_size=32, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    return AsyncEngine(config)


async def collect(e: AsyncEngine, prompt: list[int], params: SamplingParams, prefill: str) -> list[int]:
    return [t async for out in e.generate(prompt, params, prefill=prefill) for t in out.token_ids]


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
        assert not p.scheduler.held and not d.scheduler.receiving


async def test_a_refused_room_fails_cleanly_on_both_sides(llama_dir: Path) -> None:
    async with engine(llama_dir, "prefill", 1, block_size=8) as p, engine(llama_dir, "decode", 1) as d:
        assert p.rooms is not None
        with pytest.raises(DisaggregationError, match=r"the prefill side refused the room: .*blocks of 16"):
            await collect(d, [1, 2, 3], GREEDY, p.rooms.address)
        assert d.scheduler.allocator.num_free == 128 and not d.scheduler.receiving
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
                lambda: d.scheduler.allocator.num_free == 128 and not d.scheduler.receiving,
                lambda: p.scheduler.allocator.num_free == 128 and not p.scheduler.held and not rooms.rooms,
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
                lambda: d.scheduler.allocator.num_free == 128 and not d.scheduler.receiving,
                lambda: p.scheduler.allocator.num_free == 128 and not p.scheduler.held and not rooms.rooms,
            )
            assert len(await collect(d, [1, 2, 3], GREEDY, rooms.address)) == 12  # and the pair serves on
