"""Keeps the prefill latency model current: start-up profiles plus timings measured as the run goes.

Each stage has its own samples (prefix, tokens, seconds); the model that sizes chunks is the
one of the bottleneck stage, the stage whose fit predicts the slowest first chunk. Pure: the
samples come from StepResult timings, nothing here measures anything.
"""

from __future__ import annotations

import logging
from collections import deque

from ppserve.scheduler.chunk_predictor import LatencyModel, fit_latency_model

log = logging.getLogger(__name__)

REFIT_EVERY = 16  # new samples between refits (a fit is pure Python per stage: not at every sample)
WINDOW = 256  # recent measured samples kept per stage, so the model follows drift
MATERIAL_CHANGE = 0.1  # log a refit when the predicted first-chunk time moves by more than this


class LatencyTracker:
    def __init__(self, num_stages: int, initial_chunk: int) -> None:
        self.initial_chunk = initial_chunk
        self.profiles: list[list[tuple[int, int, float]]] = [[] for _ in range(num_stages)]
        self.recent: list[deque[tuple[int, int, float]]] = [deque(maxlen=WINDOW) for _ in range(num_stages)]
        self.model: LatencyModel | None = None
        self.bottleneck: int | None = None
        self._since_fit = 0

    def set_profile(self, stage: int, samples: list[tuple[int, int, float]]) -> LatencyModel | None:
        self.profiles[stage] = list(samples)
        return self.refit()

    def observe(self, stage: int, prefix: int, tokens: int, seconds: float) -> bool:
        """Record one stage's time for a micro-batch that was a single prefill chunk; returns True
        when this sample triggered a refit (`model` is then the new fit, or None if it failed)."""
        self.recent[stage].append((prefix, tokens, seconds))
        self._since_fit += 1
        if self._since_fit < REFIT_EVERY * len(self.recent):
            return False
        self.refit()
        return True

    def refit(self) -> LatencyModel | None:
        """Fit every stage; keep the bottleneck's model. Returns it (None if no stage fits).

        The bottleneck is the stage that takes longest for a C-token chunk at the longest prefix
        measured: where chunks shrink, the stage with the largest attention term sets the pace."""
        self._since_fit = 0
        samples = [[*profile, *recent] for profile, recent in zip(self.profiles, self.recent, strict=True)]
        prefix = max((p for stage in samples for p, _, _ in stage), default=0)
        best: tuple[float, int, LatencyModel] | None = None
        for stage, stage_samples in enumerate(samples):
            model = fit_latency_model(stage_samples)
            if model is None:
                continue
            cost = model.chunk(prefix, self.initial_chunk)
            if best is None or cost > best[0]:
                best = (cost, stage, model)
        old = self.model
        if best is None:
            self.model = self.bottleneck = None
            return None
        _, self.bottleneck, self.model = best
        new_cost = self.model.chunk(0, self.initial_chunk)
        if old is None or abs(new_cost - old.chunk(0, self.initial_chunk)) > MATERIAL_CHANGE * max(new_cost, 1e-9):
            m = self.model
            log.info(
                "prefill latency model (bottleneck stage %d): f(l) = %.3g*l^2 + %.3g*l + %.3g s",
                self.bottleneck,
                m.a,
                m.b,
                m.c,
            )
        return self.model
