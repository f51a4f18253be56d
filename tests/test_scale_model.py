"""The expert-parallel cost model (bench/scale_model.py): parameter counts against the published
ones and against our own model, the all-to-all term against DeepEP's published latencies, and
the layout search and skew arithmetic on cases whose answer is known."""

from __future__ import annotations

import json
from dataclasses import replace

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
    overlapped = step(s, hw, Layout(gpus=8, batch=64, overlap=True))
    assert overlapped["step_ms"] < eight["step_ms"]
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
