"""The pipeline as it ran: recent per-stage compute intervals, as Chrome trace JSON or for plots.

Every StepResult carries each stage's compute interval for its micro-batch; the plan it came
from says what the micro-batch was (prefill, decode or mixed; how many tokens; after what prefix).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ppserve.transport.messages import StepPlan, StepResult


@dataclass(frozen=True)
class Interval:
    stage: int
    mb_id: int
    kind: str  # "prefill" | "decode" | "mixed"
    tokens: int  # new tokens in the micro-batch
    prefix: int  # tokens already cached before the (longest-prefix) prefill chunk; 0 for decodes
    start: float  # time.time(), seconds
    end: float


class Timeline:
    def __init__(self, pp_size: int, max_intervals: int = 32768) -> None:
        self.pp_size = pp_size
        self.intervals: deque[Interval] = deque(maxlen=max_intervals)
        self._plans: dict[int, tuple[str, int, int]] = {}  # in flight: mb_id -> (kind, tokens, prefix)
        self.prefill_chunks: Counter[int] = Counter()  # prefill chunk size -> how many, since start
        self.stage_tokens = [0] * pp_size  # per stage: tokens its layers computed, since start

    def on_plan(self, plan: StepPlan) -> None:
        tokens, prefix, prefills = 0, 0, 0
        for c in plan.chunks:  # one pass: plans of hundreds of decode steps come every few ms
            tokens += c.num_new
            if c.is_prefill:
                prefills += 1
                prefix = max(prefix, c.start)
                self.prefill_chunks[c.num_new] += 1
        kind = "decode" if not prefills else "prefill" if prefills == len(plan.chunks) else "mixed"
        self._plans[plan.mb_id] = (kind, tokens, prefix)

    def forget_in_flight(self) -> None:
        """The plans in flight were voided (the pipeline was reset): their results never come."""
        self._plans.clear()

    def on_result(self, result: StepResult) -> None:
        kind, tokens, prefix = self._plans.pop(result.mb_id, ("unknown", 0, 0))
        for t in result.timings:
            if 0 <= t.stage < self.pp_size:
                self.stage_tokens[t.stage] += t.tokens
            self.intervals.append(Interval(t.stage, result.mb_id, kind, tokens, prefix, t.start, t.end))

    def since(self, start: float) -> list[Interval]:
        return [i for i in self.intervals if i.end > start]

    def recent(self, start: float, limit: int) -> list[Interval]:
        """The newest `limit` intervals that end after `start`, oldest first, without a walk
        through the whole history. A stage computes its micro-batches in order and their results
        arrive in that order, so each stage's intervals end later the newer they are: once the
        walk from the newest has met, for every stage, one that ended by `start`, all older ones
        did too."""
        found: list[Interval] = []
        done: set[int] = set()  # stages met at or before `start`
        for i in reversed(self.intervals):
            if i.end > start:
                found.append(i)
                if len(found) == limit:
                    break
            else:
                done.add(i.stage)
                if len(done) == self.pp_size:
                    break
        found.reverse()
        return found

    def busy_fractions(self, since: float, now: float) -> tuple[float, ...]:
        """Per stage: compute time inside [since, now] over the length of that window."""
        busy = [0.0] * self.pp_size
        for i in reversed(self.intervals):  # newest first: stop well before the window
            if i.end < since - 60.0:  # intervals arrive in micro-batch order, stages skewed by far less
                break
            busy[i.stage] += max(0.0, min(i.end, now) - max(i.start, since))
        return tuple(min(1.0, b / max(now - since, 1e-9)) for b in busy)

    def chrome_trace(self, label: str = "ppserve") -> dict[str, Any]:
        return chrome_trace(list(self.intervals), self.pp_size, label)


def bubble_fractions(intervals: Sequence[Interval], pp_size: int) -> list[float]:
    """Per stage: idle share of the span from the first compute start to the last compute end."""
    if not intervals:
        return [0.0] * pp_size
    t0, t1 = min(i.start for i in intervals), max(i.end for i in intervals)
    busy = [0.0] * pp_size
    for i in intervals:
        busy[i.stage] += i.end - i.start
    return [max(0.0, 1.0 - b / max(t1 - t0, 1e-9)) for b in busy]


def chrome_trace(intervals: Iterable[Interval], pp_size: int, label: str = "ppserve") -> dict[str, Any]:
    """Trace Event Format (opens in Perfetto or chrome://tracing): one thread per stage."""
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": label}}]
    events += [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"stage {s}"}} for s in range(pp_size)
    ]
    for i in intervals:
        events.append(
            {
                "name": f"{i.kind} {i.tokens}",
                "cat": i.kind,
                "ph": "X",
                "pid": 0,
                "tid": i.stage,
                "ts": i.start * 1e6,  # microseconds
                "dur": (i.end - i.start) * 1e6,
                "args": {"mb_id": i.mb_id, "tokens": i.tokens, "prefix": i.prefix},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def intervals_from_trace(trace: dict[str, Any]) -> list[Interval]:
    """The inverse of `chrome_trace` (for scripts that read a saved trace or /debug/timeline)."""
    return [
        Interval(
            stage=e["tid"],
            mb_id=e["args"]["mb_id"],
            kind=e["cat"],
            tokens=e["args"]["tokens"],
            prefix=e["args"]["prefix"],
            start=e["ts"] / 1e6,
            end=(e["ts"] + e["dur"]) / 1e6,
        )
        for e in trace["traceEvents"]
        if e.get("ph") == "X"
    ]
