"""Measured step times -> the cost model adaptive k optimises."""

from __future__ import annotations

import pytest

from moeserve.spec import AdaptiveK, AdaptiveKConfig, CostModel, StepCostMeter
from moeserve.spec.policy import PRIOR_COSTS


def _record(meter: StepCostMeter, truth: CostModel, rows: int, width: int) -> None:
    per_seq_target = truth.target_base_s + truth.target_per_token_s * (width + 1)
    per_seq_draft = truth.draft_base_s + truth.draft_per_token_s * width if width else 0.0
    meter.record(rows, width, per_seq_draft * rows, per_seq_target * rows)


def test_fit_recovers_linear_costs():
    truth = CostModel(target_base_s=4e-3, target_per_token_s=3e-4, draft_per_token_s=4e-4, draft_base_s=1e-3)
    meter = StepCostMeter()
    for i in range(40):
        _record(meter, truth, rows=2 + i % 2, width=i % 6)  # rows 2-3: one bucket
    fit = meter.fit(PRIOR_COSTS, num_rows=2)
    for name in ("target_base_s", "target_per_token_s", "draft_per_token_s", "draft_base_s"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-9)


def test_one_width_only_keeps_the_target_slope_and_counts_drafting_per_token():
    meter = StepCostMeter()
    for _ in range(10):
        meter.record(2, 4, draft_s=2 * 5e-3, target_s=2 * 6e-3)
    fit = meter.fit(PRIOR_COSTS, num_rows=2)
    assert fit.target_per_token_s == PRIOR_COSTS.target_per_token_s
    assert fit.target_base_s + 5 * fit.target_per_token_s == pytest.approx(6e-3)
    assert (fit.draft_base_s, fit.draft_per_token_s) == (0.0, pytest.approx(5e-3 / 4))
    # a prior whose draft slope is 0 (k = 8 free) does not survive a fit at one width
    free = CostModel(target_base_s=1e-3, target_per_token_s=1e-4, draft_per_token_s=0.0, draft_base_s=1e-3)
    assert meter.fit(free, num_rows=2).draft_per_token_s == pytest.approx(5e-3 / 4)
    assert StepCostMeter().fit(PRIOR_COSTS, num_rows=2) == PRIOR_COSTS  # nothing measured: the prior


def test_a_remote_draft_hop_makes_adaptive_k_stop_drafting():
    """A 15 ms call per step to a draft deployment outweighs 3.4 tokens per pass at a 4 ms step."""
    meter = StepCostMeter()
    slow = CostModel(target_base_s=4e-3, target_per_token_s=2e-4, draft_per_token_s=5e-4, draft_base_s=15e-3)
    for i in range(32):
        _record(meter, slow, rows=1, width=i % 5)
    adaptive = AdaptiveK(AdaptiveKConfig(k_max=8, probe_every=16), meter.fit(PRIOR_COSTS, num_rows=1))
    assert adaptive.best_batch_k([0.8]) == 0
    ks = [adaptive.choose_batch(["s"])[0] for _ in range(50)]  # plain steps, a one-token probe every 16
    assert [i for i, k in enumerate(ks) if k] == [15, 31, 47] and max(ks) == 1
    fast = StepCostMeter()
    for i in range(32):
        _record(fast, CostModel(4e-3, 2e-4, 4e-4, 2e-4), rows=1, width=i % 5)
    assert AdaptiveK(AdaptiveKConfig(k_max=8), fast.fit(PRIOR_COSTS, num_rows=1)).best_batch_k([0.8]) >= 3


def test_validation():
    with pytest.raises(ValueError):
        CostModel(1e-3, 0.0, 0.0, draft_base_s=-1.0)


def test_each_batch_size_bucket_is_fitted_on_its_own_steps():
    """One row: a pass is mostly fixed cost; 32 rows: mostly per-position. Each bucket's fit
    recovers its own line."""
    alone = CostModel(target_base_s=4e-3, target_per_token_s=1e-4, draft_per_token_s=1e-3, draft_base_s=2e-4)
    busy = CostModel(target_base_s=2e-4, target_per_token_s=5e-4, draft_per_token_s=2e-4, draft_base_s=1e-5)
    meter = StepCostMeter()
    for i in range(60):
        _record(meter, alone, rows=1, width=i % 5)
        _record(meter, busy, rows=32 + i % 8, width=i % 3)
    assert meter.num_recorded_at(1) == 60 and meter.num_recorded_at(39) == 60 and meter.num_recorded_at(8) == 0
    for rows, truth in ((1, alone), (35, busy)):
        fit = meter.fit(PRIOR_COSTS, num_rows=rows)
        for name in ("target_base_s", "target_per_token_s", "draft_per_token_s", "draft_base_s"):
            assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-9)
    assert meter.fit(PRIOR_COSTS, num_rows=8) == PRIOR_COSTS  # a bucket never measured: the prior
