"""The decode and verify pass compiled: the model's own layer code, traced by `torch.compile`.

Shapes: B rows, T query positions, J keys read per row (its nb blocks x Bs), D hidden,
K experts per token, V vocab, L layers, N = B*T tokens.

A small MoE's decode step is nearly all per-op overhead, which `torch.compile` fuses. The pass
runs the eager forward's own layer code, with what it would read from tensor values fixed up
front (each MoE layer runs `MoEBlock.fused`). On the CPU: one graph for a batch of one and one
shape-generic graph for 2..MAX_ROWS rows; on a GPU (`static`) CUDA graphs need fixed shapes, so
rows are padded to the next of CAPTURE_SIZES and block tables to a power of two of blocks.

An expert-parallel rank (`CompiledShardStep`) cannot be one graph, since the all-to-all's split
sizes are known only after the router: per layer, attention plus the router is one graph and the
dispatch stays eager (`MoEBlock.after_gating`). Prefill and capacity limits run eagerly (`accepts`).
Gates come back with the logits, so load statistics count real tokens only.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.fx.experimental._config
import torch.nn.functional as F
from torch import nn

from model_shards.kv_cache import PagedKVCache, paged_index
from model_shards.model import CausalLM
from model_shards.moe import LocalDispatch
from router_service.gating import Gates

logger = logging.getLogger(__name__)

MAX_ROWS = 64  # larger batches: eager
MAX_QUERY = 16  # decode (1) and verify (k + 1 <= 17) positions
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, MAX_ROWS)  # static graphs: rows padded to the next of these
MIN_KEYS = 128  # static graphs: keys read (blocks x Bs), padded to a power of two of blocks from here


class CompiledStep:
    """Decode/verify passes compiled per variant; `static`: padded fixed shapes (default on a GPU: CUDA graphs)."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, backend: str = "inductor",
                 static: bool | None = None) -> None:
        self.model, self.cache = model, cache
        self.num_calls = 0
        # no "duck sizing": a batch equal to a model dimension must not become a guard (made once)
        self._no_duck_sizing = torch.fx.experimental._config.patch(use_duck_shape=False)
        on_gpu = model.lm_head.weight.device.type == "cuda"
        self.static = on_gpu if static is None else static
        # a graph per (rows, query length; static: blocks): more than dynamo's default limit
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, 256 if self.static else 64)
        self._qkv: list | None = None  # per layer: q, k and v weights stacked (CPU graphs)
        if not self.static:
            if not model.config.is_mla:  # one larger matmul for three small ones (a copy of those weights)
                self._qkv = [layer.self_attn.stacked_qkv() for layer in model.model.layers]
            self._graph = _compile_dynamic(self._forward, backend)
            return
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 1024)
        if on_gpu and backend == "inductor":
            for t in cache.kv:
                torch._dynamo.mark_static_address(t)  # updated in place by the captured graphs
            self._graph = torch.compile(self._forward, dynamic=False, mode="reduce-overhead")
        else:
            self._graph = torch.compile(self._forward, dynamic=False, backend=backend)

    def accepts(self, num_rows: int, tq: int) -> bool:
        """Whether the graph takes this pass (else it runs eagerly)."""
        local = all(isinstance(b.dispatch, LocalDispatch) and b.routing.overflow == "none"
                    for b in self.model.moe_blocks)
        return local and num_rows <= MAX_ROWS and tq <= MAX_QUERY

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, tables: torch.Tensor, start: list[int], q_lens: list[int]) -> torch.Tensor:
        """ids [B, T] (right-padded past q_lens), block tables [B, nb] -> logits [B, T, V]."""
        b, t = ids.shape
        self.num_calls += 1
        ids = ids.clone()  # an inference tensor, like every other input: one set of guards
        if self.static:  # pad to the bucket: extra rows hold no tokens, extra blocks are the scratch one
            rows, nb = next(n for n in CAPTURE_SIZES if n >= b), tables.shape[1]
            width = max(MIN_KEYS // self.cache.block_size, 1 << (nb - 1).bit_length())
            ids = F.pad(ids, (0, 0, 0, rows - b))
            tables = F.pad(tables, (0, width - nb, 0, rows - b))
            start, q_lens = start + [0] * (rows - b), q_lens + [0] * (rows - b)
        as_long = lambda v: torch.tensor(v, dtype=torch.long, device=ids.device)  # noqa: E731
        with self._no_duck_sizing:
            logits, gates = self._graph(ids, tables, as_long(start), as_long(q_lens), self.cache.kv)
        self._count(gates, q_lens[:b], t)
        return logits[:b]

    def warm_up(self, query_lens: tuple[int, ...] = (1,)) -> float:
        """Compile every variant now; returns the seconds it took."""
        t0 = time.perf_counter()
        for t in query_lens:
            logger.info("compiling the model step for %d query position(s)...", t)
            # large experts: a graph for batches past E / K tokens too (dense, `MoEBlock.fused`)
            small = all(b.small_experts() for b in self.model.moe_blocks)
            for b in CAPTURE_SIZES if self.static else (1, 2) if small else (1, 2, MAX_ROWS):
                ids, tables = _scratch_pass(self.cache, b, t, self.model.device)
                self(ids, tables, [2] * b, [t] * b)
        return time.perf_counter() - t0

    # ---- the graph -------------------------------------------------------------------------
    def _forward(self, ids, tables, start, q_lens, kv) -> tuple[torch.Tensor, list[tuple]]:
        b, t = ids.shape
        x, rope, index = pass_inputs(self.model, ids, tables, start, q_lens, kv[0].shape[3])
        gates = []
        for i, layer in enumerate(self.model.model.layers):
            x, h = layer.attend(x, rope, kv[i], index, None if self._qkv is None else self._qkv[i])  # [B, T, D] x2
            h = h.reshape(b * t, -1)  # [N, D]
            if layer.is_sparse:
                out, g = layer.mlp.fused(h)
                gates.append((g.weights, g.expert_ids, g.probs))
            else:
                out = layer.mlp(h)
            x = x + out.view(b, t, -1)
        return self.model.lm_logits(self.model.model.norm(x)), gates  # [B, T, V]

    def _count(self, gates: list[tuple], q_lens: list[int], t: int) -> None:
        """Expert-load statistics over the real tokens of the first len(q_lens) rows (and the trace)."""
        blocks = self.model.moe_blocks
        if blocks and blocks[0].trace is not None:
            blocks[0].trace.extend((b.layer_idx, ids, w) for b, (w, ids, _) in zip(blocks, gates))
        if not blocks or blocks[0].stats is None:
            return
        keep = [i for r, n in enumerate(q_lens) for i in range(r * t, r * t + n)]
        keep = torch.tensor(keep, device=gates[0][0].device)  # [N_valid]
        for block, (weights, expert_ids, probs) in zip(blocks, gates):
            block.stats.update(block.layer_idx, Gates(weights[keep], expert_ids[keep], probs[keep]))


def _compile_dynamic(fn, backend: str):
    """A shape-generic graph; inductor's C++ wrapper skips the Python one's per-buffer checks."""
    options = {"cpp_wrapper": True} if backend == "inductor" else None
    return torch.compile(fn, dynamic=True, backend=backend, options=options)


def _scratch_pass(cache: PagedKVCache, b: int, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Warm-up ids [B, T] and tables: the scratch block twice, from position 2 (torch specialises 0 and 1)."""
    tables = torch.zeros(b, max(2, -(-(2 + t) // cache.block_size)), dtype=torch.long, device=device)
    return torch.zeros(b, t, dtype=torch.long, device=device), tables


def pass_inputs(model: CausalLM, ids: torch.Tensor, tables: torch.Tensor, start: torch.Tensor, q_lens: torch.Tensor,
                bs: int) -> tuple:
    """Inside a graph: embedded tokens [B, T, D], their rotary embedding, the PagedIndex (row b: q_lens[b]
    tokens from start[b])."""
    m = model.model
    x = m.embed_tokens(ids)  # [B, T, D]
    steps = torch.arange(ids.shape[1], device=ids.device)
    pos = start[:, None] + steps  # [B, T]
    valid = steps[None, :] < q_lens[:, None]  # [B, T]
    return x, m.rotary(pos, x.dtype), paged_index(tables, pos, valid, bs)


class CompiledShardStep:
    """This rank's decode/verify pass: compiled per layer up to the router, eager from the dispatch on."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, backend: str = "inductor") -> None:
        self.model, self.cache = model, cache
        self.step = CompiledStep(model, cache, backend, static=False)  # its stacked q/k/v weights
        self.num_calls = 0
        self._head = _compile_dynamic(self._head_fn, backend)
        self._layer = _compile_dynamic(self._layer_fn, backend)

    def warm_up(self, query_lens: tuple[int, ...] = (1, 2)) -> float:
        """Compile now for 1 and 2+ rows, without the dispatch (a rank warms up alone); returns seconds."""
        t0 = time.perf_counter()
        for t in query_lens:
            for b in (1, 2):
                ids, tables = _scratch_pass(self.cache, b, t, self.model.device)
                self._pass(ids, tables, torch.full_like(ids[:, 0], 2), torch.full_like(ids[:, 0], t), dispatch=False)
        return time.perf_counter() - t0

    def accepts(self, num_rows: int, tq: int) -> bool:
        blocks = self.model.moe_blocks
        return 0 < num_rows <= MAX_ROWS and tq <= MAX_QUERY and all(b.routing.overflow == "none" for b in blocks)

    def hidden_states(self, ids: torch.Tensor, tables: torch.Tensor, start: torch.Tensor, q_lens: torch.Tensor,
                      last_only: bool, lengths: list[int]) -> torch.Tensor:
        """As CausalLM.hidden_states: ids [B, T], tables [B, nb], start, q_lens [B] (`lengths`: on the host)."""
        self.num_calls += 1
        t = ids.shape[1]
        real = None  # the real tokens' indices [N_real], from the host's lengths: no device read
        if any(n < t for n in lengths):
            real = torch.tensor([r * t + i for r, n in enumerate(lengths) for i in range(n)], device=ids.device)
        x = self._pass(ids, tables, start, q_lens, real=real)
        if last_only:
            x = x[torch.arange(len(x), device=x.device), q_lens - 1][:, None]  # [B, 1, D]
        return self.model.model.norm(x)

    @torch.inference_mode()
    def _pass(self, ids: torch.Tensor, tables: torch.Tensor, start: torch.Tensor, q_lens: torch.Tensor,
              dispatch: bool = True, real: torch.Tensor | None = None) -> torch.Tensor:
        b, t = ids.shape
        with self.step._no_duck_sizing:
            x, rope, index = self._head(ids.clone(), tables, start, q_lens, self.cache.block_size)
            for i, layer in enumerate(self.model.model.layers):
                qkv = None if self.step._qkv is None else self.step._qkv[i]  # latent attention: none stacked
                x, h, route = self._layer(layer, qkv, x, rope, self.cache.kv[i], index)
                if route is not None and dispatch:
                    x = x + self._moe(layer.mlp, h, route, real).view(b, t, -1)
        return x  # [B, T, D]

    def _moe(self, block: nn.Module, h: torch.Tensor, route: tuple, real: torch.Tensor | None) -> torch.Tensor:
        """`MoEBlock.after_gating` over the real tokens of h [N, D] -> [N, D] (zeros at padding)."""
        weights, expert_ids, probs, shared = route
        if real is None:
            return block.after_gating(h, Gates(weights, expert_ids, probs), shared)
        out = block.after_gating(h[real], Gates(weights[real], expert_ids[real], probs[real]),
                                 None if shared is None else shared[real])  # [N_real, D]
        return out.new_zeros(h.shape[0], out.shape[-1]).index_copy_(0, real, out)

    # ---- the graphs ------------------------------------------------------------------------
    def _head_fn(self, ids, tables, start, q_lens, bs: int):
        return pass_inputs(self.model, ids, tables, start, q_lens, bs)

    def _layer_fn(self, layer, qkv, x, rope, kv, index):
        """Attention, then the router and shared expert: (x, h [N, D], (weights, expert_ids, probs,
        shared)); a dense layer's MLP runs here (route None)."""
        b, t, _ = x.shape
        x, h = layer.attend(x, rope, kv, index, qkv)
        h = h.reshape(b * t, -1)  # [N, D]
        if not layer.is_sparse:
            return x + layer.mlp(h).view(b, t, -1), h, None
        block = layer.mlp
        g = block.gates(h)
        shared = None if block.shared_expert is None else block.shared_out(h)
        return x, h, (g.weights, g.expert_ids, g.probs, shared)
