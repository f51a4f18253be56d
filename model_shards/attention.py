"""Grouped-query attention with rotary embeddings, optional q/k norm, over the paged KV cache.

Shapes: B rows, T (=Tq) query positions, Tk key positions, H query heads, Hkv kv heads,
Dh head dim, D hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_shards.config import ModelConfig
from model_shards.kv_cache import PagedKVCache, StepBatch
from model_shards.layers import RMSNorm, apply_rotary


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":  # Qwen3-MoE: per head
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":  # OLMoE: over the whole projection
            self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(kv_dim, cfg.rms_norm_eps)
        self.clip_qkv = cfg.clip_qkv

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
        qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This step's queries [B, H, T, Dh], keys and values [B, Hkv, T, Dh] (rotary applied).
        qkv: the three projections' weights (and biases) stacked (`stacked_qkv`): one matmul."""
        b, t, _ = x.shape
        if qkv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, T, H*Dh], [B, T, Hkv*Dh] x2
        else:
            kv_dim = self.num_kv_heads * self.head_dim
            q, k, v = F.linear(x, *qkv).split((self.num_heads * self.head_dim, kv_dim, kv_dim), dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (z.clamp(-self.clip_qkv, self.clip_qkv) for z in (q, k, v))
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, Dh]
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q.transpose(1, 2), *rope), apply_rotary(k.transpose(1, 2), *rope), v

    def stacked_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q, k and v projections' weights [(H + 2 Hkv) * Dh, D] and biases, stacked (a copy)."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        bias = None if self.q_proj.bias is None else torch.cat([p.bias.detach() for p in projections])
        return torch.cat([p.weight.detach() for p in projections]), bias

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: PagedKVCache | None = None,
        batch: StepBatch | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.project(x, rope)  # [B, H, T, Dh], [B, Hkv, T, Dh] x2
        if cache is not None:
            cache.write(self.layer_idx, batch, k, v)
        if cache is None or batch.fresh:  # nothing cached before this step: causal over its own keys
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            keys, values = cache.read(self.layer_idx, batch)  # [B, Hkv, Tk, Dh]
            # Query i of a row sits at absolute position start + i and sees keys 0..start + i.
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.attn_mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)  # [B, T, H*Dh]
        return self.o_proj(out)
