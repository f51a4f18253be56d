"""The decode and verify pass as one captured graph: the same model, no data-dependent Python.

Shapes: B rows (padded to >= 2), T query positions, Tk keys read per row, D hidden,
E experts, K experts per token, I expert width, V vocab, L layers.

A decode step of a small MoE is nearly all per-op overhead (dozens of tiny kernels per
layer, each a Python call). `torch.compile` fuses them, but only over code whose control
flow does not depend on tensor values. This pass is the eager forward rewritten that way:

- KV writes go to block * Bs + offset through the rows' block tables (padding to the scratch
  block) and attention reads the rows' blocks by index; the mask comes from positions;
- each token runs through its top-k experts as a gather-multiply-sum that inductor fuses into
  one reduction loading the routed experts' weights by index (no data-dependent shapes), or,
  where that would read more expert weights than there are and they do not fit the caches,
  through every expert as one dense matmul weighted by the gates (`_moe`); exact for capacity "none";
- rows, on the CPU: one graph for a batch of one (torch specialises size-1 dimensions; the
  single stream is the latency that matters most) and one shape-generic graph for 2..64 rows,
  each for T = 1 (decode) and T = k + 1 (verify);
- on a GPU (`static`): CUDA graphs (mode "reduce-overhead"), which need fixed shapes, so rows
  are padded to the next of CAPTURE_SIZES (as vLLM pads to its capture sizes) and the block
  tables to the next power of two of blocks (at least MIN_KEYS keys), with the scratch block;
  padding rows hold no tokens and write only the scratch block. The cache is reserved whole at
  start and never moves, so its tensors are marked static addresses and the graphs update
  them in place. One graph per (rows, T, blocks) bucket: the decode ones are captured at
  start-up, the rest on first use (inductor's on-disk cache makes a restart cheaper).

Prefill (long, ragged prompts) and capacity limits other than "none" keep the eager path
(`CompiledStep.accepts`); expert-parallel ranks compile between their collectives
(model_shards/compiled_shard.py). The router's choices come back with
the logits so the expert-load statistics still count every real token (never padding).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.fx.experimental._config
import torch.nn.functional as F

from model_shards.dispatch import LocalDispatch
from model_shards.kv_cache import PagedKVCache
from model_shards.model import CausalLM
from router_service.gating import Gates, topk_gate

logger = logging.getLogger(__name__)

MAX_ROWS = 64  # larger batches: eager
# A layer's experts up to this size are read routed at any batch (they stay in the CPU's caches:
# demo MoE, 3 MiB); larger ones (Mixtral-8x7B: 2.8 GB a layer) only while N * K <= E.
ROUTED_MAX_EXPERT_BYTES = 16 << 20
MAX_QUERY = 16  # decode (1) and verify (k + 1 <= 17) positions
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, MAX_ROWS)  # static graphs: rows padded to the next of these
MIN_KEYS = 128  # static graphs: keys read (blocks x Bs), padded to a power of two of blocks from here


class CompiledStep:
    """`model`'s forward over `cache` for decode/verify batches, compiled once per variant.

    `warm_up` writes only to the scratch block. `backend`: torch.compile's ("inductor": C++
    kernels on CPU, Triton on GPU; "eager": traced, not compiled). `static`: fixed-shape graphs
    over padded buckets (default: when the cache is on a GPU, where inductor then captures CUDA
    graphs)."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, backend: str = "inductor",
                 static: bool | None = None) -> None:
        self.model, self.cache = model, cache
        self.num_calls = 0
        # no "duck sizing": a batch that happens to equal a model dimension must not become a guard
        # (one context object, made once: making one per call would add to every step)
        self._no_duck_sizing = torch.fx.experimental._config.patch(use_duck_shape=False)
        on_gpu = model.lm_head.weight.device.type == "cuda"
        self.static = on_gpu if static is None else static
        # a graph per variant (rows, query length; static: and blocks): more than dynamo's default limit (past it, eager)
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, 256 if self.static else 64)
        self._qkv: list | None = None  # per layer: q, k and v weights stacked (CPU graphs)
        if not self.static:
            # q, k and v as one matmul a layer (a copy of those weights): one larger matmul for three small ones
            self._qkv = [layer.self_attn.stacked_qkv() for layer in model.model.layers]
            # the C++ wrapper calls the kernels without the Python one's per-buffer checks and views
            # (a cost per call, so it counts most at small batches, whose steps are short)
            options = {"cpp_wrapper": True} if backend == "inductor" else None
            self._graph = torch.compile(self._forward, dynamic=True, backend=backend, options=options)
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
        """ids [B, T] (padded on the right past q_lens), the rows' block tables [B, nb] (covering
        max(start) + T) -> logits [B, T, V]."""
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
        """Compile every variant now (a few seconds each from inductor's on-disk cache, tens
        of seconds the first time); returns the seconds it took."""
        t0 = time.perf_counter()
        for t in query_lens:
            logger.info("compiling the model step for %d query position(s)...", t)
            # start past 1: torch specialises sizes 0 and 1, and the keys read must stay symbolic;
            # every row in the scratch block, twice (a table of one block would specialise);
            # large experts: a graph for batches past E / K tokens too (dense, `_moe`)
            for b in CAPTURE_SIZES if self.static else self._warm_up_rows():
                tables = torch.zeros(b, max(2, -(-(2 + t) // self.cache.block_size)), dtype=torch.long,
                                     device=self.model.device)
                self(torch.zeros(b, t, dtype=torch.long, device=self.model.device), tables, [2] * b, [t] * b)
        return time.perf_counter() - t0

    def _warm_up_rows(self) -> tuple[int, ...]:
        if all(_small_experts(b.experts) for b in self.model.moe_blocks):
            return 1, 2
        return 1, 2, MAX_ROWS

    # ---- the graph -------------------------------------------------------------------------
    def _forward(self, ids, tables, start, q_lens, kv) -> tuple[torch.Tensor, list[tuple]]:
        m = self.model.model
        b, t = ids.shape
        x, rope, pos, valid = pass_inputs(self.model, ids, start, q_lens)
        paged = _paged_indices(tables, pos, valid, kv[0].shape[3])
        gates = []
        for i, layer in enumerate(m.layers):
            qkv = None if self._qkv is None else self._qkv[i]
            x = x + paged_attention(layer.self_attn, qkv, layer.input_layernorm(x), rope, tables, (kv[i], *paged))
            h = layer.post_attention_layernorm(x).reshape(b * t, -1)  # [B*T, D]
            if layer.is_sparse:
                out, g = _moe(layer.mlp, h)
                gates.append((g.weights, g.expert_ids, g.probs))
            else:
                out = layer.mlp(h)
            x = x + out.view(b, t, -1)
        return self.model.lm_logits(m.norm(x)), gates  # [B, T, V]

    def _count(self, gates: list[tuple], q_lens: list[int], t: int) -> None:
        """Expert-load statistics over the real tokens of the first len(q_lens) rows (and the
        routing of every row, while it is recorded)."""
        blocks = self.model.moe_blocks
        if blocks and blocks[0].trace is not None:
            blocks[0].trace.extend((b.layer_idx, ids, w) for b, (w, ids, _) in zip(blocks, gates))
        if not blocks or blocks[0].stats is None:
            return
        keep = [i for r, n in enumerate(q_lens) for i in range(r * t, r * t + n)]
        keep = torch.tensor(keep, device=gates[0][0].device)  # [N_valid]
        for block, (weights, expert_ids, probs) in zip(blocks, gates):
            block.stats.update(block.layer_idx, Gates(weights[keep], expert_ids[keep], probs[keep]))


def pass_inputs(model: CausalLM, ids: torch.Tensor, start: torch.Tensor, q_lens: torch.Tensor) -> tuple:
    """Inside a graph: the embedded tokens [B, T, D], their rotary embedding, positions [B, T] and
    which are real tokens [B, T] (row b holds q_lens[b] tokens from position start[b])."""
    m = model.model
    x = m.embed_tokens(ids)  # [B, T, D]
    steps = torch.arange(ids.shape[1], device=ids.device)
    pos = start[:, None] + steps  # [B, T]
    valid = steps[None, :] < q_lens[:, None]  # [B, T]
    return x, m.rotary(pos, x.dtype), pos, valid


def paged_attention(attn, qkv: torch.Tensor | None, x: torch.Tensor, rope, tables: torch.Tensor,
                    paged: tuple) -> torch.Tensor:
    """One layer's attention over a paged cache, inside a graph: x [B, T, D], the rows' block tables
    [B, nb], paged = (the layer's cache [2, Hkv, N, Bs, Dh], *`_paged_indices`) -> [B, T, D].
    Writes this pass's keys and values first. `qkv`: the layer's stacked q/k/v weights, or None."""
    b, t, _ = x.shape
    q, k, v = attn.project(x, rope, qkv)  # [B, H, T, Dh], [B, Hkv, T, Dh] x2
    cache, write, keys_at, values_at, mask = paged
    two, heads, n, bs, dh = cache.shape
    new = torch.stack((k, v)).transpose(1, 2).reshape(two, heads, b * t, dh)  # [2, Hkv, B*T, Dh]
    flat = cache.view(two, heads, n * bs, dh)
    flat.index_copy_(2, write, new)
    if t == 1:  # decode: keys and values loaded by index inside fused reductions, never copied
        return attn.o_proj(_indexed_attention(q, flat, keys_at, values_at, mask))
    read = _gather_blocks(cache, tables.reshape(-1)).view(two, heads, b, -1, dh)  # [2, Hkv, B, nb*Bs, Dh]
    out = F.scaled_dot_product_attention(q, read[0].transpose(0, 1), read[1].transpose(0, 1), attn_mask=mask,
                                         enable_gqa=True)  # [B, H, T, Dh]
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))


@torch.library.custom_op("moeserve::materialize", mutates_args=())
def _materialize(x: torch.Tensor) -> torch.Tensor:
    """`x`, computed once into a buffer of its own: inductor does not fuse into a custom op, so the
    producer of `x` is not inlined into (and recomputed by) every iteration of the consumer."""
    return x.clone()


@_materialize.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("moeserve::gather_blocks", mutates_args=())
def _gather_blocks(paged: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """paged [2, Hkv, N, Bs, Dh] -> its blocks `blocks` [M] in order, [2, Hkv, M, Bs, Dh]: aten's
    index_select, a block-sized copy each, where inductor's own gather computes an index per
    element, which costs more than the copy it drives."""
    return paged.index_select(2, blocks)


@_gather_blocks.register_fake
def _(paged: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    two, heads, _, bs, dh = paged.shape
    return paged.new_empty(two, heads, blocks.shape[0], bs, dh)


def _paged_indices(slots: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, bs: int) -> tuple[torch.Tensor, ...]:
    """What every layer's attention over the paged cache reads, for the whole pass: the flat
    cache position each query's key and value go to [B*T] (padding -> the scratch block), each
    row's key positions [B, J] (every key of its nb blocks, J = nb * Bs) twice, and the causal
    mask over them [B, 1, T, J] (no slice to the keys a row holds, whose size would become a
    guard and recompile).

    The positions the keys are read at are computed once into a buffer: inlined, the block-table
    lookup ran again for every layer, head and key. The values' copy stays an expression, so
    inductor vectorizes their weighted sum over Dh; read from a buffer, it vectorized over the
    keys instead, with gathers, the slower loop."""
    p = torch.where(valid, pos, 0)
    write = torch.where(valid, slots.gather(1, p // bs) * bs + p % bs, 0)  # [B, T]
    j = torch.arange(slots.shape[1] * bs, device=slots.device)  # [J]
    at = slots[:, j // bs] * bs + j % bs  # [B, J]
    mask = (j[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, J]
    return _materialize(write.view(-1)), _materialize(at), at, mask


def _indexed_attention(q: torch.Tensor, flat: torch.Tensor, keys_at: torch.Tensor, values_at: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """Decode attention straight from a paged cache: q [B, H, 1, Dh], flat [2, Hkv, N*Bs, Dh] (keys,
    values), keys_at = values_at [B, J] each row's key positions in it (`_paged_indices`), mask
    [B, 1, 1, J] -> [B, 1, H*Dh].

    As gather-multiply-sums, which inductor fuses into reductions that load the cached rows by
    index: the rows' blocks are never copied out first (a gather then `scaled_dot_product_attention`
    copies every row's blocks once per layer, which costs more than the attention it feeds)."""
    b, h, _, dh = q.shape
    heads = flat.shape[1]
    keys, values = flat[0][:, keys_at].transpose(0, 1), flat[1][:, values_at].transpose(0, 1)  # [B, Hkv, J, Dh]
    # the query's rotary embedding (cos, sin) would otherwise be recomputed for every key
    q = _materialize(q).view(b, heads, h // heads, 1, dh)  # query head i reads key head i // (H/Hkv), as enable_gqa
    scores = (q * keys[:, :, None]).sum(-1) * dh**-0.5  # [B, Hkv, H/Hkv, J]
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (p[..., None] * values[:, :, None]).sum(-2).reshape(b, 1, h * dh)  # [B, 1, H*Dh]


def _moe(block, x: torch.Tensor) -> tuple[torch.Tensor, Gates]:
    """The MoE block on [N, D] tokens, exact for capacity "none": routed (each token through its
    top-k experts) when that reads no more expert weights than running every token through every
    expert (N * K <= E), or when a layer's experts are small enough to stay in the caches
    (ROUTED_MAX_EXPERT_BYTES); else dense."""
    g = topk_gate(block.gate(x), block.gate_cfg)  # weights, expert_ids [N, K]; probs [N, E]
    e = block.experts
    n, k = g.expert_ids.shape
    # the size test first: N is symbolic, so testing it puts a guard on the graph (a recompile
    # when a batch crosses E / K tokens), which small experts never need
    if _small_experts(e) or n * k <= e.num_local:
        out = _routed_experts(e, x, g)
    else:
        out = _dense_experts(e, x, g)
    if block.shared_expert is not None:
        out = out + block.shared_out(x)
    return out, g


def _small_experts(e) -> bool:
    return (e.gate_up_proj.numel() + e.down_proj.numel()) * e.gate_up_proj.element_size() <= ROUTED_MAX_EXPERT_BYTES


def _routed_experts(e, x: torch.Tensor, g: Gates) -> torch.Tensor:
    """[N, D]: each token through its top-k experts, as gather-multiply-sums that inductor fuses
    into one reduction per projection loading the routed experts' rows by index (no copy of the
    gathered weights, no data-dependent shapes). A route reads its expert's weights: from the
    caches when they fit there (a token reads its K experts' weights, where dense reads all E),
    from memory once per route otherwise."""
    gate, up = (e.gate_up_proj[g.expert_ids] * x[:, None, None, :]).sum(-1).chunk(2, dim=-1)  # [N, K, I] x2
    y = (e.down_proj[g.expert_ids] * (F.silu(gate) * up)[:, :, None, :]).sum(-1)  # [N, K, D]
    return (g.weights.to(x.dtype)[..., None] * y).sum(1)  # [N, D]


def _dense_experts(e, x: torch.Tensor, g: Gates) -> torch.Tensor:
    """[N, D]: every token through every local expert, combined by the top-k gate weights (zero
    elsewhere): E / K times the arithmetic, but each expert's weights read once, by one matmul
    against the stacked weights (a view, no copy) and one batched one."""
    n, d = x.shape
    w = x.new_zeros(n, e.num_local).scatter(1, g.expert_ids, g.weights.to(x.dtype))  # [N, E]
    gate, up = F.linear(x, e.gate_up_proj.view(-1, d)).view(n, e.num_local, -1).chunk(2, dim=-1)  # [N, E, I] x2
    y = torch.bmm((F.silu(gate) * up).transpose(0, 1), e.down_proj.transpose(1, 2))  # [E, N, D]
    return torch.einsum("ne,end->nd", w, y)  # [N, D]
