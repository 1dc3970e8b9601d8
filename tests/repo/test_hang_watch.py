"""The suite's guard against hangs (tests/hang_watch.py) turns a stuck await into a failure."""

from __future__ import annotations

import asyncio

import hang_watch
import pytest


def test_a_stuck_await_is_cancelled_with_its_stack(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(hang_watch, "HANG_S", 0.2)

    async def stuck() -> None:
        await asyncio.Event().wait()  # nothing ever sets it

    with hang_watch.hang_watch("stuck test"), pytest.raises(asyncio.CancelledError):
        asyncio.run(stuck())
    err = capsys.readouterr().err
    assert "stuck test: still running after 0 s; 1 task(s)" in err and "in stuck" in err


def test_a_test_that_ends_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hang_watch, "HANG_S", 0.2)

    async def quick() -> int:
        await asyncio.sleep(0.01)
        return 7

    with hang_watch.hang_watch("quick test"):
        assert asyncio.run(quick()) == 7
    # The timer is cancelled with the block: a loop that runs later is not touched.
    assert asyncio.run(asyncio.sleep(0.3, result=8)) == 8
