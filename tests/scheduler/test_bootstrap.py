"""The prefill host's bootstrap table: one decision per room, whatever order reports come in."""

from __future__ import annotations

import random

import pytest

from ppserve.scheduler.bootstrap import BootstrapTable, KvState, RoomError, handshake_order

B, W, T, S, F = (
    KvState.BOOTSTRAPPING,
    KvState.WAITING_FOR_INPUT,
    KvState.TRANSFERRING,
    KvState.SUCCESS,
    KvState.FAILED,
)


def table(stages: int = 3) -> BootstrapTable:
    return BootstrapTable(stages, bootstrap_timeout_s=5.0, transfer_timeout_s=10.0)


def test_a_room_is_admitted_once_every_stage_waits_for_input_and_released_when_all_succeed() -> None:
    t = table()
    t.open("r", 0.0)
    for stage in handshake_order(3):  # the decode side: highest stage first
        assert t.admit() == []
        t.report("r", stage, W, 1.0)
    assert handshake_order(3) == [2, 1, 0]
    assert t.admit() == ["r"] and t.admit() == []
    for stage in range(3):
        t.report("r", stage, T, 2.0)
    t.report("r", 0, S, 3.0)
    t.report("r", 2, S, 3.0)
    assert t.release(3.0) == []  # stage 1 still sends from its blocks
    t.report("r", 1, S, 3.5)
    [room] = t.release(3.5)
    assert room.succeeded and "r" not in t.rooms
    t.report("r", 1, S, 4.0)  # late: ignored
    t.open("x", 0.0)
    with pytest.raises(ValueError, match="already in use"):
        t.open("x", 0.0)


def test_a_failed_stage_fails_the_room_by_name_and_release_waits_for_the_others() -> None:
    t = table()
    t.open("r", 0.0)
    for stage in range(3):
        t.report("r", stage, W, 0.5)
    t.admit()
    t.report("r", 1, T, 1.0)
    t.report("r", 1, F, 1.2, "connection reset")
    room = t.rooms["r"]
    assert room.error == RoomError("prefill", 1, T, "connection reset")
    assert str(room.error) == "prefill stage 1 failed in state Transferring: connection reset"
    assert t.pending("r") == [0, 2] and t.release(2.0) == []
    t.report("r", 0, F, 2.0)
    t.report("r", 2, T, 2.0)  # late news from before it heard of the failure: still holds its blocks
    assert t.release(2.0) == []
    t.report("r", 2, F, 2.5)
    assert [r.room for r in t.release(2.5)] == ["r"]


def test_moves_the_protocol_does_not_allow_fail_the_room_instead_of_asserting() -> None:
    t = table()
    t.open("r", 0.0)
    t.report("r", 0, W, 0.1)
    t.report("r", 0, W, 0.2)  # twice: ignored
    t.report("r", 1, T, 0.3)  # skipped WaitingForInput
    error = t.rooms["r"].error
    assert error is not None and error.stage == 1 and error.state is B and "does not allow" in error.reason
    t.report("r", 7, W, 0.4)  # no such stage: ignored
    t.report("nope", 0, W, 0.4)  # no such room: ignored
    assert t.admit() == []  # a failed room is never admitted


def test_every_state_has_a_timeout_but_an_admitted_room_waits_for_its_prefill() -> None:
    t = table()
    t.open("slow handshake", 0.0)
    t.open("slow prefill", 0.0)
    t.open("slow transfer", 0.0)
    for room in ("slow prefill", "slow transfer"):
        for stage in range(3):
            t.report(room, stage, W, 1.0)
    t.admit()
    for stage in range(3):
        t.report("slow transfer", stage, T, 2.0)
    assert t.expire(5.0) == []
    [expired] = t.expire(5.1)
    assert expired.room == "slow handshake" and expired.error == RoomError("prefill", 0, B, "timed out after 5 s")
    [expired] = t.expire(12.1)
    assert expired.room == "slow transfer" and expired.error is not None and expired.error.state is T
    assert t.rooms["slow prefill"].error is None  # prefill can take as long as it takes
    # Stages that never answer lose their claim after the transfer timeout.
    assert {r.room for r in t.release(22.2)} == {"slow handshake", "slow transfer"}


def test_a_stage_that_never_starts_sending_after_the_prefill_fails_the_room() -> None:
    """Once the prefill is done and the stages told to send, one that stays waiting for input
    (it died before it read the word) has its bootstrap timeout, so no room waits forever."""
    t = table(2)
    t.open("r", 0.0)
    for stage in range(2):
        t.report("r", stage, W, 1.0)
    t.admit()
    assert t.expire(100.0) == []  # a long prefill queue is no failure
    t.exported("r", 100.0)
    t.report("r", 0, T, 100.5)
    assert t.expire(105.0) == []
    [expired] = t.expire(105.1)
    assert expired.error == RoomError("prefill", 1, W, "timed out after 5 s")


def test_the_host_ends_rooms_for_the_decode_side_and_for_aborts() -> None:
    t = table(2)
    t.open("d", 0.0)
    t.open("a", 0.0)
    t.report("a", 0, W, 0.1)
    decode_error = t.fail("d", "decode", 1, "its KV receiver timed out", 1.0)
    assert str(decode_error) == "decode stage 1 failed in state Bootstrapping: its KV receiver timed out"
    assert str(t.fail("a", "client", None, "the client went away", 1.0)) == (
        "the client side failed in state Bootstrapping: the client went away"
    )
    assert t.fail("gone", "client", None, "x", 1.0) is None
    first = t.rooms["d"].error
    t.fail("d", "prefill", 0, "later", 1.5)
    assert t.rooms["d"].error is first  # the first failure is the cause


@pytest.mark.parametrize("seed", range(40))
def test_any_interleaving_keeps_the_invariants(seed: int) -> None:
    """Reports late, doubled, reordered or wrong; timeouts; aborts: nothing raises, a room is
    admitted only when all its stages wait for input, its first error stays, and its blocks are
    released only when every stage is done or the laggards timed out."""
    rng = random.Random(seed)
    t = table(3)
    now = 0.0
    errors: dict[str, RoomError] = {}
    for i in range(6):
        t.open(f"r{i}", now)
    for _ in range(300):
        now += rng.choice([0.0, 0.01, 0.3, 2.0])
        room = f"r{rng.randrange(7)}"  # r6 never exists
        action = rng.random()
        if action < 0.7:
            t.report(room, rng.randrange(4), rng.choice(list(KvState)), now, "injected")
        elif action < 0.75:
            t.fail(room, rng.choice(["decode", "client"]), rng.choice([None, 0, 1]), "injected", now)
        elif action < 0.85:
            t.expire(now)
        for name in t.admit():
            assert t.rooms[name].ready and t.rooms[name].error is None
        for r in t.release(now):
            assert r.done or (r.error is not None and now - r.failed_at > t.transfer_timeout_s)
        for name, r in t.rooms.items():
            if r.error is not None:
                assert errors.setdefault(name, r.error) is r.error
