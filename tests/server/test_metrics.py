"""The metrics exposition, without a server: bucket edges, counters, engine gauges."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from prometheus_client.parser import text_string_to_metric_families

from ppserve.engine.outputs import EngineStats, RequestOutput
from ppserve.server.metrics import ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


async def test_histograms_and_counters_follow_prometheus_semantics() -> None:
    stats = EngineStats(
        2, 1, 10, 100, (0.5, 0.25), {256: 3, 100: 1}, (1e-9, 2e-5, 0.001), 7, (0, 2), True, 900, 600, 12, 5, (40, 38)
    )
    metrics = ServerMetrics(lambda: stats)
    metrics.itl.observe(0.005)  # exactly on a bucket edge: counts as <= 0.005
    metrics.itl.observe(0.3, 2)

    async def outputs() -> AsyncGenerator[RequestOutput, None]:
        yield RequestOutput("r", "a", [1], False, None, 4, 1)
        yield RequestOutput("r", "bc", [2, 3], True, "length", 4, 3)

    assert [o.text async for o in metrics.track(outputs())] == ["a", "bc"]
    m = _samples(metrics)
    assert m['ppserve_inter_token_latency_seconds_bucket{le="0.005"}'] >= 1
    assert (
        m['ppserve_inter_token_latency_seconds_bucket{le="0.25"}']
        == m['ppserve_inter_token_latency_seconds_bucket{le="0.005"}']
    )
    assert m["ppserve_inter_token_latency_seconds_count"] == 5  # 1 + 2 + the two tokens of the last output
    assert m["ppserve_time_to_first_token_seconds_count"] == 1 and m["ppserve_e2e_request_latency_seconds_count"] == 1
    assert m["ppserve_generation_tokens_total"] == 3 and m["ppserve_prompt_tokens_total"] == 4
    assert m['ppserve_requests_total{finish_reason="length"}'] == 1
    assert m["ppserve_requests_running"] == 2 and m["ppserve_kv_blocks_used"] == 10
    assert m['ppserve_stage_busy_fraction{stage="1"}'] == 0.25
    assert m['ppserve_prefill_chunk_tokens_bucket{le="128"}'] == 1 and m["ppserve_prefill_chunk_tokens_count"] == 4
    assert m["ppserve_prefill_chunk_tokens_sum"] == 868
    assert m['ppserve_prefill_latency_coefficient{term="b"}'] == 2e-5
    assert m["ppserve_preemptions_total"] == 7 and m["ppserve_recovering"] == 1
    assert m['ppserve_stage_restarts_total{stage="0"}'] == 0 and m['ppserve_stage_restarts_total{stage="1"}'] == 2
    assert m["ppserve_prefix_cache_queries_total"] == 900 and m["ppserve_prefix_cache_hits_total"] == 600
    assert m["ppserve_prefix_cache_blocks"] == 12 and m["ppserve_prefix_cache_evictions_total"] == 5
    assert m['ppserve_stage_computed_tokens_total{stage="1"}'] == 38
