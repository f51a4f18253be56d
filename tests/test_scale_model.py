"""The expert-parallel cost model (bench/scale_model.py): parameter counts against the published
ones and against our own model, the all-to-all term against DeepEP's published latencies, the
layout search and skew arithmetic on cases whose answer is known, and the checks table
(bench/scale_checks.py): the fit is never counted, misses are called misses, each served check
runs its source's setup, and docs/scaling.md and the README say what the table says."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.scale_model import HARDWARE, Layout, Shape, a2a_ms, best_layout, load_shape, main, skew_from_stats, step


@pytest.mark.parametrize("name, total_b, active_b", [
    ("mixtral-8x7b", 46.7, 12.9),  # Mistral's model card
    ("qwen3-30b-a3b", 30.5, 3.3),  # Qwen's model card
    ("deepseek-v3", 671.0, 37.0),  # DeepSeek-V3 report (main model, without the MTP module)
])
def test_parameter_counts_match_the_published_ones(name, total_b, active_b):
    s = load_shape(name)
    assert s.total_params / 1e9 == pytest.approx(total_b, rel=0.02)
    active = s.total_params - s.moe_layers * (s.experts - s.top_k) * s.expert_params
    assert active / 1e9 == pytest.approx(active_b, rel=0.06)


def test_the_shape_counts_what_our_model_holds():
    from model_shards import load_checkpoint
    from moeserve.engine.factory import demo_checkpoint

    path = demo_checkpoint("demo-moe")
    s = Shape.from_hf(json.loads((__import__("pathlib").Path(path) / "config.json").read_text()))
    model = load_checkpoint(path)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert s.total_params == sum(p.numel() for p in model.parameters()) - norms


def test_the_all_to_all_term_is_within_30_percent_of_deepep():
    from bench.scale_checks import DEEPEP_LOW_LATENCY

    h800 = HARDWARE["h800"]
    assert a2a_ms(h800, 1 << 20, 1) == 0.0  # nothing leaves a single rank
    for ep, (dispatch_us, combine_us) in DEEPEP_LOW_LATENCY.items():
        sent = 128 * 8 * 7168
        assert a2a_ms(h800, sent, ep) * 1e3 == pytest.approx(dispatch_us, rel=0.3)
        assert a2a_ms(h800, 2 * sent, ep) * 1e3 == pytest.approx(combine_us, rel=0.3)


def test_batch_one_on_one_gpu_is_bound_by_the_active_weights():
    """Mixtral, one token: each layer reads its dense part and two experts; the step cannot beat
    those bytes over the achievable bandwidth, and the model says about that much."""
    s, hw = load_shape("mixtral-8x7b"), HARDWARE["h200"]
    r = step(s, hw, Layout(gpus=1, batch=1, context=1))
    assert r["experts_touched_per_layer"] == pytest.approx(2 * (1 - 2.718281828 ** -0.25) * 4, rel=1e-3)
    active = s.total_params - s.moe_layers * (s.experts - r["experts_touched_per_layer"]) * s.expert_params
    floor_ms = (active - s.vocab * s.hidden) * 2 / (hw.hbm_gbps * 1e9 * hw.hbm_eff) * 1e3
    assert floor_ms <= r["step_ms"] <= 1.1 * floor_ms
    assert r["ms"]["dispatch"] == r["ms"]["combine"] == 0.0


def test_more_ranks_cut_expert_reads_and_add_all_to_all():
    s, hw = load_shape("mixtral-8x7b"), HARDWARE["h200"]
    one, eight = step(s, hw, Layout(gpus=1, batch=64)), step(s, hw, Layout(gpus=8, batch=64))
    assert eight["ms"]["experts"] < one["ms"]["experts"]
    assert eight["ms"]["dispatch"] > 0 and eight["a2a_bytes_per_layer"] == 64 * 2 * 4096 * 4
    assert eight["memory_gib"]["weights"] < one["memory_gib"]["weights"] / 3
    skewed = step(s, hw, Layout(gpus=8, batch=64, skew=1.5))
    assert skewed["ms"]["experts"] > eight["ms"]["experts"] and skewed["ms"]["attention"] == eight["ms"]["attention"]


def test_best_layout_meets_its_target_and_fits():
    s, hw = load_shape("deepseek-v3"), HARDWARE["h200"]
    base = Layout(context=2048, weight_bytes=1, dispatch_bytes=1, overlap=True)
    lay, r = best_layout(s, hw, base, max_tpot_ms=50.0)
    assert r["step_ms"] <= 50.0
    assert r["memory_gib"]["weights"] + r["memory_gib"]["kv"] <= hw.mem_gib * 0.9
    assert lay.gpus >= 8  # 671 B parameters in fp8 do not fit fewer H200s
    assert best_layout(s, hw, replace(base, context=2048), max_tpot_ms=0.01) is None
    fast, r1 = best_layout(s, hw, replace(base, batch=1), None, objective="latency")
    assert all(step(s, hw, replace(fast, gpus=g))["step_ms"] >= r1["step_ms"] for g in (8, 16, 32, 64, 128, 256))


def test_skew_from_expert_counters():
    uniform = {"route_counts": [[10] * 8, [7] * 8]}
    assert skew_from_stats(uniform, 4) == pytest.approx({"contiguous": 1.0, "eplb": 1.0})
    hot = {"route_counts": [[100, 100, 1, 1, 1, 1, 1, 1]]}  # both hot experts on rank 0 when contiguous
    skews = skew_from_stats(hot, 4)
    assert skews["contiguous"] > 3.0 and skews["eplb"] < skews["contiguous"]
    served = {"sources": ["engine-0"], "layers": [], "counters": hot, "placement": {}}  # GET /admin/experts
    assert skew_from_stats(served, 4) == skews
    with pytest.raises(ValueError, match="empty"):
        skew_from_stats({"route_counts": [[0] * 8]}, 2)


def test_the_command_line(capsys):
    assert main(["--model", "qwen3-30b-a3b", "--hardware", "h100", "--gpus", "4", "--batch", "32"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b" in out and "tokens/s per GPU" in out
    assert main(["--model", "deepseek-v3", "--hardware", "h200", "--fp8", "--overlap", "--best",
                 "--max-tpot-ms", "60"]) == 0
    assert "best:" in capsys.readouterr().out
    assert main(["--model", "mixtral-8x7b", "--best", "latency", "--batch", "1"]) == 0


def test_two_batch_overlap_loses_at_small_batches_and_wins_at_large():
    """SGLang's ablation on DeepSeek-V3 (72 H100s): overlap loses at 32 sequences per GPU and
    gains at 256, because each half-batch reads the weights and pays the all-to-all latency again."""
    s, hw = load_shape("deepseek-v3"), HARDWARE["h100"]
    base = Layout(gpus=72, context=2000, weight_bytes=1, dispatch_bytes=1, redundant_experts=32)

    def gain(lay: Layout) -> float:
        return step(s, hw, lay)["step_ms"] / step(s, hw, replace(lay, overlap=True))["step_ms"]

    assert gain(replace(base, batch=32)) < 1.0 < gain(replace(base, batch=256))
    assert gain(replace(base, gpus=1, batch=256)) < 1.0  # one rank: nothing to hide, a second weight read


def test_attention_scores_run_at_the_cache_precision():
    """fp8 weights and a bf16 KV cache: the projections get the fp8 rate, q.k and p.v do not."""
    s = load_shape("deepseek-v3")
    hw = replace(HARDWARE["h100"], hbm_gbps=1e9)  # no memory limit: attention is its FLOPs
    lay = Layout(gpus=8, batch=64, context=4096, weight_bytes=1, kv_bytes=2)
    rate = hw.tflops * 1e12 * hw.flop_eff
    proj, scores = 2 * 64 * s.layers * s.attn_params, 64 * s.layers * s.attn_flops_per_key * 4096
    want = (proj / (rate * hw.fp8_speedup) + scores / rate) * 1e3
    assert step(s, hw, lay)["ms"]["attention"] == pytest.approx(want, rel=1e-6)
    assert step(s, hw, replace(lay, kv_bytes=1))["ms"]["attention"] < want


def test_the_fitted_point_is_shown_but_never_counted():
    from bench.scale_checks import Check, checks
    from bench.scale_report import verdict

    rows = checks()
    fitted = [c for c in rows if c.fitted]
    assert [c.name.split(":")[0] for c in fitted] == ["this CPU, demo MoE, W=1, batch 16"]
    assert fitted[0].verdict == "fit (not a check)"
    assert f"of {len(rows) - 1} checks" in verdict(rows)
    way_off_fit = Check("fit", 3.0, 1.0, "s", fitted=True)
    assert way_off_fit.verdict == "fit (not a check)"
    assert verdict([way_off_fit, Check("a", 1.1, 1.0, "s")]).startswith("**1 of 1 checks are within 20%**")


def test_a_check_beyond_the_tolerance_is_a_miss():
    from bench.scale_checks import TOLERANCE, Check
    from bench.scale_report import verdict

    assert Check("a", 1 + TOLERANCE - 0.01, 1.0, "s").verdict == f"within {TOLERANCE:.0%}"
    assert Check("a", 1 - TOLERANCE + 0.01, 1.0, "s").verdict == f"within {TOLERANCE:.0%}"
    high, low = Check("high", 1 + TOLERANCE + 0.01, 1.0, "s"), Check("low", 1 - TOLERANCE - 0.01, 1.0, "s")
    assert high.verdict == low.verdict == "miss"
    text = verdict([high, low, Check("ok", 1.0, 1.0, "s")])
    assert "**1 of 3 checks are within 20%**" in text and "**2 miss**: high (+21%); low (-21%)" in text


def test_each_served_check_runs_its_sources_setup():
    """SGLang's headline DeepSeek-V3 figure (22,282 tok/s per node on 72 H100s) was measured with
    two-batch overlap, its ablation's without; Ray Serve's wide-EP config enables none."""
    from bench.scale_checks import served

    (tbo_name, tbo_hw, tbo, tbo_pub), (_, _, flat, flat_pub), (_, wide_hw, wide, _) = served()
    assert "two-batch overlap" in tbo_name and tbo_hw.name == "H100 SXM"
    assert tbo.overlap and (tbo.gpus, tbo.batch, tbo.context, tbo.redundant_experts) == (72, 256, 2000, 32)
    assert tbo.weight_bytes == tbo.dispatch_bytes == 1 and tbo_pub["tokens_per_s_per_gpu"] == 22282 / 8
    assert not flat.overlap and replace(flat, overlap=True) == tbo
    assert flat_pub["tokens_per_s_per_gpu"] == pytest.approx(22310 / 1.255 / 8)
    assert not wide.overlap and wide.gpus == 16 and wide_hw.name == "H200 SXM"


def test_the_docs_and_the_readme_say_what_the_checks_say():
    """docs/scaling.md holds the table the generator makes from the committed reports, and the
    README's paragraph quotes every counted CPU and served error and DeepEP's worst."""
    from bench.scale_checks import checks
    from bench.scale_report import checks_table, verdict

    root = Path(__file__).resolve().parent.parent
    rows = checks()
    doc = (root / "docs" / "scaling.md").read_text()
    assert checks_table(rows) in doc and verdict(rows) in doc, "run: python -m bench.scale_model --report"
    readme = (root / "README.md").read_text()
    paragraph = readme[readme.index("How this scales past one machine"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    for c in rows:
        if not c.fitted and not c.name.startswith("DeepEP"):
            assert f"{c.error:+.0%}" in paragraph, c.name
    worst = max(abs(c.error) for c in rows if c.name.startswith("DeepEP"))
    assert f"at most {worst:.0%} off" in paragraph
    assert "fitted at one rank, which is not a check" in paragraph
