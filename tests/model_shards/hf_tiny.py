"""Tiny random Hugging Face models of every supported family, saved to a folder (test helper)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T
from safetensors.torch import load_file, save_file

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6)


def tiny_config(family: str) -> T.PretrainedConfig:
    if family == "mixtral":
        return T.MixtralConfig(**COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    if family == "qwen2_moe":
        return T.Qwen2MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=16,
                                shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                mlp_only_layers=[1], norm_topk_prob=False)
    if family == "qwen3_moe":
        return T.Qwen3MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=16, num_experts=6,
                                num_experts_per_tok=3, head_dim=8, norm_topk_prob=True)
    if family == "olmoe":
        return T.OlmoeConfig(**COMMON, intermediate_size=16, num_experts=4, num_experts_per_tok=2, clip_qkv=3.0)
    if family == "deepseek_v3":  # a dense first layer, 2 of 4 expert groups, a selection bias, YaRN
        return T.DeepseekV3Config(**COMMON | dict(num_key_value_heads=4, num_hidden_layers=3), intermediate_size=48,
                                  moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                                  topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                                  q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=6,
                                  qk_rope_head_dim=4, v_head_dim=5, routed_scaling_factor=2.5,
                                  rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=64,
                                                    mscale=1.0, mscale_all_dim=0.7, beta_fast=32, beta_slow=1))
    if family == "llama":
        return T.LlamaConfig(**COMMON, intermediate_size=48, tie_word_embeddings=True)
    if family == "qwen2":
        return T.Qwen2Config(**COMMON, intermediate_size=48)
    raise ValueError(family)


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "llama", "qwen2", "deepseek_v3"]


def save_tiny(family: str, folder: Path, seed: int = 0, **save_kwargs) -> T.PreTrainedModel:
    torch.manual_seed(seed)
    cfg = tiny_config(family)
    cfg.eos_token_id = 1
    cfg.bos_token_id = 0
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # default init is tiny; make routing and attention non-trivial
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's selection bias: chooses other experts
                b.copy_(torch.rand_like(b) * 0.2)
    model.save_pretrained(folder, **save_kwargs)
    return model


def fuse_experts(folder: Path) -> None:
    """Rewrite a per-expert checkpoint into the fused expert layout ([E, 2I, D] / [E, D, I])."""
    tensors = load_file(folder / "model.safetensors")
    out, groups = {}, {}
    for name, t in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            prefix = ".".join(parts[:i]).replace("block_sparse_moe", "mlp")
            groups.setdefault(prefix, {})[(int(parts[i + 1]), parts[i + 2])] = t
        else:
            out[name.replace("block_sparse_moe", "mlp")] = t
    for prefix, g in groups.items():
        num = 1 + max(e for e, _ in g)
        gate = [g.get((e, "gate_proj"), g.get((e, "w1"))) for e in range(num)]
        up = [g.get((e, "up_proj"), g.get((e, "w3"))) for e in range(num)]
        down = [g.get((e, "down_proj"), g.get((e, "w2"))) for e in range(num)]
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack([torch.cat([a, b]) for a, b in zip(gate, up)])
        out[f"{prefix}.experts.down_proj"] = torch.stack(down)
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
