"""A lean one-token decode step for dense drafts: the draft's own math in a third of the calls.

Shapes: B rows, D hidden, H / Hkv query / key-value heads, Dh head dim, Tk key positions,
I MLP width, V vocab.

At demo size a draft forward is ~100 small torch calls plus module and StepBatch plumbing:
its cost is Python overhead, not arithmetic, and the draft runs k of them per engine step.
This step reads the same weights and the same paged KV cache as `CausalLM.forward` (so
prefill stays on the model's own path) but fuses q/k/v and gate/up into one matmul each, rotates
queries and keys together with cos/sin looked up in a table, uses torch's fused RMSNorm,
and builds no padding and, when all rows are as long, no mask. Dense Llama/Qwen2-style
models only (no experts, no q/k norm, no qkv clipping); `supports` says whether it applies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_shards import CausalLM
from model_shards.kv_cache import PagedKVCache


class DenseDecodeStep:
    """`step(tokens, block_table, positions, tk)` -> logits [B, V], writing each row's key/value at its position."""

    @staticmethod
    def supports(model: CausalLM) -> bool:
        cfg = model.config
        return not any(cfg.sparse_layers) and cfg.qk_norm == "none" and cfg.clip_qkv is None

    def __init__(self, model: CausalLM, cache: PagedKVCache, max_len: int) -> None:
        if not self.supports(model):
            raise ValueError("DenseDecodeStep needs a dense model without q/k norm or qkv clipping")
        cfg = model.config
        self.cache = cache
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_dim, self.kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.embed = model.model.embed_tokens.weight  # [V, D]
        self.layers = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if cfg.attention_bias else None
            self.layers.append((
                layer.input_layernorm.weight, layer.input_layernorm.eps,
                torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),  # [(H + 2 Hkv) Dh, D]
                None if bias is None else bias.detach(),
                a.o_proj.weight,  # [D, H Dh]
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
                torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(),  # [2 I, D]
                m.down_proj.weight,  # [D, I]
            ))
        self.norm = (model.model.norm.weight, model.model.norm.eps)
        self.lm_head = model.lm_head.weight  # [V, D]
        inv_freq = model.model.rotary.inv_freq
        positions = torch.arange(max_len + 1, dtype=torch.float32, device=inv_freq.device)
        freqs = positions[:, None] * inv_freq  # [Tmax, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [Tmax, Dh]
        dtype = self.embed.dtype
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def step(
        self, tokens: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor, tk: int, ragged: bool = True
    ) -> torch.Tensor:
        """tokens, positions: [B]; block_table: [B, nb] each row's blocks (covering its position);
        tk = max(positions) + 1.

        Row b attends to its keys 0..positions[b]. ragged=False promises that every row sits
        at position tk - 1, so no mask is built (and nothing is read back from the tensors)."""
        b = tokens.shape[0]
        h_, hkv, dh = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [B, 1, Dh]
        mask = None
        if b > 1 and ragged:
            mask = (torch.arange(tk, device=tokens.device)[None, :] <= positions[:, None])[:, None, None]  # [B, 1, 1, Tk]
        bs = self.cache.block_size
        write = block_table.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs  # [B]
        read = block_table[:, : -(-tk // bs)]  # [B, nb'] the blocks holding keys 0..tk-1
        x = F.embedding(tokens, self.embed)  # [B, D]
        for i, (w_in, eps_in, w_qkv, b_qkv, w_o, w_post, eps_post, w_gu, w_down) in enumerate(self.layers):
            qkv = F.linear(F.rms_norm(x, w_in.shape, w_in, eps_in), w_qkv, b_qkv)  # [B, (H + 2 Hkv) Dh]
            qk = _rotary(qkv[:, : self.q_dim + self.kv_dim].view(b, h_ + hkv, dh), cos, sin)  # [B, H + Hkv, Dh]
            v = qkv[:, self.q_dim + self.kv_dim :].view(b, hkv, dh)  # [B, Hkv, Dh]
            self.cache.write_at(i, write, qk[:, h_:, None], v[:, :, None])
            keys, values = self.cache.gather(i, read, tk)  # [B, Hkv, Tk, Dh]
            out = F.scaled_dot_product_attention(qk[:, :h_, None], keys, values, attn_mask=mask, enable_gqa=True)
            x = x + F.linear(out.view(b, self.q_dim), w_o)  # [B, D]
            gate, up = F.linear(F.rms_norm(x, w_post.shape, w_post, eps_post), w_gu).chunk(2, dim=-1)  # [B, I] x 2
            x = x + F.linear(F.silu(gate) * up, w_down)  # [B, D]
        w_norm, eps_norm = self.norm
        return F.linear(F.rms_norm(x, w_norm.shape, w_norm, eps_norm), self.lm_head).float()  # [B, V]


    @torch.inference_mode()
    def feed(self, tokens: torch.Tensor, lengths: torch.Tensor, block_table: torch.Tensor, starts: torch.Tensor) -> None:
        """Writes the keys/values of a few tokens per row, no logits: tokens [B, T] (row b's first
        lengths[b] of them; the rest is padding), at positions starts[b] + 0..lengths[b]-1;
        block_table [B, nb] covers them. Row b's tokens attend to its keys up to their own
        position. For short tails (the drafts and forced text a step accepted), where the model's
        own forward costs several one-token steps; padding writes to the scratch block."""
        b, t = tokens.shape
        h_, hkv, dh = self.num_heads, self.num_kv_heads, self.head_dim
        offsets = torch.arange(t, device=tokens.device)
        valid = offsets[None] < lengths[:, None]  # [B, T]
        pos = torch.where(valid, starts[:, None] + offsets, 0)  # [B, T]; padding: position 0
        bs = self.cache.block_size
        write = torch.where(valid, block_table.gather(1, pos // bs) * bs + pos % bs, 0)  # [B, T]; padding -> scratch
        tk = int((starts + lengths).max())
        read = block_table[:, : -(-tk // bs)]  # [B, nb'] the blocks holding keys 0..tk-1
        mask = (torch.arange(tk, device=tokens.device)[None, None] <= pos[:, :, None])[:, None]  # [B, 1, T, Tk]
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [B, 1, T, Dh]
        x = F.embedding(tokens, self.embed)  # [B, T, D]
        for i, (w_in, eps_in, w_qkv, b_qkv, w_o, w_post, eps_post, w_gu, w_down) in enumerate(self.layers):
            qkv = F.linear(F.rms_norm(x, w_in.shape, w_in, eps_in), w_qkv, b_qkv)  # [B, T, (H + 2 Hkv) Dh]
            qk = _rotary(qkv[..., : self.q_dim + self.kv_dim].view(b, t, h_ + hkv, dh).transpose(1, 2), cos, sin)
            v = qkv[..., self.q_dim + self.kv_dim :].view(b, t, hkv, dh).transpose(1, 2)  # [B, Hkv, T, Dh]
            self.cache.write_at(i, write.reshape(-1), qk[:, h_:], v)
            if i == len(self.layers) - 1:
                return  # the last layer's keys and values are written: nothing after them is kept
            keys, values = self.cache.gather(i, read, tk)  # [B, Hkv, Tk, Dh]
            out = F.scaled_dot_product_attention(qk[:, :h_], keys, values, attn_mask=mask, enable_gqa=True)
            x = x + F.linear(out.transpose(1, 2).reshape(b, t, self.q_dim), w_o)  # [B, T, D]
            gate, up = F.linear(F.rms_norm(x, w_post.shape, w_post, eps_post), w_gu).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w_down)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on [B, H, Dh] (queries and keys together) with cos/sin [B, 1, Dh], or on
    [B, H, T, Dh] with [B, 1, T, Dh]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
