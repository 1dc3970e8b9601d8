"""PPSERVE_DISAGG_FAULTS: parsed strictly, thrown per stage, repeatable with a seed."""

from __future__ import annotations

import pytest

from ppserve.engine.disagg.faults import DisaggFaults


def test_parse_and_describe(monkeypatch: pytest.MonkeyPatch) -> None:
    f = DisaggFaults.parse("jitter_ms=0-500, drop_handshake=0.05,fail_transfer=0.02,seed=1")
    assert f == DisaggFaults((0.0, 500.0), 0.05, 0.02, 1) and f.active
    assert "FAULT INJECTION ON" in f.describe() and "5.0% of handshakes" in f.describe()
    assert DisaggFaults.parse("jitter_ms=20").jitter_ms == (20.0, 20.0)
    assert not DisaggFaults.parse("seed=3").active
    monkeypatch.delenv("PPSERVE_DISAGG_FAULTS", raising=False)
    assert DisaggFaults.from_env() is None
    monkeypatch.setenv("PPSERVE_DISAGG_FAULTS", "fail_transfer=1")
    assert DisaggFaults.from_env() == DisaggFaults(fail_transfer=1.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("jitter_ms=500-0", "LOW-HIGH"),
        ("jitter_ms=a-b", "'jitter_ms=a-b'"),
        ("drop_handshake=2", "probability"),
        ("fail_transfer", "key=value"),
        ("latency=5", "unknown fault"),
        ("seed=x", "'seed=x'"),
    ],
)
def test_bad_specs_name_the_item(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as e:
        DisaggFaults.parse(text)
    assert str(e.value).startswith("PPSERVE_DISAGG_FAULTS: ")


def test_each_stage_has_its_own_repeatable_dice() -> None:
    f = DisaggFaults((0.0, 500.0), 0.5, 0.5, seed=7)

    def throws(side: str, stage: int) -> list[tuple[float, bool, bool]]:
        dice = f.for_stage(side, stage)
        return [(dice.jitter_s(), dice.drop_handshake(), dice.fail_transfer()) for _ in range(20)]

    assert throws("prefill", 1) == throws("prefill", 1)  # the seed repeats them
    assert throws("prefill", 1) != throws("prefill", 2) != throws("decode", 1)
    assert all(0.0 <= j <= 0.5 for j, _, _ in throws("decode", 0))
    assert DisaggFaults().for_stage("decode", 0).jitter_s() == 0.0
