"""An expert-parallel rank's decode and verify passes, compiled between its collectives.

Shapes: B rows of this rank, T query positions, D hidden, K experts per token, N = B*T.

A rank's pass cannot be one graph: every MoE layer's all-to-all waits on the other ranks, and
its split sizes are known only once the router has run. So per layer, attention over the
rank's paged cache, the residual, the norm and the router are one compiled graph (the
single-process step's attention, `CompiledStep`), and the dispatch stays eager: the plan, the
all-to-alls, the grouped expert matmuls (model_shards/experts.py) and the combine. The layer's
module is an input of that graph, not a constant, so every layer runs the same graph (one
per kind of pass: one row or several, decode or verify).

As in the eager pass, only real tokens reach the router's statistics, the recorded routing and
the all-to-all (padding positions of a verify pass are left out): after the graph, the layer's
own `MoEBlock.after_gating` runs. Prefill, capacity limits other than "none" and a rank with no
rows this step run eagerly (`accepts`).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from model_shards.compiled_step import MAX_QUERY, MAX_ROWS, CompiledStep, _paged_indices, paged_attention, pass_inputs
from model_shards.kv_cache import PagedKVCache
from model_shards.model import CausalLM
from router_service.gating import Gates, topk_gate


class CompiledShardStep:
    """`model`'s pass over this rank's `cache` for decode/verify rows: compiled per layer up to
    the router, eager from the dispatch on. `backend` as CompiledStep's."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, backend: str = "inductor") -> None:
        self.model, self.cache = model, cache
        self.step = CompiledStep(model, cache, backend, static=False)  # its stacked q/k/v weights
        self.num_calls = 0
        options = {"cpp_wrapper": True} if backend == "inductor" else None
        self._head = torch.compile(self._head_fn, dynamic=True, backend=backend, options=options)
        self._layer = torch.compile(self._layer_fn, dynamic=True, backend=backend, options=options)

    def warm_up(self, query_lens: tuple[int, ...] = (1, 2)) -> float:
        """Compile the graphs now, for one row and several, decode (1) and verify or short prefill
        (2: one shape-generic graph for 2..MAX_QUERY positions). Without the dispatch, so a rank
        warms up alone; it writes only to the scratch block. Returns the seconds it took."""
        t0 = time.perf_counter()
        for t in query_lens:
            for b in (1, 2):
                ids = torch.zeros(b, t, dtype=torch.long, device=self.model.device)
                tables = torch.zeros(b, max(2, -(-(2 + t) // self.cache.block_size)), dtype=torch.long, device=ids.device)
                self._pass(ids, tables, torch.full_like(ids[:, 0], 2), torch.full_like(ids[:, 0], t), dispatch=False)
        return time.perf_counter() - t0

    def accepts(self, num_rows: int, tq: int) -> bool:
        blocks = self.model.moe_blocks
        return 0 < num_rows <= MAX_ROWS and tq <= MAX_QUERY and all(b.routing.overflow == "none" for b in blocks)

    def hidden_states(self, ids: torch.Tensor, tables: torch.Tensor, start: torch.Tensor, q_lens: torch.Tensor,
                      last_only: bool) -> torch.Tensor:
        """ids [B, T], the rows' block tables [B, nb], start and q_lens [B] -> final normed hidden
        states [B, T, D] (or [B, 1, D] at each row's last real token), as CausalLM.hidden_states."""
        self.num_calls += 1
        x = self._pass(ids, tables, start, q_lens)
        if last_only:
            x = x[torch.arange(len(x), device=x.device), q_lens - 1][:, None]  # [B, 1, D]
        return self.model.model.norm(x)

    @torch.inference_mode()
    def _pass(self, ids: torch.Tensor, tables: torch.Tensor, start: torch.Tensor, q_lens: torch.Tensor,
              dispatch: bool = True) -> torch.Tensor:
        b, t = ids.shape
        with self.step._no_duck_sizing:
            x, rope, valid, paged = self._head(ids.clone(), tables, start, q_lens, self.cache.block_size)
            real = None if bool(valid.all()) else valid.reshape(-1).nonzero().squeeze(1)  # [N_real]
            for i, layer in enumerate(self.model.model.layers):
                x, h, route = self._layer(layer, self.step._qkv[i], x, rope, tables, self.cache.kv[i], paged)
                if route is not None and dispatch:
                    x = x + self._moe(layer.mlp, h, route, real).view(b, t, -1)
        return x  # [B, T, D]

    def _moe(self, block: nn.Module, h: torch.Tensor, route: tuple, real: torch.Tensor | None) -> torch.Tensor:
        """The eager rest of an MoE layer for this rank's tokens h [N, D] (`MoEBlock.after_gating`:
        statistics, the all-to-all, combine, the shared expert), over the real tokens only.
        Returns [N, D] (zeros at padding)."""
        weights, expert_ids, probs, shared = route
        if real is None:
            return block.after_gating(h, Gates(weights, expert_ids, probs), shared)
        out = block.after_gating(h[real], Gates(weights[real], expert_ids[real], probs[real]),
                                 None if shared is None else shared[real])  # [N_real, D]
        return out.new_zeros(h.shape[0], out.shape[-1]).index_copy_(0, real, out)

    # ---- the graphs ------------------------------------------------------------------------
    def _head_fn(self, ids, tables, start, q_lens, bs: int):
        x, rope, pos, valid = pass_inputs(self.model, ids, start, q_lens)
        return x, rope, valid, _paged_indices(tables, pos, valid, bs)

    def _layer_fn(self, layer, qkv, x, rope, tables, kv, paged):
        """Attention (writing this pass's keys and values) and the residual; then the norm and, for
        an MoE layer, the router and the shared expert: (x, h [N, D], (weights, expert ids, probs,
        shared expert out)); a dense layer's MLP is applied here (route None)."""
        b, t, _ = x.shape
        x = x + paged_attention(layer.self_attn, qkv, layer.input_layernorm(x), rope, tables, (kv, *paged))
        h = layer.post_attention_layernorm(x).reshape(b * t, -1)  # [N, D]
        if not layer.is_sparse:
            return x + layer.mlp(h).view(b, t, -1), h, None
        block = layer.mlp
        g = topk_gate(block.gate(h), block.gate_cfg)
        shared = None if block.shared_expert is None else block.shared_out(h)
        return x, h, (g.weights, g.expert_ids, g.probs, shared)
