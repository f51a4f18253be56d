"""Speculative-decoding metrics and the tokens-per-pass formula next to them."""

import random

import pytest
import torch

from moeserve.spec import SpecMetrics


def test_formula_prediction_alpha_08_k4() -> None:
    metrics = SpecMetrics()
    # Accepted 4 of 4, then rejected at the first: alpha = 4 / (4 + 1) = 0.8, mean k = 4.
    metrics.record([4, 4], [4, 0])
    assert metrics.alpha == pytest.approx(0.8)
    assert metrics.mean_k == pytest.approx(4.0)
    assert metrics.predicted_tokens_per_pass == pytest.approx(3.3616)
    assert metrics.tokens_per_pass == pytest.approx((5 + 1) / 2)
    assert metrics.acceptance_rate == pytest.approx(0.5)


def test_simulated_iid_acceptance_matches_formula() -> None:
    rng = random.Random(0)
    metrics = SpecMetrics()
    for _ in range(100):
        accepted = []
        for _ in range(200):
            n = 0
            while n < 4 and rng.random() < 0.8:
                n += 1
            accepted.append(n)
        metrics.record(torch.full((200,), 4), torch.tensor(accepted), draft_time_s=0.001, target_time_s=0.003)
    assert metrics.alpha == pytest.approx(0.8, abs=0.01)
    assert metrics.tokens_per_pass == pytest.approx(3.3616, abs=0.03)
    assert metrics.predicted_tokens_per_pass == pytest.approx(metrics.tokens_per_pass, abs=0.03)
    # The naive accepted / proposed rate is much lower: E[accepted] / k = 2.3616 / 4.
    assert metrics.acceptance_rate == pytest.approx(0.5904, abs=0.01)
    assert metrics.mean_accepted_length == pytest.approx(2.3616, abs=0.03)


def test_counters_times_and_dict() -> None:
    metrics = SpecMetrics()
    metrics.record(torch.tensor([3, 0, 2]), torch.tensor([1, 0, 2]), draft_time_s=1.0, target_time_s=2.0)
    metrics.record([2], [2], draft_time_s=0.0, target_time_s=1.0, num_emitted=[1])  # a stop token cut it short
    d = metrics.to_dict()
    assert d["num_steps"] == 2
    assert d["num_seq_passes"] == 4
    assert d["num_draft_tokens"] == 7
    assert d["num_accepted_tokens"] == 5
    assert d["num_rejections"] == 1
    assert d["num_emitted_tokens"] == 2 + 1 + 3 + 1
    assert d["draft_time_share"] == pytest.approx(0.25)
    assert d["mean_k"] == pytest.approx(7 / 4)
    assert d["mean_accepted_length"] == pytest.approx(5 / 4)
    assert d["tokens_per_pass"] == pytest.approx(7 / 4)
    assert d["alpha"] == pytest.approx(5 / 6)
    assert set(d) >= {"acceptance_rate", "predicted_tokens_per_pass"}


def test_empty_metrics_are_zero() -> None:
    d = SpecMetrics().to_dict()
    assert all(v == 0 for v in d.values())


def test_bad_records_are_rejected() -> None:
    metrics = SpecMetrics()
    with pytest.raises(ValueError):
        metrics.record([2], [3])
    with pytest.raises(ValueError):
        metrics.record([2, 2], [1])
    with pytest.raises(ValueError):
        metrics.record([2], [1], draft_time_s=-1.0)
