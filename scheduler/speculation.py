"""Speculative decoding's policy: how many drafts each request's decode step carries (pure Python).

A draft token costs a row of compute in every stage and pays only if accepted. Each request keeps
an estimate `alpha` of the chance that its next draft token is accepted (counts of kept and
rejected draft tokens, forgotten a little every token, so that a request that copies again after
a while of free text is tried again; a new request starts from what recent requests' drafts did).
A step's time is modelled as t0 + c * rows, fitted to the decode steps' own timings (`StepCost`).
A plan with R rows that is expected to make T tokens makes T / (t0 + c * R) tokens a second; its
request's i-th draft token adds alpha^i expected tokens for c seconds, so it is taken while

    alpha^i * (t0 / c + R) >= T

At batch 1 on a CPU a row costs little beside reading the weights (t0 / c is large), so drafts are
long; with 16 or 32 decode rows the step is compute-bound, T is large, and only requests that copy
almost surely still draft. Drafts never exceed what the request may still generate. At PP=1 a
request drafts rather than decode ahead only where its drafts should make AHEAD_GAIN tokens a step.

The tokens a grammar forces (Sampled.forced: the last stage's jump-forward) are taken as they are:
the grammar's mask allows little else, so they are all but certain.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppserve.scheduler.drafter import Drafter
from ppserve.scheduler.kv_groups import KvGroups
from ppserve.scheduler.prefix_cache import PrefixCache
from ppserve.scheduler.request import Request

FORGET = 0.97  # per token: a request's acceptance counts fade towards the prior
GLOBAL_FORGET = 0.995  # per settled step: the prior's counts fade (the workload may change)
PRIOR_WEIGHT = 2.0  # the prior counts as this many tries of a request's own
# At PP=1 a request planned ahead hides the host's turnaround (scheduler.py, decode_ahead), and keeps
# its place in every plan: it waits for its token to draft instead only where its drafts should make
# this many tokens a step.
AHEAD_GAIN = 1.25
MAX_FORCED = 16  # forced tokens drafted in one step at most


@dataclass
class SpecStats:
    """Counts since the start (vLLM's `spec_decode_*` counters, in /metrics)."""

    drafts: int = 0  # steps that carried drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0


class StepCost:
    """t(rows) = t0 + c * rows for a decode step, by exponentially weighted least squares over the
    steps seen; `ratio` is c / t0, what one more row costs beside a one-row step."""

    PRIOR_RATIO = 0.1  # until steps of two different row counts have been seen
    DECAY = 0.99

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._rows: set[int] = set()
        self.ratio = self.PRIOR_RATIO  # c / t0

    def observe(self, rows: int, seconds: float) -> None:
        if not seconds > 0:
            return
        d = self.DECAY
        self._w, self._x, self._y = d * self._w + 1, d * self._x + rows, d * self._y + seconds
        self._xx, self._xy = d * self._xx + rows * rows, d * self._xy + rows * seconds
        if len(self._rows) < 2:
            self._rows.add(rows)
        self.ratio = self._fit()  # once per step here, not once per request where it is read

    def _fit(self) -> float:
        if len(self._rows) < 2:
            return self.PRIOR_RATIO
        var = self._w * self._xx - self._x * self._x
        if var <= 1e-9 * self._w * self._w:
            return self.PRIOR_RATIO
        c = (self._w * self._xy - self._x * self._y) / var
        t0 = (self._y - c * self._x) / self._w
        if t0 <= 0:
            return 10.0  # all slope: rows are what costs
        return min(10.0, max(0.01, c / t0))  # (a noisy fit never makes rows free)


class Speculator:
    def __init__(self, mode: str, max_drafts: int) -> None:
        self.drafter = Drafter(mode)
        self.max_drafts = max_drafts
        self.cost = StepCost()
        self.stats = SpecStats()
        self._hits = self._tries = 0.0  # every request's drafts, fading: the prior of a new request's

    @property
    def enabled(self) -> bool:
        return self.drafter.mode != "off"

    def drafts(self, r: Request, limit: int, rows: float, tokens: float) -> tuple[list[int], float]:
        """Drafts for r's next decode step, at most `limit`, in a plan of `rows` rows expected to
        make `tokens` tokens (r's own step counted); returns them and the tokens they should add."""
        _fade(r)
        if limit < 1 or not self.enabled:
            return [], 0.0
        r.draft_forced = bool(r.forced)
        if r.forced:
            forced = r.forced[: min(limit, MAX_FORCED)]
            return forced, float(len(forced))
        alpha = self._alpha(r)
        k, _ = self._length(alpha, min(limit, self.max_drafts), rows, tokens)
        if not k:
            return [], 0.0
        draft = self.drafter.propose(r, k)
        if not draft:
            r.spec_tries += 1  # nothing to draft from counts as a miss: such a request stops asking
        return draft, sum(alpha ** (i + 1) for i in range(len(draft)))

    def wants(self, r: Request, rows: int) -> bool:
        """Whether r's next step should carry drafts rather than be planned ahead at PP=1 (drafts
        follow the token in flight, so the request waits for it): where they are forced, or where
        the drafts that would pay in a plan of `rows` rows should make AHEAD_GAIN tokens a step."""
        if not self.enabled:
            return False
        _fade(r)
        _, expected = self._length(self._alpha(r), self.max_drafts, rows, rows)
        return bool(r.forced) or 1 + expected >= AHEAD_GAIN

    def _length(self, alpha: float, cap: int, rows: float, tokens: float) -> tuple[int, float]:
        """How many drafts pay for a request with acceptance `alpha` in a plan of `rows` rows that
        should make `tokens` tokens, at most `cap`; and the tokens they should add."""
        headroom = 1 / self.cost.ratio
        k, gain, expected = 0, 1.0, 0.0
        while k < cap:
            gain *= alpha
            if gain * (headroom + rows + k) < tokens + expected:
                break
            k, expected = k + 1, expected + gain
        return k, expected

    def _alpha(self, r: Request) -> float:
        """The chance that r's next draft token is kept: its own counts, after PRIOR_WEIGHT tries'
        worth of what recent requests' drafts did (a workload that copies starts drafting long)."""
        prior = (self._hits + 1) / (self._tries + 2)
        return (r.spec_hits + PRIOR_WEIGHT * prior) / (r.spec_tries + PRIOR_WEIGHT)

    def settle(self, r: Request, made: int, kv: KvGroups, cache: PrefixCache) -> bool:
        """r's step with drafts made `made` tokens: the drafts kept and one more. The rest were
        computed for nothing: r's counts roll back over them (their KV is overwritten later), and
        blocks taken only for them go back. Returns whether the stages' table of r must shrink
        to its `block_table` (StepPlan.truncated)."""
        drafted, accepted = len(r.drafts), max(0, made - 1)
        self.stats.drafts += 1
        self.stats.draft_tokens += drafted
        self.stats.accepted_tokens += accepted
        r.num_draft_tokens += drafted
        r.num_accepted_tokens += accepted
        r.num_spec_steps += 1
        if not r.draft_forced:
            tries = accepted + (accepted < drafted)
            r.spec_hits += accepted
            r.spec_tries += tries
            self._hits = GLOBAL_FORGET * self._hits + accepted
            self._tries = GLOBAL_FORGET * self._tries + tries
        r.drafts = []
        if r.finished:
            return False  # its blocks go back with it
        r.num_scheduled_tokens -= drafted - accepted
        r.num_computed_tokens -= drafted - accepted
        cache.verified(r, r.num_tokens - made)
        kv.shrink(r, r.num_scheduled_tokens)
        if r.num_blocks_sent <= len(r.block_table):
            return False
        r.num_blocks_sent = len(r.block_table)
        return True

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` rows took `seconds` on its slowest stage."""
        self.cost.observe(rows, seconds)

    def finished(self, r: Request) -> None:
        self.drafter.finished(r)


def _fade(r: Request) -> None:
    """r's acceptance counts fade by FORGET per token made since they last did (also while it
    decodes ahead without drafting: so that it tries again)."""
    if (n := r.num_tokens - r.spec_faded) > 0:
        r.spec_hits, r.spec_tries, r.spec_faded = r.spec_hits * FORGET**n, r.spec_tries * FORGET**n, r.num_tokens
