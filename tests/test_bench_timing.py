"""The benches' interleaved timing: per-round ratios, their median and its bootstrap interval."""

import pytest

from bench.timing import Run, paired_ratio, ratio_interval, summarize


def runs_with_ratios(ratios: list[float]) -> dict[str, list[Run]]:
    """Two cases whose round-by-round tokens/s ratios (a / b) are `ratios`."""
    return {"b": [Run(100, 1.0, {}) for _ in ratios], "a": [Run(round(100 * r), 1.0, {}) for r in ratios]}


def test_equal_ratios_have_a_point_interval():
    runs = runs_with_ratios([0.9] * 7)
    assert paired_ratio(runs, "a", "b") == pytest.approx(0.9)
    assert ratio_interval(runs, "a", "b") == pytest.approx((0.9, 0.9))


def test_the_interval_holds_the_median_and_widens_with_the_spread():
    tight = runs_with_ratios([0.95, 0.96, 0.97, 0.97, 0.98, 0.99, 1.00])
    loose = runs_with_ratios([0.80, 0.88, 0.94, 0.97, 1.01, 1.08, 1.15])
    lo_t, hi_t = ratio_interval(tight, "a", "b")
    lo_l, hi_l = ratio_interval(loose, "a", "b")
    assert 0.95 <= lo_t <= 0.97 <= hi_t <= 1.00
    assert 0.80 <= lo_l <= 0.97 <= hi_l <= 1.15
    assert hi_l - lo_l > 2 * (hi_t - lo_t)
    assert ratio_interval(loose, "a", "b") == (lo_l, hi_l)  # seeded: the same rounds give the same interval


def test_a_clear_loss_lies_wholly_below_the_bar():
    lo, hi = ratio_interval(runs_with_ratios([0.85, 0.88, 0.90, 0.91, 0.92, 0.93, 0.95]), "a", "b")
    assert hi < 0.97


def test_summarize_reports_the_interval_against_the_baseline_only():
    summary = summarize(runs_with_ratios([0.9, 1.0, 1.1]), "b")
    assert summary["a"]["median_ratio"] == pytest.approx(1.0)
    lo, hi = summary["a"]["ratio_interval"]
    assert 0.9 <= lo <= 1.0 <= hi <= 1.1
    assert "ratio_interval" not in summary["b"]


def test_the_level_must_be_a_fraction():
    with pytest.raises(ValueError, match="level"):
        ratio_interval(runs_with_ratios([1.0]), "a", "b", level=1.0)
