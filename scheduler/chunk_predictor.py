"""Dynamic prefill chunk sizes: equal-time chunks instead of equal-size chunks.

A chunk of x new tokens after a prefix of L cached tokens costs about

    f(L + x) - f(L) + c = a*((L + x)^2 - L^2) + b*x + c,    f(l) = a*l^2 + b*l + c,

because attention over the prefix grows with L (the a-term) while the MLP work grows with x
(the b-term) and c is paid once per forward. With a configured chunk C, the target is the cost of
a first chunk, T = f(C) - f(0) = a*C^2 + b*C, and the next chunk solves a*x^2 + (2aL + b)*x = T:

    x = (-(2aL + b) + sqrt((2aL + b)^2 + 4aT)) / (2a)

x equals C at L = 0 and shrinks as L grows, which keeps downstream pipeline stages busy instead
of idling behind ever slower chunks. The result is smoothed toward C, floored, aligned and capped
(see `ChunkSizePredictor.next_chunk`). Pure Python: no torch, numpy, sockets or asyncio.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Fewer samples than this make a 3-parameter least-squares fit mostly noise.
MIN_FIT_POINTS = 8
# Chunks of at least this many tokens are also aligned to it (kernel tiles like multiples of 64).
TILE = 64
# Absorbs float error so that x == C at L == 0 is not floored to C - 1 and then aligned a unit down.
_TOKEN_EPS = 1e-6
# A pivot this small relative to the largest matrix entry means the samples do not pin down a, b, c.
_SINGULAR_RTOL = 1e-12


@dataclass(frozen=True)
class LatencyModel:
    """Prefill latency in seconds: f(l) = a*l^2 + b*l + c."""

    a: float
    b: float
    c: float

    def prefill(self, tokens: int) -> float:
        """f(tokens): a prefill of `tokens` tokens from scratch."""
        return self.a * tokens * tokens + self.b * tokens + self.c

    def chunk(self, prefix: int, tokens: int) -> float:
        """Cost of `tokens` new tokens after `prefix` cached ones; c is per forward, so it counts once."""
        return self.a * ((prefix + tokens) ** 2 - prefix**2) + self.b * tokens + self.c


def fit_latency_model(samples: Sequence[tuple[int, int, float]]) -> LatencyModel | None:
    """Least-squares fit of (prefix, tokens, seconds) samples to `LatencyModel.chunk`.

    Features are ((L + x)^2 - L^2, x, 1); with L = 0 this is exactly fitting f(l) to from-scratch
    prefills. Returns None with fewer than MIN_FIT_POINTS samples or when the normal equations are
    singular (e.g. every sample has the same shape). A fit with a <= 0 is returned as is: the
    predictor decides what is degenerate.
    """
    if len(samples) < MIN_FIT_POINTS:
        return None
    for prefix, tokens, seconds in samples:
        if prefix < 0 or tokens < 1 or not math.isfinite(seconds):
            raise ValueError(
                f"latency sample needs prefix >= 0, tokens >= 1, finite seconds; got {(prefix, tokens, seconds)}"
            )
    # Scale by the longest sequence so every feature lies in [0, 1]; raw l^2 ~ 1e10 next to a
    # constant 1 would make the normal equations hopelessly ill-conditioned.
    scale = float(max(prefix + tokens for prefix, tokens, _ in samples))
    ata = [[0.0] * 3 for _ in range(3)]
    aty = [0.0] * 3
    for prefix, tokens, seconds in samples:
        row = (tokens * (2 * prefix + tokens) / (scale * scale), tokens / scale, 1.0)
        for i in range(3):
            aty[i] += row[i] * seconds
            for j in range(3):
                ata[i][j] += row[i] * row[j]
    solution = _solve3(ata, aty)
    if solution is None:
        return None
    a_s, b_s, c = solution
    model = LatencyModel(a=a_s / (scale * scale), b=b_s / scale, c=c)
    if not all(math.isfinite(v) for v in (model.a, model.b, model.c)):
        return None
    return model


def _solve3(m: list[list[float]], y: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on a 3x3 system; None if (nearly) singular."""
    aug = [[*row, y[i]] for i, row in enumerate(m)]
    norm = max(abs(v) for row in m for v in row)
    if norm == 0.0:
        return None
    n = 3
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(aug[r][col]))
        if abs(aug[pivot][col]) <= _SINGULAR_RTOL * norm:
            return None
        aug[col], aug[pivot] = aug[pivot], aug[col]
        for r in range(col + 1, n):
            factor = aug[r][col] / aug[col][col]
            for k in range(col, n + 1):
                aug[r][k] -= factor * aug[col][k]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        acc = aug[r][n] - sum(aug[r][k] * out[k] for k in range(r + 1, n))
        out[r] = acc / aug[r][r]
    return out


def solve_chunk(model: LatencyModel, prefix: int, target: float) -> float:
    """The positive x with f(prefix + x) - f(prefix) = target; needs a > 0 and target > 0.

    Uses x = 2T / (B + sqrt(B^2 + 4aT)) with B = 2aL + b when B > 0: the textbook form subtracts
    two nearly equal numbers once B^2 >> 4aT (long prefixes) and loses most of its digits.
    """
    if model.a <= 0 or target <= 0:
        raise ValueError(f"solve_chunk needs a > 0 and target > 0, got a={model.a}, target={target}")
    big_b = 2.0 * model.a * prefix + model.b
    root = math.sqrt(big_b * big_b + 4.0 * model.a * target)
    if big_b > 0:
        return 2.0 * target / (big_b + root)
    return (root - big_b) / (2.0 * model.a)  # both terms positive: no cancellation


class ChunkSizePredictor:
    """Chooses the next prefill chunk size from a latency model; fixed chunks when there is none."""

    def __init__(
        self, initial_chunk: int, smooth: float = 0.75, page_size: int = 1, model: LatencyModel | None = None
    ) -> None:
        if initial_chunk < 1:
            raise ValueError(f"initial chunk size must be >= 1, got {initial_chunk}")
        # Written as a negated range check so that NaN is rejected too.
        if not 0.0 <= smooth <= 1.0:
            raise ValueError(f"dynamic chunking smooth factor must be in [0, 1], got {smooth}")
        if page_size < 1:
            raise ValueError(f"page size must be >= 1, got {page_size}")
        self.initial_chunk = initial_chunk
        self.smooth = float(smooth)
        self.page_size = page_size
        self.model: LatencyModel | None = None
        self._warned = False
        if model is not None:
            self.set_model(model)

    @property
    def target(self) -> float:
        """T = f(C) - f(0): the cost every chunk aims for (0.0 without a model)."""
        if self.model is None:
            return 0.0
        c = self.initial_chunk
        return self.model.a * c * c + self.model.b * c

    @property
    def usable(self) -> bool:
        """The model has a > 0 and T > 0, so the chunk equation has one positive root."""
        m = self.model
        if m is None or not all(math.isfinite(v) for v in (m.a, m.b, m.c)):
            return False
        return m.a > 0 and self.target > 0

    @property
    def dynamic(self) -> bool:
        """Chunk sizes follow the model: a usable model is set and smooth > 0 (s = 0 means fixed)."""
        return self.smooth > 0 and self.usable

    @property
    def unit(self) -> int:
        """Alignment unit: the page size, raised to 64 when C >= 64 and the page is smaller."""
        return max(self.page_size, TILE) if self.initial_chunk >= TILE else self.page_size

    def set_model(self, model: LatencyModel | None) -> bool:
        """Install a fitted model (None: the fit failed); returns whether chunking is now dynamic."""
        self.model = model
        if self.usable:
            self._warned = False  # a later degenerate fit deserves its own warning
        elif self.smooth > 0 and not self._warned:
            # Warn once, not on every refit: the engine may refit often with the same bad data.
            self._warned = True
            if model is None:
                reason = f"fewer than {MIN_FIT_POINTS} usable latency samples or a singular fit"
            else:
                reason = f"degenerate fit a={model.a:.3g}, b={model.b:.3g}, T={self.target:.3g} (need a > 0, T > 0)"
            logger.warning(
                "dynamic chunking: %s; falling back to fixed chunks of %d tokens", reason, self.initial_chunk
            )
        return self.dynamic

    def next_chunk(self, prefix: int, remaining: int) -> int:
        """Tokens to prefill next, after `prefix` cached tokens with `remaining` still to go.

        Fixed mode (no usable model, or s = 0): min(C, remaining). Otherwise, with lo = ceil(C/4)
        and u = `unit`:
          1. x = solve_chunk(model, prefix, T), then x' = C + s*(x - C), clamped to [lo, C];
          2. n = floor(x'), aligned down to a multiple of u, but never below the smallest
             multiple of u that is >= lo;
          3. if no multiple of u lies in [lo, C] (a page larger than the chunk), alignment is
             impossible without breaking the floor or exceeding C, so the size is C itself;
          4. the result is capped at `remaining`.
        Every step is non-decreasing in x and x falls as the prefix grows, so chunk sizes never
        increase along a prompt; the result is in [1, min(C, remaining)].
        """
        if prefix < 0 or remaining < 1:
            raise ValueError(f"next_chunk needs prefix >= 0 and remaining >= 1, got {prefix}, {remaining}")
        big_c = self.initial_chunk
        if not self.dynamic:
            return min(big_c, remaining)
        assert self.model is not None  # dynamic implies a model
        unit = self.unit
        lo = max(1, -(-big_c // 4))
        lo_aligned = -(-lo // unit) * unit
        if lo_aligned > big_c:
            return min(big_c, remaining)
        x = solve_chunk(self.model, prefix, self.target)
        smoothed = big_c + self.smooth * (x - big_c)
        # Clamp before flooring: x <= C holds only up to rounding, and the slack keeps x == C at C.
        n = math.floor(min(float(big_c), max(float(lo), smoothed)) + _TOKEN_EPS)
        size = max((n // unit) * unit, lo_aligned)
        return min(size, remaining)
