"""Prometheus metrics: request latencies measured where clients see them, engine state read at
scrape time (so nothing has to keep gauges up to date)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import aclosing

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.async_engine import EngineStats
from engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_CHUNK_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("ppserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("ppserve_generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter("ppserve_requests", "Finished requests", ["finish_reason"], registry=r)
        self.ttft = Histogram(
            "ppserve_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "ppserve_inter_token_latency_seconds", "Time between generated tokens", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "ppserve_e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r
        )
        r.register(_EngineCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def track(self, outputs: AsyncGenerator[RequestOutput, None]) -> AsyncGenerator[RequestOutput, None]:
        """Pass `outputs` through, timing them. Closing this closes `outputs` (which aborts the
        request in the engine)."""
        start = last = time.monotonic()
        first = True
        async with aclosing(outputs):
            async for out in outputs:
                now = time.monotonic()
                if out.token_ids:
                    if first:
                        self.ttft.observe(now - start)
                        first = False
                    else:
                        # Several tokens in one output (held back for a stop string) share the gap.
                        for _ in out.token_ids:
                            self.itl.observe((now - last) / len(out.token_ids))
                    last = now
                    self.generation_tokens.inc(len(out.token_ids))
                if out.finished:
                    self.e2e.observe(now - start)
                    self.prompt_tokens.inc(out.prompt_tokens)
                    self.requests.labels(out.finish_reason or "abort").inc()
                yield out


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        if s is None:  # the engine is not started yet
            return
        yield GaugeMetricFamily("ppserve_requests_running", "Requests being computed", value=s.running)
        yield GaugeMetricFamily("ppserve_requests_waiting", "Requests waiting to start", value=s.waiting)
        yield GaugeMetricFamily("ppserve_kv_blocks_used", "KV-cache blocks in use", value=s.kv_blocks_used)
        yield GaugeMetricFamily("ppserve_kv_blocks_total", "KV-cache blocks per stage", value=s.kv_blocks_total)
        busy = GaugeMetricFamily(
            "ppserve_stage_busy_fraction", "Fraction of the last 10 s each stage spent computing", labels=["stage"]
        )
        for stage, fraction in enumerate(s.stage_busy):
            busy.add_metric([str(stage)], fraction)
        yield busy
        chunks = HistogramMetricFamily("ppserve_prefill_chunk_tokens", "Sizes of the prefill chunks scheduled")
        counts = [sum(n for size, n in s.prefill_chunks.items() if size <= le) for le in _CHUNK_BUCKETS]
        total = sum(s.prefill_chunks.values())
        buckets = [(str(le), float(c)) for le, c in zip(_CHUNK_BUCKETS, counts, strict=True)]
        chunks.add_metric(
            [], [*buckets, ("+Inf", float(total))], sum_value=sum(k * n for k, n in s.prefill_chunks.items())
        )
        yield chunks
        if s.latency_model is not None:
            model = GaugeMetricFamily(
                "ppserve_prefill_latency_coefficient",
                "Fitted prefill latency f(l) = a*l^2 + b*l + c of the bottleneck stage (seconds)",
                labels=["term"],
            )
            for term, value in zip("abc", s.latency_model, strict=True):
                model.add_metric([term], value)
            yield model
