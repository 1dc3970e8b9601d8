"""How a mixture-of-experts model's tokens spread over its experts, as /metrics shows it.

Per MoE layer: the tokens routed (a counter; a token counts once per expert it goes to), how unevenly
they spread over the layer's experts in the last WINDOW_S (the busiest expert's tokens over the
mean: 1 is even), and how many experts got none then. Operators watch the imbalance: the busiest
expert of a layer sets its time. The series are per layer, never per expert, so that a model of
128 experts in 94 layers adds a few hundred series, not twelve thousand.

Each stage reports the tokens per expert of its MoE layers since its process started, about once
a second with its heartbeat. A report is input from another process, possibly another host: one
that names a layer outside the stage's slice or the wrong number of experts is dropped. A
replaced stage counts from zero again; the totals here go on from where the old process left off.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

WINDOW_S = 10.0


@dataclass(frozen=True)
class LayerLoad:
    layer: int
    routed: int  # tokens routed to the layer's experts since the engine started
    imbalance: float  # in the window: the busiest expert's tokens over the mean (0: no tokens)
    idle: int  # in the window: experts that got no token


class ExpertLoad:
    def __init__(self, experts: Mapping[int, int], slices: Sequence[range]) -> None:
        """`experts`: MoE layer -> its number of experts; `slices`: each stage's layers."""
        self.experts = dict(experts)
        self.slices = list(slices)
        self.base = {layer: [0] * n for layer, n in self.experts.items()}  # replaced processes' counts
        self.last: dict[int, list[int]] = {}  # each layer's last report, as its process counts
        self.processes: dict[int, int] = {}  # each stage's process (its pid) as last reported
        # Each layer's (time, tokens per expert since the engine started), the window's and one before.
        self.history: dict[int, deque[tuple[float, list[int]]]] = {layer: deque() for layer in self.experts}
        self._warned = False

    def report(self, stage: int, now: float, counts: Mapping[int, Sequence[int]], process: int = 0) -> None:
        """A stage's counts (layer -> tokens per expert since its process started) at `now`, from
        its process `process`: another process than the stage's last (a replacement) counts from
        zero, so the old one's last counts join the totals' base."""
        if self.processes.setdefault(stage, process) != process:
            self.processes[stage] = process
            for layer in self.slices[stage]:
                if (old := self.last.pop(layer, None)) is not None:
                    self.base[layer] = [b + o for b, o in zip(self.base[layer], old, strict=True)]
        for layer, tokens in counts.items():
            n = self.experts.get(layer)
            if n is None or layer not in self.slices[stage] or len(tokens) != n or min(tokens, default=0) < 0:
                if not self._warned:
                    self._warned = True
                    log.warning("stage %d reported expert loads that do not fit the model (layer %d)", stage, layer)
                continue
            last = self.last.get(layer)
            if last is not None and any(t < old for t, old in zip(tokens, last, strict=True)):  # (no process id)
                self.base[layer] = [b + old for b, old in zip(self.base[layer], last, strict=True)]
            self.last[layer] = list(tokens)
            history = self.history[layer]
            history.append((now, [b + t for b, t in zip(self.base[layer], tokens, strict=True)]))
            while len(history) > 1 and history[1][0] <= now - WINDOW_S:
                history.popleft()

    def layers(self) -> tuple[LayerLoad, ...]:
        """Each reported MoE layer's load, by layer."""
        loads = []
        for layer, history in sorted(self.history.items()):
            if not history:
                continue
            total = history[-1][1]
            window = [t - s for t, s in zip(total, history[0][1], strict=True)] if len(history) > 1 else total
            mean = sum(window) / len(window)
            loads.append(LayerLoad(layer, sum(total), max(window) / mean if mean else 0.0, window.count(0)))
        return tuple(loads)
