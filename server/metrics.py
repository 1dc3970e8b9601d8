"""Prometheus metrics: request latencies measured where clients see them, engine state read at
scrape time (so nothing has to keep gauges up to date).

Counts and histograms are plain Python numbers updated on every token and turned into
Prometheus families only when /metrics is scraped: prometheus_client's own Histogram takes a
lock and walks its buckets on every observation, which at thousands of tokens per second is a
measurable share of the server's CPU.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import aclosing

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ppserve.engine.outputs import EngineStats, RequestOutput
from ppserve.engine.runtime.expert_load import WINDOW_S

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_CHUNK_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class _Histogram:
    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.buckets = name, doc, buckets
        self.counts = [0] * (len(buckets) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times

    def family(self) -> HistogramMetricFamily:
        return _histogram_family(self.name, self.doc, self.buckets, self.counts, self.sum)


def _histogram_family(
    name: str, doc: str, bounds: tuple[float, ...], counts: list[int], total: float
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc)
    cumulative, running = [], 0
    for le, n in zip([*map(str, bounds), "+Inf"], counts, strict=True):
        running += n
        cumulative.append((le, float(running)))
    family.add_metric([], cumulative, sum_value=total)
    return family


class ServerMetrics(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.stats = stats
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()  # finish reason -> requests
        self.ttft = _Histogram("ppserve_time_to_first_token_seconds", "Arrival to first token", _LATENCY_BUCKETS)
        self.itl = _Histogram("ppserve_inter_token_latency_seconds", "Time between generated tokens", _TOKEN_BUCKETS)
        self.e2e = _Histogram("ppserve_e2e_request_latency_seconds", "Arrival to last token", _LATENCY_BUCKETS)
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def track(self, outputs: AsyncGenerator[RequestOutput, None]) -> AsyncGenerator[RequestOutput, None]:
        """Pass `outputs` through, timing them. Closing this closes `outputs` (which aborts the
        request in the engine)."""
        start = last = time.monotonic()
        first, finished = True, False
        async with aclosing(outputs):
            try:
                async for out in outputs:
                    now = time.monotonic()
                    if n := len(out.token_ids):
                        if first:
                            self.ttft.observe(now - start)
                            first = False
                        else:  # several tokens in one output (held back for a stop string) share the gap
                            self.itl.observe((now - last) / n, n)
                        last = now
                        self.generation_tokens += n
                    if out.finished:
                        finished = True
                        self.e2e.observe(now - start)
                        self.prompt_tokens += out.prompt_tokens
                        self.finished[out.finish_reason or "abort"] += 1
                    yield out
            finally:
                if not finished:  # closed early: the client went away or cancelled
                    self.finished["abort"] += 1

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("ppserve_prompt_tokens", "Prompt tokens of finished requests", self.prompt_tokens)
        yield CounterMetricFamily("ppserve_generation_tokens", "Generated tokens", self.generation_tokens)
        requests = CounterMetricFamily(
            "ppserve_requests", "Finished requests (abort: the client left or cancelled)", labels=["finish_reason"]
        )
        for reason, n in sorted(self.finished.items()):
            requests.add_metric([reason], n)
        yield requests
        yield from (h.family() for h in (self.ttft, self.itl, self.e2e))
        yield from _engine_families(self.stats())


def _per_stage(
    kind: type[CounterMetricFamily | GaugeMetricFamily], name: str, doc: str, values: tuple[float, ...]
) -> Metric:
    family = kind(name, doc, labels=["stage"])
    for stage, value in enumerate(values):
        family.add_metric([str(stage)], value)
    return family


def _engine_families(s: EngineStats | None) -> Iterator[Metric]:
    if s is None:  # the engine is not started yet
        return
    yield GaugeMetricFamily("ppserve_requests_running", "Requests being computed", value=s.running)
    yield GaugeMetricFamily("ppserve_requests_waiting", "Requests waiting to start", value=s.waiting)
    yield GaugeMetricFamily("ppserve_kv_blocks_used", "KV-cache blocks in use", value=s.kv_blocks_used)
    yield GaugeMetricFamily("ppserve_kv_blocks_total", "KV-cache blocks per stage", value=s.kv_blocks_total)
    yield CounterMetricFamily(
        "ppserve_preemptions", "Requests preempted (KV given up and recomputed later)", value=s.preemptions
    )
    yield _per_stage(
        CounterMetricFamily,
        "ppserve_stage_restarts",
        "Times each stage's process was replaced after a failure",
        s.stage_restarts,
    )
    yield GaugeMetricFamily("ppserve_recovering", "1 while a failed stage is being replaced", value=int(s.recovering))
    if s.stage_nodes:  # under Ray: where each stage runs now
        nodes = GaugeMetricFamily(
            "ppserve_stage_node",
            "Where each stage runs (1): its Ray node id and address",
            labels=["stage", "node_id", "address"],
        )
        for stage, (node_id, address) in enumerate(s.stage_nodes):
            nodes.add_metric([str(stage), node_id, address], 1)
        yield nodes
    yield from _cache_and_spec_families(s)
    yield from _moe_families(s)
    counts = [0] * (len(_CHUNK_BUCKETS) + 1)
    for size, n in s.prefill_chunks.items():
        counts[bisect.bisect_left(_CHUNK_BUCKETS, size)] += n
    total = float(sum(size * n for size, n in s.prefill_chunks.items()))
    yield _histogram_family(
        "ppserve_prefill_chunk_tokens", "Sizes of the prefill chunks scheduled", _CHUNK_BUCKETS, counts, total
    )
    if s.latency_model is not None:
        model = GaugeMetricFamily(
            "ppserve_prefill_latency_coefficient",
            "Fitted prefill latency f(l) = a*l^2 + b*l + c of the bottleneck stage (seconds)",
            labels=["term"],
        )
        for term, value in zip("abc", s.latency_model, strict=True):
            model.add_metric([term], value)
        yield model


def _cache_and_spec_families(s: EngineStats) -> Iterator[Metric]:
    yield CounterMetricFamily(
        "ppserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", value=s.prefix_cache_queries
    )
    yield CounterMetricFamily(
        "ppserve_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)", value=s.prefix_cache_hits
    )
    yield GaugeMetricFamily(
        "ppserve_prefix_cache_blocks",
        "KV blocks holding a cached prefix (in use, or kept for reuse until the space is needed)",
        value=s.prefix_cache_blocks,
    )
    yield CounterMetricFamily(
        "ppserve_prefix_cache_evictions", "Cached KV blocks given to new contents", value=s.prefix_cache_evictions
    )
    for name, what, count in (
        ("num_drafts", "Decode steps that carried draft tokens (speculative decoding)", s.spec_drafts),
        ("num_draft_tokens", "Draft tokens verified", s.spec_draft_tokens),
        ("num_accepted_tokens", "Draft tokens kept (each one a model step saved)", s.spec_accepted_tokens),
    ):
        yield CounterMetricFamily(f"ppserve_spec_decode_{name}", what, value=count)
    yield _per_stage(
        CounterMetricFamily,
        "ppserve_stage_computed_tokens",
        "Tokens each stage's layers computed (prompt and generated)",
        s.stage_tokens,
    )
    yield _per_stage(
        GaugeMetricFamily,
        "ppserve_stage_busy_fraction",
        "Fraction of the last 10 s each stage spent computing",
        s.stage_busy,
    )


def _moe_families(s: EngineStats) -> Iterator[Metric]:
    """A mixture of experts: per MoE layer, never per expert (engine/runtime/expert_load.py)."""
    if not s.moe:
        return
    window = f"the last {WINDOW_S:.0f} s"
    routed = CounterMetricFamily(
        "ppserve_moe_routed_tokens", "Tokens routed to each MoE layer's experts", labels=["layer"]
    )
    imbalance = GaugeMetricFamily(
        "ppserve_moe_expert_imbalance",
        f"Each MoE layer's busiest expert's tokens over its experts' mean, in {window} (1: even)",
        labels=["layer"],
    )
    idle = GaugeMetricFamily(
        "ppserve_moe_idle_experts", f"Each MoE layer's experts that got no token in {window}", labels=["layer"]
    )
    for load in s.moe:
        routed.add_metric([str(load.layer)], load.routed)
        imbalance.add_metric([str(load.layer)], load.imbalance)
        idle.add_metric([str(load.layer)], load.idle)
    yield from (routed, imbalance, idle)
