"""Oracle tests for the sampler: transformers' logits warpers define top-k/top-p/temperature."""

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import moeserve.sampler as sampler_module
from moeserve.sampler import Sampler, make_generator, random_sample
from moeserve.sampling_params import SamplingParams

V = 257
NEG_INF = float("-inf")


def hf_process(logits_row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers in generate()'s order, for one row [V] -> [V]."""
    scores = logits_row.unsqueeze(0).float()
    if p.temperature != 1.0:
        scores = TemperatureLogitsWarper(p.temperature)(None, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    return scores.squeeze(0)


def assert_same_probs(ours: torch.Tensor, logits_row: torch.Tensor, p: SamplingParams) -> None:
    expected = hf_process(logits_row, p).softmax(-1)
    assert torch.equal(ours == 0, expected == 0), f"different survivors for {p}"
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)


@pytest.fixture
def logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(12, V, generator=g) * 3  # [B, V]


MIXED = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_k=40),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.5, top_p=0.3),
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.8),
    SamplingParams(temperature=2.0, top_k=V + 10, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=-1, top_p=0.5),
    SamplingParams(temperature=0.0, top_k=5),
    SamplingParams(temperature=0.8, top_k=1),
]


def test_probs_match_transformers_warpers_row_by_row(logits):
    probs = Sampler().probs(logits, MIXED)  # [B, V]
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    for i, p in enumerate(MIXED):
        if p.greedy:
            one_hot = torch.zeros(V)
            one_hot[logits[i].argmax()] = 1.0
            assert torch.equal(probs[i], one_hot)
        else:
            assert_same_probs(probs[i], logits[i], p)


@pytest.mark.parametrize("k", [1, 2, 7, 50, V - 1, V])
def test_top_k_only_fast_path(logits, k):
    params = [SamplingParams(top_k=k, temperature=1.5), SamplingParams(temperature=1.0)] * 6
    probs = Sampler().probs(logits, params)
    for i, p in enumerate(params):
        if not p.greedy:
            assert_same_probs(probs[i], logits[i], p)
    if k < V:
        assert int((probs[0] > 0).sum()) == k


@pytest.mark.parametrize("candidates", [3, 128, 10_000])
@pytest.mark.parametrize("top_p", [0.01, 0.25, 0.5, 0.9, 0.999])
def test_top_p_against_transformers(logits, top_p, candidates, monkeypatch):
    # Few candidates force the full-sort fallback; many make every row resolve early.
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", candidates)
    params = [SamplingParams(top_p=top_p)] * len(logits)
    probs = Sampler().probs(logits, params)
    for i, p in enumerate(params):
        assert_same_probs(probs[i], logits[i], p)


def test_top_k_keeps_ties_like_transformers():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    for params in ([SamplingParams(top_k=2)], [SamplingParams(top_k=2, top_p=0.99)]):
        probs = Sampler().probs(logits, params)
        assert_same_probs(probs[0], logits[0], params[0])
        assert int((probs[0] > 0).sum()) == 3


def test_masked_logits_stay_impossible(logits):
    # A grammar bitmask sets disallowed logits to -inf before sampling.
    masked = logits.clone()
    masked[:, ::2] = NEG_INF
    probs = Sampler().probs(masked, MIXED)
    assert torch.all(probs[:, ::2] == 0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(MIXED)))
    torch.manual_seed(1)
    tokens = Sampler().sample(masked.repeat(50, 1), MIXED * 50)
    assert torch.all(tokens % 2 == 1)


def test_random_sample_never_draws_zero_probability():
    probs = torch.tensor([[[0.0, 0.2, 0.0, 0.3, 0.0, 0.0]], [[1e-30, 0.0, 0.0, 0.0, 0.0, 0.0]]])  # [2, 1, 6]
    torch.manual_seed(0)
    draws = torch.cat([random_sample(probs, [None, None]) for _ in range(2000)], dim=1)  # [2, 2000]
    assert set(draws[0].tolist()) == {1, 3}
    assert set(draws[1].tolist()) == {0}


def test_three_d_logits_equal_position_by_position(logits):
    logits3 = logits.view(4, 3, V)  # [B, T, V]
    params = MIXED[:4]
    probs3 = Sampler().probs(logits3, params)
    assert probs3.shape == (4, 3, V)
    for t in range(3):
        torch.testing.assert_close(probs3[:, t], Sampler().probs(logits3[:, t], params))
    tokens = Sampler().sample(logits3, params, [make_generator(s) for s in range(4)])
    assert tokens.shape == (4, 3)


def test_all_greedy_is_argmax(logits):
    params = [SamplingParams(temperature=0.0)] * len(logits)
    assert torch.equal(Sampler().sample(logits, params), logits.argmax(-1))
    assert torch.equal(Sampler().sample(logits.bfloat16(), params), logits.bfloat16().argmax(-1))


def test_greedy_rows_in_a_mixed_batch_are_argmax(logits):
    tokens = Sampler().sample(logits, MIXED)
    for i, p in enumerate(MIXED):
        if p.greedy:
            assert tokens[i] == logits[i].argmax()


def test_low_precision_logits(logits):
    probs = Sampler().probs(logits.bfloat16(), MIXED)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(MIXED)))


def test_seeded_rows_ignore_the_rest_of_the_batch(logits):
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    target = logits[3:4]

    def run(batch_logits, params, row, steps=20):
        gens = [make_generator(q.seed) if q.seed is not None else None for q in params]
        return [int(Sampler().sample(batch_logits, params, gens)[row]) for _ in range(steps)]

    alone = run(target, [p], 0)
    crowded_params = [MIXED[0], MIXED[5], p, SamplingParams(seed=99), MIXED[10]]
    crowded_logits = torch.cat([logits[:2], target, logits[5:7]])
    torch.manual_seed(0)
    crowded = run(crowded_logits, crowded_params, 2)
    torch.manual_seed(12345)
    crowded_again = run(crowded_logits, crowded_params, 2)
    assert alone == crowded == crowded_again
    assert len(set(alone)) > 1  # it did sample, not argmax
    other_seed = run(target, [SamplingParams(temperature=1.0, top_p=0.95, seed=4321)], 0)
    assert other_seed != alone


def test_generators_must_match_rows(logits):
    with pytest.raises(ValueError, match="generators"):
        Sampler().sample(logits, MIXED, [None])
    with pytest.raises(ValueError, match="rows"):
        Sampler().sample(logits, MIXED[:3])
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        Sampler().sample(logits[0], MIXED[:1])


def _chi_square_p_value(tokens: torch.Tensor, expected_probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=expected_probs.numel()).double()
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "sampled a token with probability 0"
    expected = expected_probs[support].double()
    expected = expected / expected.sum() * len(tokens)  # chisquare wants equal totals
    return float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=6),
        SamplingParams(temperature=1.4, top_k=8, top_p=0.85),
    ],
)
def test_sampled_frequencies_follow_processed_distribution(params):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 12, generator=g) * 1.5  # [1, V]
    expected = Sampler().probs(logits, [params])[0]  # [V]
    n = 40_000
    torch.manual_seed(2024)
    tokens = Sampler().sample(logits.expand(n, -1), [params] * n)  # [n]
    assert _chi_square_p_value(tokens, expected) > 1e-3


def test_seeded_generators_follow_processed_distribution():
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=0)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 10, generator=g)
    expected = Sampler().probs(logits, [params])[0]
    n = 4_000
    gens = [make_generator(seed) for seed in range(n)]
    tokens = Sampler().sample(logits.expand(n, -1), [params] * n, gens)
    assert _chi_square_p_value(tokens, expected) > 1e-3


def test_logprobs_are_the_log_of_the_distribution_sample_draws_from():
    """Oracle: for sampled rows the logprobs are log(Sampler.probs) (what `sample` draws from);
    for greedy rows the model's log-softmax; alternatives best first, masked tokens left out."""
    import math

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    logits[2, 10:] = float("-inf")  # a grammar mask leaving 10 tokens
    params = [SamplingParams(temperature=0.7, top_k=8, top_p=0.9, logprobs=5),
              SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=1.3, logprobs=20)]
    sampler = Sampler()
    tokens = sampler.sample(logits, params).tolist()
    out = sampler.logprobs(logits, params, tokens)
    probs = sampler.probs(logits, params)
    assert math.isclose(out[0].logprob, math.log(probs[0, tokens[0]]), rel_tol=1e-5)
    assert math.isclose(out[1].logprob, float(logits[1].log_softmax(-1)[tokens[1]]), rel_tol=1e-5)
    assert out[1].top[0][0] == tokens[1] == int(logits[1].argmax())
    assert len(out[2].top) == 10 and all(t < 10 for t, _ in out[2].top)  # only what the mask allows
    for e, p in zip(out, params):
        values = [v for _, v in e.top]
        assert values == sorted(values, reverse=True) and len(e.top) <= p.logprobs
    assert sum(math.exp(v) for _, v in out[0].top) <= 1 + 1e-6
