"""Sampling against plain reference computations, and seeded reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from ppserve.engine.model.sampler import Sampler, apply_penalties
from ppserve.engine.model.sampling_ops import BLOCK, TOP_P_CANDIDATES, SamplerParams, candidates, inverse_transform
from ppserve.scheduler.sampling_params import SamplingParams


def filtered_probs(logits: torch.Tensor, params: SamplerParams) -> torch.Tensor:
    """logits: [vocab] -> the distribution a draw follows: after temperature, top-k, top-p and
    min-p, renormalised."""
    values, order = candidates((logits / params.temperature).softmax(-1), params)
    probs = torch.zeros_like(logits).index_put_((order,), values)
    return probs / probs.sum()


VOCAB = 50


def reference_filter(logits: list[float], p: SamplingParams) -> list[float]:
    """Temperature -> top-k -> top-p -> min-p, written out with plain Python lists."""
    scaled = [x / p.temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order[: p.top_k] if p.top_k else order)
    if p.top_p < 1.0:
        z = sum(math.exp(scaled[i]) for i in keep)
        covered, kept = 0.0, set()
        for i in order:
            if i not in keep:
                continue
            if covered >= p.top_p:
                break
            kept.add(i)
            covered += math.exp(scaled[i]) / z
        keep = kept
    z = sum(math.exp(scaled[i]) for i in keep)
    probs = [math.exp(scaled[i]) / z if i in keep else 0.0 for i in range(len(scaled))]
    if p.min_p:
        top = max(probs)
        probs = [q if q >= p.min_p * top else 0.0 for q in probs]
    total = sum(probs)
    return [q / total for q in probs]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=2.0, top_k=20, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=1),
    ],
)
def test_filters_match_reference(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(VOCAB, generator=gen) * 3
        got = filtered_probs(logits, params)
        want = torch.tensor(reference_filter(logits.tolist(), params))
        assert torch.allclose(got, want, atol=1e-6), params
        assert (got > 0).sum() >= 1


@pytest.mark.parametrize("scale", [0.1, 3.0])  # a nucleus wider than the candidates, and a narrow one
def test_top_p_over_a_large_vocabulary_matches_reference(scale: float) -> None:
    vocab = 3 * TOP_P_CANDIDATES
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * scale
    for params in (SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.5, top_p=0.5, min_p=0.01)):
        got = filtered_probs(logits, params)
        want = torch.tensor(reference_filter(logits.tolist(), params))
        assert torch.allclose(got, want, atol=1e-6), params


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-45])
def test_a_vanishing_top_p_keeps_the_most_likely_token(top_p: float) -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    sampler = Sampler(VOCAB, torch.device("cpu"))
    sampler.add_request("r", SamplingParams(temperature=1.0, top_p=top_p, seed=1))
    assert sampler.sample(["r"], logits.clone())[0].token_id == int(logits.argmax())


def test_plain_draws_follow_the_distribution() -> None:
    """Rows without top-k or top-p are drawn together (inverse transform over the whole
    vocabulary): each row's empirical frequencies stay within a few standard errors."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0] + [-3.0] * (VOCAB - 4), [0.0] * VOCAB])
    sampler = Sampler(VOCAB, torch.device("cpu"))
    sampler.add_request("a", SamplingParams(temperature=0.7, seed=1))
    sampler.add_request("b", SamplingParams(temperature=1.0, min_p=0.5, seed=2))
    n = 3000
    counts = torch.zeros(2, VOCAB)
    for _ in range(n):
        for row, sample in enumerate(sampler.sample(["a", "b"], logits)):
            counts[row, sample.token_id] += 1
    for row, params in enumerate((SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, min_p=0.5))):
        probs = filtered_probs(logits[row], params)
        stderr = torch.sqrt(probs * (1 - probs) / n)
        assert ((counts[row] / n - probs).abs() <= 4 * stderr + 1e-9).all()
        assert counts[row][probs == 0].sum() == 0


@pytest.mark.parametrize("n", [1, 3, BLOCK - 1, BLOCK, BLOCK + 1, 4 * BLOCK, 4 * BLOCK + 7, 49152])
def test_two_level_draw_matches_one_cumulative_sum(n: int) -> None:
    """Up to SMALL weights, one cumulative sum; above, a block by the blocks' sums, then a token in
    it. Either way, for any u it picks what one float64 cumulative sum over the row would, and
    never a zero weight, even at u's extremes."""
    gen = torch.Generator().manual_seed(n)
    weights = torch.rand(6, n, generator=gen) ** 8  # many tiny weights
    weights[weights < 0.05] = 0.0
    weights[:, -1] = 0.0  # a zero tail: a target rounded up to the total must not land there
    weights[torch.arange(6), torch.randint(0, max(n - 1, 1), (6,), generator=gen)] = 0.5
    cdf = weights.double().cumsum(-1)
    us = [torch.rand(6, dtype=torch.float64, generator=gen).tolist() for _ in range(40)]
    for u in [*us, [0.0] * 6, [1 - 2**-53] * 6]:
        picks = inverse_transform(weights, u)
        assert all(weights[i, t] > 0 for i, t in enumerate(picks))
        if u[0] < 1 - 2**-52:  # (at the very top, one sum may round past the total, the other not)
            target = torch.tensor(u, dtype=torch.float64)[:, None] * cdf[:, -1:]
            assert picks == torch.searchsorted(cdf, target, right=True)[:, 0].tolist()


def test_penalties_match_reference() -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3)
    sampler = Sampler(VOCAB, torch.device("cpu"))
    sampler.add_request("r", params)
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 2.0  # 7 wins until penalised enough
    logits[0, 9] = 1.5
    history: list[int] = []
    for _ in range(6):
        # Reference: subtract freq * count + presence * [count > 0] from the raw logits, then argmax.
        ref = [logits[0, i].item() - 0.3 * history.count(i) - (0.5 if i in history else 0.0) for i in range(VOCAB)]
        expected = max(range(VOCAB), key=lambda i: ref[i])
        token = sampler.sample(["r"], logits)[0].token_id
        assert token == expected
        history.append(token)
    assert set(history) == {7, 9}  # the penalty really moved the choice


def _reference_repetition(logits: list[float], seen: set[int], penalty: float) -> list[float]:
    """vLLM's (and transformers') rule, written out: a seen token's logit divided by the
    penalty if positive, multiplied by it otherwise."""
    return [(x / penalty if x > 0 else x * penalty) if i in seen else x for i, x in enumerate(logits)]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_reference(penalty: float) -> None:
    """Over the prompt's tokens and the generated ones, applied before presence/frequency (as
    vLLM orders them): the logprobs of a greedy request are of the raw distribution, so the
    penalised logits are read back through a sampler with temperature 1 and a fixed seed."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(1, VOCAB, generator=gen) * 3
    prompt = [3, 5, 5, 11, int(logits.argmax())]
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty, presence_penalty=0.2)
    sampler = Sampler(VOCAB, torch.device("cpu"))
    sampler.add_request("r", params, prompt_token_ids=prompt)
    history: list[int] = []
    for _ in range(8):
        ref = _reference_repetition(logits[0].tolist(), {*prompt, *history}, penalty)
        ref = [x - (0.2 if i in history else 0.0) for i, x in enumerate(ref)]
        got = sampler.sample(["r"], logits)[0].token_id
        assert got == max(range(VOCAB), key=lambda i: ref[i])
        history.append(got)
    # The penalised logits themselves, exactly (float32 division and multiplication):
    state = sampler._requests["r"]
    expected = torch.tensor(_reference_repetition(logits[0].tolist(), {*prompt, *history}, penalty))
    expected -= 0.2 * torch.tensor([float(i in history) for i in range(VOCAB)])
    assert torch.allclose(apply_penalties(logits, [state])[0], expected, rtol=0, atol=1e-6)
    # The prompt's best token really moved: penalised away (> 1) or kept (< 1) on the first step.
    assert (history[0] == int(logits.argmax())) == (penalty < 1)


def test_repetition_penalty_on_a_resumed_request() -> None:
    """Announced again (the last stage was replaced), it carries on exactly: the prompt and the
    tokens generated before count as seen."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0, seed=8, repetition_penalty=1.8)
    whole = Sampler(VOCAB, torch.device("cpu"))
    whole.add_request("r", params, prompt_token_ids=[1, 2, 3])
    tokens = _draw(whole, ["r"], logits, 30)["r"]
    resumed = Sampler(VOCAB, torch.device("cpu"))
    resumed.add_request("r", params, output_token_ids=tokens[:11], prompt_token_ids=[1, 2, 3])
    assert _draw(resumed, ["r"], logits, 19)["r"] == tokens[11:]


def test_greedy_is_argmax_and_logprobs() -> None:
    sampler = Sampler(VOCAB, torch.device("cpu"))
    sampler.add_request("g", SamplingParams(temperature=0.0, logprobs=3))
    sampler.add_request("tiny", SamplingParams(temperature=1e-30))  # dividing by it would overflow: greedy
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    logits[1] = logits[0]
    out, tiny = sampler.sample(["g", "tiny"], logits)
    raw = torch.log_softmax(logits[0], -1)
    assert out.token_id == tiny.token_id == int(raw.argmax())
    assert out.logprob == pytest.approx(raw.max().item())
    assert [t for t, _ in out.top_logprobs] == raw.topk(3).indices.tolist()
    assert [lp for _, lp in out.top_logprobs] == pytest.approx(raw.topk(3).values.tolist())
    assert tiny.logprob is None and tiny.top_logprobs == ()


def _draw(sampler: Sampler, ids: list[str], logits: torch.Tensor, steps: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(steps):
        for i, s in zip(ids, sampler.sample(ids, logits[: len(ids)]), strict=True):
            out[i].append(s.token_id)
    return out


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    logits[:] = logits[0]  # every row the same distribution; only the batch differs
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    alone = Sampler(VOCAB, torch.device("cpu"))
    alone.add_request("a", seeded)
    tokens_alone = _draw(alone, ["a"], logits, 30)["a"]

    crowded = Sampler(VOCAB, torch.device("cpu"))
    crowded.add_request("x", SamplingParams(temperature=1.0))  # unseeded neighbours
    crowded.add_request("a", seeded)
    crowded.add_request("y", SamplingParams(temperature=0.5, seed=99))
    tokens_crowded = _draw(crowded, ["x", "a", "y"], logits, 30)

    assert tokens_crowded["a"] == tokens_alone
    assert len(set(tokens_alone)) > 3  # it is really sampling, not stuck on one token
    other_seed = Sampler(VOCAB, torch.device("cpu"))
    other_seed.add_request("b", SamplingParams(temperature=1.0, top_p=0.95, seed=4321))
    assert _draw(other_seed, ["b"], logits, 30)["b"] != tokens_alone


def test_a_resumed_request_samples_on_exactly() -> None:
    """A request announced again with the tokens it already generated (the last stage was
    replaced) continues its seeded noise and its penalties as if nothing had happened."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, top_k=30, seed=77, presence_penalty=0.8, frequency_penalty=0.6)
    whole = Sampler(VOCAB, torch.device("cpu"))
    whole.add_request("r", params)
    tokens = _draw(whole, ["r"], logits, 40)["r"]
    resumed = Sampler(VOCAB, torch.device("cpu"))
    resumed.add_request("r", params, output_token_ids=tokens[:17])
    assert _draw(resumed, ["r"], logits, 23)["r"] == tokens[17:]
    resumed.clear()
    with pytest.raises(KeyError):
        resumed.sample(["r"], logits)


def test_sampling_follows_the_distribution() -> None:
    """The exponential-race draw samples from the filtered distribution (chi-square-free check:
    empirical frequencies within a few standard errors)."""
    params = SamplingParams(temperature=1.0, top_k=4, seed=5)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0] + [-1.0] * (VOCAB - 4)])
    sampler = Sampler(VOCAB, torch.device("cpu"))
    sampler.add_request("d", params)
    n = 4000
    counts = torch.zeros(VOCAB)
    for _ in range(n):
        counts[sampler.sample(["d"], logits)[0].token_id] += 1
    probs = filtered_probs(logits[0], params)
    assert counts[4:].sum() == 0  # top-k held
    stderr = torch.sqrt(probs * (1 - probs) / n)
    assert ((counts / n - probs).abs() <= 4 * stderr + 1e-9).all()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", 0, "max_tokens must be"),
        ("temperature", -0.1, "temperature must be"),
        ("temperature", float("nan"), "temperature must be"),
        ("top_k", -1, "top_k must be"),
        ("top_p", 0.0, "top_p must be"),
        ("top_p", 1.5, "top_p must be"),
        ("min_p", 1.5, "min_p must be"),
        ("presence_penalty", 3.0, "presence_penalty must be"),
        ("frequency_penalty", -2.5, "frequency_penalty must be"),
        ("repetition_penalty", 0.0, "repetition_penalty must be"),
        ("repetition_penalty", 2.5, "repetition_penalty must be"),
        ("repetition_penalty", float("inf"), "repetition_penalty must be"),
        ("temperature", float("inf"), "temperature must be"),
        ("seed", -1, "seed must be"),
        ("logprobs", 21, "logprobs must be"),
        ("stop_token_ids", (1, -2), "stop_token_ids must be"),
        # Values that pass a sign check but fit no wire integer (msgpack, int64, int32).
        ("top_k", 2**64, "top_k must be"),
        ("max_tokens", 2**31, "max_tokens must be"),
        ("seed", 2**63, "seed must be"),
        ("stop_token_ids", (2**40,), "stop_token_ids must be"),
    ],
)
def test_invalid_sampling_params(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})  # type: ignore[arg-type]
