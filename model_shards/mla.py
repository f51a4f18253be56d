"""Multi-head latent attention (DeepSeek-V2/V3) over the paged KV cache.

Shapes: B rows, T query positions, J key positions a row reads, H heads, D hidden,
R = kv_lora_rank (the latent), Dn / Dr = the no-rope / rope parts of a query-key head, Dv value head dim.

The cache stores each token's latent c [R] plus one rope key [Dr] shared by every head. A pass
with nothing cached attends over its own latents expanded per head (as transformers does); one that
reads the cache absorbs the up-projections instead (DeepSeek-V2, 2.1.2): the key's into the query
and the value's into the output, so attention is one kv head of width R + Dr.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_shards.config import ModelConfig
from model_shards.kv_cache import PagedIndex
from model_shards.layers import Direct, Linear, RMSNorm, apply_rotary, read_blocks, write_entries, yarn_mscale


class LatentAttention(Direct, nn.Module):
    """transformers' DeepseekV3Attention, over the paged latent cache."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        h, bias = cfg.num_heads, cfg.attention_bias
        self.num_heads, self.rank = h, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk = self.nope + self.rope
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)  # transformers' default eps, not the config's
            self.q_b_proj = Linear(cfg.q_lora_rank, h * qk, bias=False)
        else:
            self.q_proj = Linear(cfg.hidden_size, h * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = Linear(self.rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(h * self.v_dim, cfg.hidden_size, bias=bias)
        self.scale = qk**-0.5
        y = cfg.rope_scaling
        if y is not None and y.mscale_all_dim:  # YaRN scales the softmax of every dimension too
            self.scale *= yarn_mscale(y.factor, y.mscale_all_dim) ** 2
        self.interleave = cfg.rope_interleave

    def _rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [B, H, T, Dr]: DeepSeek's checkpoints pair rope dimensions (0, 1), (2, 3), ...; laid
        out evens then odds, the pairs are rotate-half's, as transformers' output is."""
        if self.interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rotary(x, *rope)

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries' no-rope [B, H, T, Dn] and rope [B, H, T, Dr] parts, and the cache entries
        [B, T, R + Dr] (the normed latent, then the rotated rope key)."""
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q_nope, q_rot = q.view(b, t, self.num_heads, -1).transpose(1, 2).split((self.nope, self.rope), dim=-1)
        c, k_rot = self.kv_a_proj_with_mqa(x).split((self.rank, self.rope), dim=-1)  # [B, T, R], [B, T, Dr]
        k_rot = self._rotate(k_rot[:, None], rope)[:, 0]  # [B, T, Dr]
        return q_nope, self._rotate(q_rot, rope), torch.cat((self.kv_a_layernorm(c), k_rot), dim=-1)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor | None = None,
                index: PagedIndex | None = None, qkv: None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]. kv: this layer's latent cache [1, 1, N, Bs, R + Dr] with the
        pass's `index` (None: no cache, causal over x). `qkv` is plain attention's (always None)."""
        b, t, _ = x.shape
        q_nope, q_rot, latent = self.project(x, rope)  # [B, H, T, Dn], [B, H, T, Dr], [B, T, R + Dr]
        if kv is None or index.fresh:  # nothing cached before this pass: causal over its own keys
            if kv is not None:
                write_entries(kv, index, latent[None, :, None])
            out = self.expanded(q_nope, q_rot, latent)
        else:
            write_entries(kv, index, latent[None, :, None])
            read = read_blocks(kv, index.tables.reshape(-1)).view(b, -1, kv.shape[-1])  # [B, J, R + Dr]
            out = self.absorbed(q_nope, q_rot, read, index.mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.v_dim))

    def expanded(self, q_nope: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over latents [B, J, R + Dr] expanded to per-head keys and values, causal
        without a mask [B, 1, T, J] -> [B, H, T, Dv]."""
        b, j, _ = latent.shape
        c, k_rot = latent.split((self.rank, self.rope), dim=-1)  # [B, J, R], [B, J, Dr]
        k_nope, v = self.kv_b_proj(c).view(b, j, self.num_heads, -1).transpose(1, 2).split(
            (self.nope, self.v_dim), dim=-1)  # [B, H, J, Dn], [B, H, J, Dv]
        k = torch.cat((k_nope, k_rot[:, None].expand(-1, self.num_heads, -1, -1)), dim=-1)  # [B, H, J, Dn + Dr]
        q = torch.cat((q_nope, q_rot), dim=-1)  # [B, H, T, Dn + Dr]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale)

    def absorbed(self, q_nope: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
        """The same attention read straight from the latents [B, J, R + Dr] (mask [B, 1, T, J]):
        q_nope W_uk . c  ==  q_nope . (W_uk c), and (sum_j p_j c_j) W_uv  ==  sum_j p_j (W_uv c_j)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)  # [H, Dn + Dv, R]
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w[:, : self.nope])  # [B, H, T, R]
        q = torch.cat((q_latent, q_rot), dim=-1)  # [B, H, T, R + Dr]
        keys = latent[:, None]  # [B, 1, J, R + Dr]: one kv head for every query head
        out = F.scaled_dot_product_attention(q, keys, keys[..., : self.rank], attn_mask=mask, scale=self.scale,
                                             enable_gqa=True)  # [B, H, T, R]
        return torch.einsum("bhtr,hvr->bhtv", out, w[:, self.nope :])  # [B, H, T, Dv]
