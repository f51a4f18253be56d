"""A tiny random Mixtral with a real byte-level BPE tokenizer, saved as an HF checkpoint folder.

What the engine, gateway and server tests serve until the demo checkpoints exist: the
tokenizer is the grammar tests' (bench/tiny_tokenizer.py, ~1000 tokens, trained in
about a second) and the model's vocabulary matches it exactly. A random model is the
hardest case for grammar masking: it puts mass on every token the mask lets through.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T

from bench.tiny_tokenizer import build_tiny_tokenizer

MODEL_NAME = "tiny-moe"


def save_tiny_checkpoint(folder: Path, seed: int = 0) -> Path:
    """Write tokenizer + random MoE model into `folder`; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(folder)
    torch.manual_seed(seed)
    cfg = T.MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
        rms_norm_eps=1e-6, eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # default init is tiny; make routing and attention non-trivial
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    return folder
