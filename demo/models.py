"""Configs of the demo pair and the parameter counts that define "compute per token".

Active parameters per token = every non-embedding weight a token touches (attention, norms,
router, its top-k experts) plus the lm_head; the embedding lookup is a gather, not compute.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, MixtralConfig


def target_config(vocab_size: int, quick: bool = False) -> MixtralConfig:
    """The MoE target: Mixtral family, 8 experts, top-2."""
    d, layers, inter = (32, 2, 64) if quick else (128, 4, 256)
    return MixtralConfig(
        vocab_size=vocab_size, hidden_size=d, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=False,
        router_aux_loss_coef=0.02, output_router_logits=False,  # we ask for router logits only while training
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )


def draft_config(vocab_size: int, quick: bool = False) -> LlamaConfig:
    """The dense draft: Llama family, same tokenizer, >= 5x less compute per token than the target."""
    d, layers, inter = (16, 1, 32) if quick else (64, 2, 256)
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=d, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Total parameters, and active per token (non-embedding, experts scaled by top_k / num_experts, + lm_head)."""
    cfg = model.config
    expert_share = getattr(cfg, "num_experts_per_tok", 1) / getattr(cfg, "num_local_experts", 1)
    total = active = 0.0
    for name, p in model.named_parameters():
        total += p.numel()
        if "embed_tokens" in name:
            continue
        active += p.numel() * (expert_share if ".experts." in name else 1.0)
    return {"total": int(total), "active_per_token": int(active)}
