"""topk_gate against the seeds' worked numbers and against transformers' own router modules.

Shapes: T tokens, E experts, K = top_k, D hidden.
"""

import pytest
import torch

from router_service import GateConfig, topk_gate

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter  # noqa: E402
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter  # noqa: E402
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter  # noqa: E402

E, D, T = 8, 16, 64


def test_seed_mawa_top2_of_4():
    # seeds: scores 2.0, 0.5, 1.5, -1.0, top-2 -> experts 1 and 3 (0-based 0, 2), gates 0.622 / 0.378
    logits = torch.tensor([[2.0, 0.5, 1.5, -1.0]])
    gates = topk_gate(logits, GateConfig(num_experts=4, top_k=2))
    assert gates.expert_ids.tolist() == [[0, 2]]
    assert gates.weights[0].tolist() == pytest.approx([0.622, 0.378], abs=5e-4)
    # "softmax over all experts, giving 0.532 and 0.323, and then renormalise: the same result"
    raw = topk_gate(logits, GateConfig(num_experts=4, top_k=2, style="softmax_topk", norm_topk_prob=False))
    assert raw.weights[0].tolist() == pytest.approx([0.532, 0.323], abs=5e-4)
    normed = topk_gate(logits, GateConfig(num_experts=4, top_k=2, style="softmax_topk"))
    torch.testing.assert_close(normed.weights, gates.weights, rtol=0, atol=1e-7)


def test_seed_dense_vs_sparse_example():
    # seeds: logits [2.0, 1.0, 0.1, -1.0]: softmax over all [0.64, 0.24, 0.10, 0.03]; top-2 [0.73, 0.27].
    # The seed's 0.24 is a rounding slip: exp(1) / sum = 0.2347 (0.23); the other three round as printed.
    logits = torch.tensor([[2.0, 1.0, 0.1, -1.0]])
    gates = topk_gate(logits, GateConfig(num_experts=4, top_k=2))
    assert gates.probs[0].tolist() == pytest.approx([0.6381, 0.2347, 0.0954, 0.0318], abs=1e-4)
    assert gates.weights[0].tolist() == pytest.approx([0.73, 0.27], abs=5e-3)
    assert gates.expert_ids.tolist() == [[0, 1]]


def _router(cls, config, dtype=torch.float32):
    torch.manual_seed(0)
    router = cls(config).to(dtype)
    with torch.no_grad():
        router.weight.normal_()
    return router


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_mixtral_matches_transformers(k):
    router = _router(
        MixtralTopKRouter, transformers.MixtralConfig(hidden_size=D, num_local_experts=E, num_experts_per_tok=k)
    )
    hidden = torch.randn(T, D)  # [T, D]
    logits, scores, indices = router(hidden)
    gates = topk_gate(logits, GateConfig(num_experts=E, top_k=k, style="mixtral"))
    assert torch.equal(gates.expert_ids, indices)
    torch.testing.assert_close(gates.weights, scores, rtol=0, atol=1e-6)
    assert gates.weights.dtype == torch.float32
    torch.testing.assert_close(gates.probs, torch.softmax(logits, -1), rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    "cls,config_cls",
    [
        (Qwen2MoeTopKRouter, transformers.Qwen2MoeConfig),
        (Qwen3MoeTopKRouter, transformers.Qwen3MoeConfig),
        (OlmoeTopKRouter, transformers.OlmoeConfig),
    ],
)
@pytest.mark.parametrize("k,norm", [(1, False), (2, True), (2, False), (4, True), (8, False)])
def test_softmax_topk_matches_transformers(cls, config_cls, k, norm):
    config = config_cls(hidden_size=D, num_experts=E, num_experts_per_tok=k, norm_topk_prob=norm)
    router = _router(cls, config)
    logits, scores, indices = router(torch.randn(T, D))
    gates = topk_gate(logits, GateConfig(num_experts=E, top_k=k, style="softmax_topk", norm_topk_prob=norm))
    assert torch.equal(gates.expert_ids, indices)
    torch.testing.assert_close(gates.weights, scores, rtol=0, atol=1e-6)


def test_bf16_dtypes_follow_transformers():
    # Mixtral keeps fp32 gate weights; Qwen/OLMoE cast back to the activation dtype.
    hidden = torch.randn(T, D).bfloat16()
    mixtral = _router(MixtralTopKRouter, transformers.MixtralConfig(hidden_size=D, num_local_experts=E), torch.bfloat16)
    logits, scores, indices = mixtral(hidden)
    gates = topk_gate(logits, GateConfig(num_experts=E, top_k=2))
    assert gates.weights.dtype == scores.dtype == torch.float32
    assert torch.equal(gates.weights, scores) and torch.equal(gates.expert_ids, indices)

    qwen = _router(Qwen2MoeTopKRouter, transformers.Qwen2MoeConfig(hidden_size=D, num_experts=E), torch.bfloat16)
    logits, scores, indices = qwen(hidden)
    gates = topk_gate(logits, GateConfig(num_experts=E, top_k=qwen.top_k, style="softmax_topk", norm_topk_prob=False))
    assert gates.weights.dtype == scores.dtype == torch.bfloat16
    assert torch.equal(gates.weights, scores) and torch.equal(gates.expert_ids, indices)
    assert gates.probs.dtype == torch.float32


@pytest.mark.parametrize(
    "k,n_group,topk_group,norm,scale",
    [(1, 1, 1, True, 1.0), (2, 1, 1, True, 2.5), (3, 4, 2, True, 2.5), (2, 2, 1, False, 1.0), (8, 1, 1, True, 1.0)],
)
def test_sigmoid_bias_matches_deepseek_v3(k, n_group, topk_group, norm, scale):
    config = transformers.DeepseekV3Config(
        hidden_size=D,
        n_routed_experts=E,
        num_experts_per_tok=k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )
    router = _router(DeepseekV3TopkRouter, config)
    bias = torch.randn(E) * 0.5  # [E] large enough to change the choice for many tokens
    router.e_score_correction_bias.copy_(bias)
    logits, weights, indices = router(torch.randn(T, D))
    cfg = GateConfig(E, k, "sigmoid_bias", norm, scale, n_group, topk_group)
    gates = topk_gate(logits, cfg, bias=bias)
    # DeepSeek returns its top-k unsorted; ours is sorted by the biased score: compare as sets.
    choice = logits.sigmoid() + bias  # [T, E]
    resort = choice.gather(1, indices).argsort(dim=1, descending=True)  # [T, K]
    assert torch.equal(gates.expert_ids, indices.gather(1, resort))
    torch.testing.assert_close(gates.weights, weights.gather(1, resort), rtol=0, atol=1e-6)
    torch.testing.assert_close(gates.probs, logits.sigmoid(), rtol=0, atol=0)
    # the bias changes which experts are chosen, never the weights' source
    unbiased = topk_gate(logits, cfg)
    assert not torch.equal(unbiased.expert_ids, gates.expert_ids) or k == E
    torch.testing.assert_close(gates.weights, _unbiased_weights(logits, gates.expert_ids, norm, scale))


def _unbiased_weights(logits, ids, norm, scale):
    w = logits.sigmoid().gather(1, ids)  # [T, K]
    return (w / w.sum(-1, keepdim=True) if norm else w) * scale


def test_sorted_descending_and_leading_dims_flattened():
    logits = torch.randn(2, 5, E)  # [B, S, E] -> T = 10
    gates = topk_gate(logits, GateConfig(num_experts=E, top_k=3))
    assert gates.expert_ids.shape == (10, 3) and gates.probs.shape == (10, E)
    chosen = gates.probs.gather(1, gates.expert_ids)  # [T, K]
    assert bool((chosen[:, :-1] >= chosen[:, 1:]).all())
    torch.testing.assert_close(gates.weights.sum(-1), torch.ones(10))


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"num_experts": 0, "top_k": 1}, "num_experts"),
        ({"num_experts": 4, "top_k": 5}, "top_k"),
        ({"num_experts": 4, "top_k": 0}, "top_k"),
        ({"num_experts": 4, "top_k": 2, "style": "topk"}, "style"),
        ({"num_experts": 4, "top_k": 2, "norm_topk_prob": False}, "norm_topk_prob"),
        ({"num_experts": 4, "top_k": 2, "routed_scaling_factor": 0.0}, "routed_scaling_factor"),
        ({"num_experts": 6, "top_k": 2, "style": "sigmoid_bias", "n_group": 4}, "n_group"),
        ({"num_experts": 8, "top_k": 2, "n_group": 2}, "n_group"),
        ({"num_experts": 8, "top_k": 2, "style": "sigmoid_bias", "n_group": 2, "topk_group": 3}, "topk_group"),
        ({"num_experts": 8, "top_k": 5, "style": "sigmoid_bias", "n_group": 4, "topk_group": 2}, "top_k"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GateConfig(**kwargs)


def test_bad_inputs_rejected():
    with pytest.raises(ValueError, match="num_experts"):
        topk_gate(torch.randn(3, 5), GateConfig(num_experts=4, top_k=2))
    with pytest.raises(ValueError, match="bias"):
        topk_gate(torch.randn(3, 4), GateConfig(num_experts=4, top_k=2), bias=torch.zeros(4))
    with pytest.raises(ValueError, match="bias"):
        topk_gate(torch.randn(3, 4), GateConfig(num_experts=4, top_k=2, style="sigmoid_bias"), bias=torch.zeros(3))
