"""Dynamic chunk sizing on its own: the closed form, the fit, and the rules applied after it."""

from __future__ import annotations

import itertools
import logging
import math
import random

import pytest

from ppserve.scheduler.chunk_predictor import (
    MIN_FIT_POINTS,
    ChunkSizePredictor,
    LatencyModel,
    fit_latency_model,
    solve_chunk,
)

BIG = 1 << 30  # "remaining" large enough that the cap never bites
PREFIXES = [*range(0, 4096, 17), *range(4096, 131073, 997), 131072]


def random_model(rng: random.Random, chunk: int) -> LatencyModel:
    """a > 0 and T > 0, with b sometimes negative (still > -a*C so that T > 0)."""
    a = 10 ** rng.uniform(-10, -6)
    b = rng.uniform(-0.5 * a * chunk, 1e-4)
    c = rng.uniform(0.0, 0.05)
    return LatencyModel(a, b, c)


def brute_force_chunk(model: LatencyModel, prefix: int, target: float) -> float:
    """Bisection on f(L + x) - f(L) = T, with f evaluated as a plain polynomial."""

    def f(length: float) -> float:
        return model.a * length * length + model.b * length + model.c

    lo, hi = 0.0, 1.0
    while f(prefix + hi) - f(prefix) < target:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if f(prefix + mid) - f(prefix) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def test_latency_model_formulas() -> None:
    m = LatencyModel(a=2.0, b=3.0, c=5.0)
    assert m.prefill(0) == 5.0
    assert m.prefill(10) == 2.0 * 100 + 30 + 5
    assert m.chunk(0, 10) == m.prefill(10)
    # Per-forward overhead c counts once per chunk, the rest telescopes.
    assert m.chunk(7, 4) == pytest.approx(m.prefill(11) - m.prefill(7) + m.c)


def test_closed_form_matches_brute_force() -> None:
    rng = random.Random(1234)
    for _ in range(200):
        chunk = rng.randint(16, 8192)
        model = random_model(rng, chunk)
        prefix = rng.randint(0, 131072)
        target = model.a * chunk * chunk + model.b * chunk
        x = solve_chunk(model, prefix, target)
        assert x == pytest.approx(brute_force_chunk(model, prefix, target), rel=1e-6)
        # And it really spends the target, evaluated without cancellation.
        assert model.a * x * (2 * prefix + x) + model.b * x == pytest.approx(target, rel=1e-9)


def test_closed_form_is_c_at_empty_prefix() -> None:
    rng = random.Random(7)
    for _ in range(50):
        chunk = rng.randint(1, 8192)
        model = random_model(rng, chunk)
        assert solve_chunk(model, 0, model.a * chunk * chunk + model.b * chunk) == pytest.approx(chunk, rel=1e-12)


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("smooth", [0.25, 0.75, 1.0])
def test_chunks_never_grow_and_obey_floor_alignment_cap(page_size: int, smooth: float) -> None:
    rng = random.Random(page_size * 1000 + int(smooth * 100))
    for chunk in [64, 100, 512, 2048, 8192]:
        for _ in range(3):
            pred = ChunkSizePredictor(chunk, smooth=smooth, page_size=page_size, model=random_model(rng, chunk))
            assert pred.dynamic
            unit = pred.unit
            assert unit == max(page_size, 64)  # every chunk here is >= 64
            floor = math.ceil(chunk / 4)
            sizes = [pred.next_chunk(prefix, BIG) for prefix in PREFIXES]
            assert all(later <= earlier for earlier, later in itertools.pairwise(sizes))
            if any(floor <= k * unit <= chunk for k in range(1, chunk // unit + 1)):
                for size in sizes:
                    assert floor <= size <= chunk
                    assert size % unit == 0
                assert sizes[0] == (chunk // unit) * unit  # x == C at prefix 0, aligned down
            else:  # page larger than the chunk: nothing to align to, so C itself
                assert sizes == [chunk] * len(sizes)
            # The cap: never more than what is left of the prompt, never below one token.
            for prefix in (0, 5000, 120000):
                for remaining in (1, 3, unit - 1, unit + 1, chunk - 1, chunk, chunk + 1):
                    if remaining < 1:
                        continue
                    size = pred.next_chunk(prefix, remaining)
                    assert 1 <= size <= remaining
                    assert size == min(pred.next_chunk(prefix, BIG), remaining)


def test_strong_attention_cost_hits_the_floor() -> None:
    # Attention dominates: at a 128K prefix the model wants far less than C/4, so the floor holds.
    pred = ChunkSizePredictor(2048, smooth=1.0, page_size=16, model=LatencyModel(a=1e-6, b=1e-6, c=0.0))
    assert pred.next_chunk(0, BIG) == 2048
    assert pred.next_chunk(131072, BIG) == 512
    # Small chunk, small page: the unit is the page size and the floor rounds up to it.
    small = ChunkSizePredictor(30, smooth=1.0, page_size=4, model=LatencyModel(a=1e-6, b=1e-6, c=0.0))
    assert small.unit == 4
    assert small.next_chunk(131072, BIG) == 8  # ceil(30/4) = 8, already a multiple of 4
    assert small.next_chunk(0, BIG) == 28


def test_smoothing_interpolates_toward_c() -> None:
    model = LatencyModel(a=1e-10, b=1e-4, c=0.01)
    strict = ChunkSizePredictor(4096, smooth=1.0, model=model)
    half = ChunkSizePredictor(4096, smooth=0.5, model=model)
    prefix = 60000
    x = solve_chunk(model, prefix, strict.target)
    assert 1024 < x < 4096 - 128  # above the floor, and far enough below C to see smoothing
    assert strict.next_chunk(prefix, BIG) == (math.floor(x) // 64) * 64
    assert half.next_chunk(prefix, BIG) == (math.floor(4096 + 0.5 * (x - 4096)) // 64) * 64
    assert strict.next_chunk(prefix, BIG) < half.next_chunk(prefix, BIG) < 4096


@pytest.mark.parametrize("remaining", [1, 50, 512, 513, 10_000])
def test_smooth_zero_gives_fixed_chunks(remaining: int) -> None:
    pred = ChunkSizePredictor(512, smooth=0.0, page_size=16, model=LatencyModel(a=1e-7, b=1e-5, c=0.01))
    assert not pred.dynamic
    for prefix in (0, 1000, 131072):
        assert pred.next_chunk(prefix, remaining) == min(512, remaining)


@pytest.mark.parametrize(
    "model",
    [LatencyModel(a=0.0, b=1e-5, c=0.01), LatencyModel(a=-1e-8, b=1e-4, c=0.0), LatencyModel(a=1e-9, b=-1.0, c=0.0)],
)
def test_degenerate_model_falls_back_with_one_warning(model: LatencyModel, caplog: pytest.LogCaptureFixture) -> None:
    pred = ChunkSizePredictor(512, smooth=0.75, page_size=16)
    with caplog.at_level(logging.WARNING, logger="ppserve.scheduler.chunk_predictor"):
        assert pred.set_model(model) is False
        assert pred.set_model(model) is False  # refit with the same bad data: no second warning
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "fixed chunks of 512" in warnings[0].getMessage()
    assert not pred.dynamic
    assert [pred.next_chunk(p, 700) for p in (0, 10_000, 131072)] == [512, 512, 512]
    assert pred.next_chunk(10_000, 100) == 100


def test_too_few_points_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    model = LatencyModel(a=1e-8, b=1e-5, c=0.02)
    samples = [(0, n, model.chunk(0, n)) for n in (64, 128, 256, 512, 1024, 2048, 4096)]
    assert len(samples) == MIN_FIT_POINTS - 1
    assert fit_latency_model(samples) is None
    pred = ChunkSizePredictor(1024)
    with caplog.at_level(logging.WARNING, logger="ppserve.scheduler.chunk_predictor"):
        assert pred.set_model(fit_latency_model(samples)) is False
    assert any("falling back to fixed chunks" in r.getMessage() for r in caplog.records)
    assert pred.next_chunk(50_000, BIG) == 1024
    # A usable model switches it on, and a later failure warns again.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ppserve.scheduler.chunk_predictor"):
        assert pred.set_model(model) is True
        assert not caplog.records
        assert pred.set_model(None) is False
    assert len(caplog.records) == 1


def test_identical_samples_are_singular() -> None:
    assert fit_latency_model([(0, 256, 0.1)] * 20) is None


@pytest.mark.parametrize("with_prefixes", [False, True])
def test_fit_recovers_exact_coefficients(with_prefixes: bool) -> None:
    truth = LatencyModel(a=3e-9, b=2e-5, c=0.015)
    rng = random.Random(99)
    samples = []
    for _ in range(40):
        prefix = rng.randint(0, 65536) if with_prefixes else 0
        tokens = rng.randint(1, 8192)
        samples.append((prefix, tokens, truth.chunk(prefix, tokens)))
    fit = fit_latency_model(samples)
    assert fit is not None
    assert fit.a == pytest.approx(truth.a, rel=1e-6)
    assert fit.b == pytest.approx(truth.b, rel=1e-6)
    assert fit.c == pytest.approx(truth.c, rel=1e-6)


def test_fit_from_noisy_samples_is_close() -> None:
    truth = LatencyModel(a=2e-9, b=4e-5, c=0.01)
    rng = random.Random(5)
    samples = []
    for _ in range(400):
        prefix = rng.randint(0, 32768)
        tokens = rng.randint(64, 8192)
        samples.append((prefix, tokens, truth.chunk(prefix, tokens) * (1.0 + rng.gauss(0.0, 0.02))))
    fit = fit_latency_model(samples)
    assert fit is not None
    assert fit.a == pytest.approx(truth.a, rel=0.1)
    assert fit.b == pytest.approx(truth.b, rel=0.1)
    for prefix, tokens in [(0, 512), (0, 8192), (16384, 2048), (32768, 4096)]:
        assert fit.chunk(prefix, tokens) == pytest.approx(truth.chunk(prefix, tokens), rel=0.03)
    # The chunk sizes it leads to are close to the ones the true model gives.
    exact = ChunkSizePredictor(2048, smooth=1.0, model=truth)
    fitted = ChunkSizePredictor(2048, smooth=1.0, model=fit)
    for prefix in (0, 8192, 32768):
        assert abs(exact.next_chunk(prefix, BIG) - fitted.next_chunk(prefix, BIG)) <= 128


def test_fit_rejects_bad_samples() -> None:
    good = [(0, n, 0.01 * n) for n in range(1, 10)]
    with pytest.raises(ValueError, match="latency sample"):
        fit_latency_model([*good, (0, 0, 0.1)])
    with pytest.raises(ValueError, match="latency sample"):
        fit_latency_model([*good, (-1, 5, 0.1)])


@pytest.mark.parametrize("smooth", [-0.1, 1.5, math.nan])
def test_invalid_smooth_factor(smooth: float) -> None:
    with pytest.raises(ValueError, match="smooth factor"):
        ChunkSizePredictor(512, smooth=smooth)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="initial chunk"):
        ChunkSizePredictor(0)
    with pytest.raises(ValueError, match="page size"):
        ChunkSizePredictor(512, page_size=0)
    pred = ChunkSizePredictor(512)
    with pytest.raises(ValueError, match="remaining"):
        pred.next_chunk(0, 0)
    with pytest.raises(ValueError, match="a > 0"):
        solve_chunk(LatencyModel(0.0, 1.0, 0.0), 0, 1.0)
