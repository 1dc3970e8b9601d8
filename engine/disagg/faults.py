"""Injected faults for prefill/decode disaggregation, to test it and to check a network with it.

    PPSERVE_DISAGG_FAULTS="jitter_ms=0-500,drop_handshake=0.05,fail_transfer=0.02,seed=1"

jitter_ms    each bootstrap and transfer message waits a uniform delay in this range (ms)
drop_handshake  the chance that a handshake message is dropped (its sender's timeout must fire)
fail_transfer   the chance that a KV transfer fails part-way
seed         makes the dice repeatable; every stage on each side throws its own

Each stage on each side gets its own dice (`for_stage`), so faults differ per stage, as network
trouble does. Setting the variable is logged loudly at start-up: it is never on by accident. It is
parsed once, into the engine config's `disagg_faults` (engine/environment.py), which the stages get.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

ENV = "PPSERVE_DISAGG_FAULTS"


@dataclass(frozen=True)
class DisaggFaults:
    jitter_ms: tuple[float, float] = (0.0, 0.0)
    drop_handshake: float = 0.0
    fail_transfer: float = 0.0
    seed: int | None = None

    @classmethod
    def parse(cls, text: str) -> DisaggFaults:
        """From "key=value,..."; a ValueError names the item that is wrong."""
        values: dict[str, object] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            try:
                if not sep:
                    raise ValueError("expected key=value")
                if key == "jitter_ms":
                    low, _, high = value.partition("-")
                    span = (float(low), float(high or low))
                    if not 0 <= span[0] <= span[1]:
                        raise ValueError("expected LOW-HIGH milliseconds, 0 <= LOW <= HIGH")
                    values[key] = span
                elif key in ("drop_handshake", "fail_transfer"):
                    chance = float(value)
                    if not 0.0 <= chance <= 1.0:
                        raise ValueError("expected a probability in [0, 1]")
                    values[key] = chance
                elif key == "seed":
                    values[key] = int(value)
                else:
                    raise ValueError("unknown fault (jitter_ms, drop_handshake, fail_transfer, seed)")
            except ValueError as e:
                raise ValueError(f"{ENV}: {item!r}: {e}") from None
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls) -> DisaggFaults | None:
        text = os.environ.get(ENV, "").strip()
        return cls.parse(text) if text else None

    @property
    def active(self) -> bool:
        return self.jitter_ms[1] > 0 or self.drop_handshake > 0 or self.fail_transfer > 0

    def describe(self) -> str:
        """For the start-up warning."""
        low, high = self.jitter_ms
        return (
            f"FAULT INJECTION ON ({ENV}): jitter {low:g}-{high:g} ms, {self.drop_handshake:.1%} of handshakes "
            f"dropped, {self.fail_transfer:.1%} of transfers failed, seed {self.seed}"
        )

    def for_stage(self, side: str, stage: int) -> FaultDice:
        seed = None if self.seed is None else f"{self.seed}/{side}/{stage}"
        return FaultDice(self, random.Random(seed))


class FaultDice:
    """One stage's faults, drawn from its own generator."""

    def __init__(self, faults: DisaggFaults, rng: random.Random) -> None:
        self.faults = faults
        self.rng = rng

    def jitter_s(self) -> float:
        low, high = self.faults.jitter_ms
        return self.rng.uniform(low, high) / 1e3 if high > 0 else 0.0

    def drop_handshake(self) -> bool:
        return self.rng.random() < self.faults.drop_handshake

    def fail_transfer(self) -> bool:
        return self.rng.random() < self.faults.fail_transfer
