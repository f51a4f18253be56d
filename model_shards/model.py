"""The decoder-only transformer for every supported family, MoE or dense.

Shapes: B rows, T positions, D hidden, V vocab.
Module names follow the Hugging Face checkpoints (`model.layers.N.self_attn.q_proj`, ...),
so loading is a name-for-name copy; only per-expert tensors are fused on the way in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from model_shards.config import ModelConfig
from model_shards.kv_cache import PagedIndex, PagedKVCache, StepBatch
from model_shards.layers import MLP, Attention, Direct, Embedding, Linear, RMSNorm, RotaryEmbedding, inference
from model_shards.mla import LatentAttention
from model_shards.moe import Dispatch, MoEBlock, phase
from moeserve.config import RoutingSection
from router_service.gating import ExpertLoadStats


class DecoderLayer(Direct, nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, local_experts: Sequence[int]) -> None:
        super().__init__()
        self.self_attn = LatentAttention(cfg, idx) if cfg.is_mla else Attention(cfg, idx)
        self.is_sparse = cfg.sparse_layers[idx]
        self.mlp = MoEBlock(cfg, idx, local_experts) if self.is_sparse else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attend(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor | None,
               index: PagedIndex | None, qkv: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention with its residual, then the MLP's input norm: (x, h), each [B, T, D]; shared by
        every forward, eager and compiled (model_shards/compiled_step.py)."""
        with phase("attention"):
            x = x + self.self_attn(self.input_layernorm(x), rope, kv, index, qkv)
        return x, self.post_attention_layernorm(x)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor | None,
                index: PagedIndex | None, valid: torch.Tensor | None) -> torch.Tensor:
        x, h = self.attend(x, rope, kv, index)  # [B, T, D] each
        if not self.is_sparse:
            return x + self.mlp(h)
        if valid is None:  # no padding: every position is a real token
            return x + self.mlp(h.view(-1, h.shape[-1])).view_as(h)
        # Padding must not reach the router: it would take expert capacity and skew load statistics.
        out = torch.zeros_like(h)
        out[valid] = self.mlp(h[valid])  # [N_valid, D]
        return x + out


class Transformer(Direct, nn.Module):
    def __init__(self, cfg: ModelConfig, local_experts: Sequence[int]) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, local_experts) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg)


def split_routing(trace: list, lengths: list[int], tq: int) -> list[list[tuple]]:
    """What one pass recorded (CausalLM.record_routing), per row: [(layer, expert ids [n, K],
    gate weights [n, K]) per MoE layer] over the row's n = lengths[b] fed tokens, on the CPU.
    The eager forward routes real tokens only; the compiled step every row padded to tq."""
    rows: list[list[tuple]] = [[] for _ in lengths]
    for layer, ids, weights in trace:
        ids, weights = ids.cpu(), weights.float().cpu()
        if ids.shape[0] == sum(lengths):
            per_row = zip(ids.split(lengths), weights.split(lengths))
        else:
            per_row = ((i[:n], w[:n]) for i, w, n in zip(ids.view(-1, tq, ids.shape[-1]),
                                                       weights.view(-1, tq, weights.shape[-1]), lengths))
        for out, (i, w) in zip(rows, per_row):
            out.append((layer, i, w))
    return rows


class CausalLM(Direct, nn.Module):
    """`forward(input_ids)` -> logits [B, T, V]; with a PagedKVCache and StepBatch it runs one engine step."""

    routing_trace: list | None = None  # see record_routing

    def __init__(self, cfg: ModelConfig, local_experts: Sequence[int] | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.local_experts = tuple(range(cfg.num_experts) if local_experts is None else local_experts)
        self.model = Transformer(cfg, self.local_experts)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # ---- configuration of the MoE layers -------------------------------------------------
    @property
    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.mlp for layer in self.model.layers if layer.is_sparse]

    def set_dispatch(self, dispatch: Dispatch) -> None:
        for block in self.moe_blocks:
            block.dispatch = dispatch

    def set_routing(self, routing: RoutingSection) -> None:
        for block in self.moe_blocks:
            block.routing = routing

    def record_routing(self, on: bool) -> list | None:
        """While on, every MoE layer appends (layer index, expert ids [N, K], gate weights [N, K])
        of each forward pass to the returned list (the caller empties it); off costs nothing."""
        trace = self.routing_trace = [] if on else None
        for block in self.moe_blocks:
            block.trace = trace
        return trace

    def enable_stats(self) -> ExpertLoadStats:
        """Start counting expert load in every MoE layer; returns the (shared) accumulator."""
        stats = ExpertLoadStats(self.config.num_layers, max(self.config.num_experts, 1))
        for block in self.moe_blocks:
            block.stats = stats
        return stats

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    # ---- forward ---------------------------------------------------------------------------
    @inference
    def forward(self, input_ids: torch.Tensor, cache: PagedKVCache | None = None, batch: StepBatch | None = None,
                logits: Literal["all", "last"] = "all") -> torch.Tensor:
        """input_ids: [B, T]. Without a cache: a full causal forward. With one: row b holds
        `batch.q_lens[b]` new tokens at positions start[b]...; padding beyond is ignored.
        Returns logits [B, T, V], or [B, V] at each row's last valid token when logits="last"."""
        h = self.hidden_states(input_ids, cache, batch, last_only=logits == "last")  # [B, T or 1, D]
        out = self.lm_logits(h)
        return out[:, 0] if logits == "last" else out

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h).float()  # [..., V]

    @inference
    def hidden_states(self, input_ids: torch.Tensor, cache: PagedKVCache | None = None,
                      batch: StepBatch | None = None, last_only: bool = False) -> torch.Tensor:
        """Final normed hidden states [B, T, D] (or [B, 1, D] at each row's last valid token)."""
        b, t = input_ids.shape
        if (cache is None) != (batch is None):
            raise ValueError("cache and batch go together")
        if b == 0:
            return self._join_collectives_only(t, last_only)
        x = self.model.embed_tokens(input_ids)  # [B, T, D]
        if batch is None:
            positions, valid = torch.arange(t, device=input_ids.device).expand(b, t), None
        else:
            positions, valid = batch.prepare(t).pos, batch.valid_mask  # [B, T] each
        rope = self.model.rotary(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, None if cache is None else cache.kv[i], None if batch is None else batch.index, valid)
        if last_only and t > 1:
            last = (batch.q_lens - 1) if batch is not None else torch.full((b,), t - 1, device=x.device)
            x = x[torch.arange(b, device=x.device), last][:, None]  # [B, 1, D]
        return self.model.norm(x)

    def _join_collectives_only(self, t: int, last_only: bool) -> torch.Tensor:
        """A shard with no sequences this step still takes part in every MoE layer's all-to-all."""
        w = self.lm_head.weight
        empty = w.new_zeros(0, self.config.hidden_size)
        for block in self.moe_blocks:
            block(empty)
        return w.new_zeros(0, 1 if last_only else t, self.config.hidden_size)
