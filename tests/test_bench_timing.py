"""The benches' interleaved timing and their one ratio helper: per-round ratios, their median
and its bootstrap interval, and how every report writes them."""

import json
import statistics

import pytest

from bench import report
from bench.timing import Ratio, Run, format_ratio, paired, ratio_over_rounds, summarize


def runs_with_ratios(ratios: list[float]) -> dict[str, list[Run]]:
    """Two cases whose round-by-round tokens/s ratios (a / b) are `ratios`."""
    return {"b": [Run(100, 1.0, {}) for _ in ratios], "a": [Run(round(100 * r), 1.0, {}) for r in ratios]}


SPREAD = [0.80, 0.88, 0.94, 0.97, 1.01, 1.08, 1.15]


def test_a_constant_ratio_has_a_zero_width_interval():
    r = ratio_over_rounds([3.4 * b for b in (5.0, 7.0, 2.0, 9.0, 4.0)], [5.0, 7.0, 2.0, 9.0, 4.0])
    assert (r.median, r.low, r.high, r.rounds) == pytest.approx((3.4, 3.4, 3.4, 5))
    assert format_ratio(r) == "3.40x [3.40, 3.40]"


def test_the_median_is_of_per_round_ratios_not_of_rates():
    # rounds of different speed: the median of the per-round ratios is 2, the medians' ratio 2.4
    a, b = [10.0, 4.0, 2.0, 8.0], [3.0, 2.0, 1.0, 5.0]  # per round: 3.33, 2, 2, 1.6
    assert ratio_over_rounds(a, b).median == pytest.approx(2.0)
    assert statistics.median(a) / statistics.median(b) == pytest.approx(2.4)


def test_the_interval_holds_the_median_and_is_seeded():
    rates = [100 * x for x in SPREAD]
    r = ratio_over_rounds(rates, [100.0] * len(rates), seed=3)
    assert min(SPREAD) <= r.low <= r.median <= r.high <= max(SPREAD)
    assert r.low < r.median < r.high
    assert ratio_over_rounds(rates, [100.0] * len(rates), seed=3) == r  # the same rounds, the same interval
    assert r.level == 0.9 and r.rounds == len(SPREAD)


def test_the_interval_widens_with_the_spread():
    tight = runs_with_ratios([0.95, 0.96, 0.97, 0.97, 0.98, 0.99, 1.00])
    t, wide = paired(tight, "a", "b"), paired(runs_with_ratios(SPREAD), "a", "b")
    lo_t, hi_t, lo_l, hi_l = t.low, t.high, wide.low, wide.high
    assert 0.95 <= lo_t <= 0.97 <= hi_t <= 1.00
    assert 0.80 <= lo_l <= 0.97 <= hi_l <= 1.15
    assert hi_l - lo_l > 2 * (hi_t - lo_t)


def test_a_clear_loss_lies_wholly_below_the_bar():
    r = paired(runs_with_ratios([0.85, 0.88, 0.90, 0.91, 0.92, 0.93, 0.95]), "a", "b")
    assert r.high < 0.97


def test_mismatched_or_missing_rounds_are_refused():
    with pytest.raises(ValueError, match="rounds"):
        ratio_over_rounds([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="rounds"):
        paired({"a": [Run(1, 1.0, {})] * 3, "b": [Run(1, 1.0, {})] * 2}, "a", "b")
    with pytest.raises(ValueError, match="round"):
        ratio_over_rounds([], [])
    with pytest.raises(ValueError, match="level"):
        ratio_over_rounds([1.0], [1.0], level=1.0)


def test_the_format_gives_median_and_interval():
    assert format_ratio(Ratio(3.4, 3.1, 3.7, 7)) == "3.40x [3.10, 3.70]"
    assert str(Ratio(0.912, 0.871, 0.95, 9)) == "0.91x [0.87, 0.95]"
    assert format_ratio(Ratio(1.5, 1.5, 1.5, 1)) == "1.50x [1 round: no interval]"
    assert "3.40x [3.10, 3.70]" in report.markdown_table(["ratio"], [[Ratio(3.4, 3.1, 3.7, 7)]])


def test_a_report_writes_a_ratio_with_its_interval(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "REPORTS", tmp_path)
    r = ratio_over_rounds([2.0, 3.0, 4.0], [1.0, 1.0, 1.0])
    report.write("t", {"ratios": {"x": r}, "rate": 1.5}, "# t")
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["ratios"]["x"] == {"median": 3.0, "low": r.low, "high": r.high, "rounds": 3, "level": 0.9}
    assert data["rate"] == 1.5


def test_summarize_reports_the_ratio_against_the_baseline_only():
    summary = summarize(runs_with_ratios([0.9, 1.0, 1.1]), "b")
    ratio = summary["a"]["ratio"]
    assert ratio.median == pytest.approx(1.0)
    assert paired(runs_with_ratios([0.9, 1.0, 1.1]), "a", "b") == ratio
    assert 0.9 <= ratio.low <= 1.0 <= ratio.high <= 1.1
    assert "ratio" not in summary["b"]


def test_stream_interval_pairs_each_setting_with_the_first_round_by_round():
    from bench.stream_interval import per_round, ratios_to_first

    # round 1 is slow for every setting (a busy machine): pairing within rounds cancels it out
    base = [{"round": r, "tokens_per_s": v} for r, v in ((0, 100.0), (0, 110.0), (1, 50.0), (1, 50.0), (2, 90.0))]
    other = [w | {"tokens_per_s": 1.2 * w["tokens_per_s"]} for w in base]
    rates = {"first": per_round(base, 3), "other": per_round(other, 3)}
    assert rates["first"] == pytest.approx([105.0, 50.0, 90.0])
    ratios = ratios_to_first(rates)
    assert list(ratios) == ["other"]
    assert (ratios["other"].median, ratios["other"].low, ratios["other"].high) == pytest.approx((1.2, 1.2, 1.2))
    assert ratios["other"].rounds == 3
