"""The shared layers: RMSNorm, rotary embeddings, the SwiGLU MLP, grouped-query attention over the paged cache.

Shapes: B rows, T (=Tq) query positions, J key positions a row reads (its nb blocks x Bs),
H query heads, Hkv kv heads, Dh head dim, D hidden, I MLP width, N cache blocks.

A pass writes its keys and values first; a fresh prefill then attends causally over its own keys,
a compiled decode reads the cache by index (`indexed_attention`), the rest gathers the rows' blocks.
An eager pass on the CPU runs q/k/v and gate/up as one matmul each (`stacked`).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from model_shards.config import ModelConfig, YarnScaling
from model_shards.kv_cache import PagedIndex, materialize


def inference(fn):
    """`torch.inference_mode()` as a decorator, entered only where it is not on already (the
    decorator builds and enters a new mode object per call: tens of microseconds on this CPU, a
    few percent of a small model's eager decode step)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run


class Direct:
    """Mixin: calling the module runs its forward, without nn.Module's hook dispatch (the project
    registers no hooks). A small model's eager decode step on the CPU is Python overhead more than
    arithmetic, and that dispatch was about 8% of it (README, "Speculative decoding")."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class Linear(Direct, nn.Linear):
    pass


class Embedding(Direct, nn.Embedding):
    pass


class RMSNorm(Direct, nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # fused kernel; same numbers as below in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 like the reference implementations, then scale in the input dtype.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(Direct, nn.Module):
    """Rotary embedding (HF's rotate-half) over cfg.rope_dim dimensions, with YaRN where configured."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        dim = cfg.rope_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.scale = 1.0
        if cfg.rope_scaling is not None:
            inv_freq, self.scale = yarn(inv_freq, cfg.rope_scaling, cfg.rope_theta, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # rotate-half's sign, carried by sin: -x2 * sin == x2 * -sin exactly (see apply_rotary)
        self.register_buffer("sign", torch.tensor([-1.0, 1.0]).repeat_interleave(dim // 2), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos and signed sin [B, 1, T, Dh], shaped for queries and keys [B, H, T, Dh]."""
        freqs = positions.float()[:, None, :, None] * self.inv_freq  # [B, 1, T, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, 1, T, Dh]
        cos, sin = emb.cos(), emb.sin() * self.sign
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn(inv_freq: torch.Tensor, y: YarnScaling, theta: float, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: blended frequencies and the cos/sin scale."""
    scale = y.attention_factor
    if scale is None:
        scale = (yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
                 if y.mscale and y.mscale_all_dim else yarn_mscale(y.factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # [Dh/2] weight of the original frequency
    return inv_freq / y.factor * ramp + inv_freq * extrapolation, float(scale)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, Dh]; cos and signed sin: [B, 1, T, Dh] (RotaryEmbedding). The roll is rotate-half's
    (x2, x1); sin's sign makes it (-x2, x1)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def stacked(module: nn.Module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights of `module`'s linears `names` stacked [sum of outputs, in] and their biases: one
    matmul for several small ones. A copy, kept on `module` until one of the weights is replaced or
    changed in place. (Per call, so it reads the registries directly: attribute lookups through
    nn.Module would cost as much as the matmul it saves.)"""
    linears = [module._modules[n] for n in names]
    key = [(p.data_ptr(), p._version) for lin in linears for p in lin._parameters.values() if p is not None]
    cached = module.__dict__.get("_stacked")
    if cached is None or cached[0] != key:
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable in any mode
            bias = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
            cached = module.__dict__["_stacked"] = (key, torch.cat([lin.weight for lin in linears]), bias)
    return cached[1], cached[2]


def stacks(x: torch.Tensor) -> bool:
    """Whether an eager pass over x stacks projections: on the CPU, where a small matmul is mostly
    per-call overhead and memory is plentiful (a graph gets its stacked weights as inputs)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


class MLP(Direct, nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). Dense layers and shared experts."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not stacks(x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, stacked(self, ("gate_proj", "up_proj"))[0]).chunk(2, dim=-1)  # [..., I] x2
        return self.down_proj(F.silu(gate) * up)


class Attention(Direct, nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, q_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, kv_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, kv_dim, bias=bias)
        self.o_proj = Linear(q_dim, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":  # Qwen3-MoE: per head
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":  # OLMoE: over the whole projection
            self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(kv_dim, cfg.rms_norm_eps)
        self.clip_qkv = cfg.clip_qkv

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> tuple[torch.Tensor, ...]:
        """Queries [B, H, T, Dh], keys and values [B, Hkv, T, Dh] (rotary applied); qkv: `stacked_qkv`."""
        b, t, _ = x.shape
        h, hkv, dh = self.num_heads, self.num_kv_heads, self.head_dim
        if qkv is not None and self.qk_norm == "none" and self.clip_qkv is None:
            # nothing between projection and rotary: queries and keys turn side by side, in one pass
            heads = F.linear(x, *qkv).view(b, t, h + 2 * hkv, dh).transpose(1, 2)  # [B, H + 2 Hkv, T, Dh]
            qk = apply_rotary(heads[:, : h + hkv], *rope)  # [B, H + Hkv, T, Dh]
            return qk[:, :h], qk[:, h:], heads[:, h + hkv :]
        if qkv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, T, H*Dh], [B, T, Hkv*Dh] x2
        else:
            q, k, v = F.linear(x, *qkv).split((h * dh, hkv * dh, hkv * dh), dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (z.clamp(-self.clip_qkv, self.clip_qkv) for z in (q, k, v))
        q = q.view(b, t, h, dh)
        k = k.view(b, t, hkv, dh)
        v = v.view(b, t, hkv, dh).transpose(1, 2)  # [B, Hkv, T, Dh]
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q.transpose(1, 2), *rope), apply_rotary(k.transpose(1, 2), *rope), v

    def stacked_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q, k and v projections' weights [(H + 2 Hkv) * Dh, D] and biases, stacked (see `stacked`)."""
        return stacked(self, ("q_proj", "k_proj", "v_proj"))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor | None = None,
                index: PagedIndex | None = None, qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                ) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D] over this layer's cache kv [2, Hkv, N, Bs, Dh] at `index` (None: causal)."""
        b, t, _ = x.shape
        if qkv is None and stacks(x):
            qkv = self.stacked_qkv()
        q, k, v = self.project(x, rope, qkv)  # [B, H, T, Dh], [B, Hkv, T, Dh] x2
        if kv is None or index.fresh:  # nothing cached before this pass: causal over its own keys
            if kv is not None:
                write_entries(kv, index, torch.stack((k, v)))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            flat = write_entries(kv, index, torch.stack((k, v)))  # [2, Hkv, N*Bs, Dh]
            if t == 1 and torch.compiler.is_compiling():
                return self.o_proj(indexed_attention(q, flat, index))
            two, heads, _, _, dh = kv.shape
            read = read_blocks(kv, index.tables.reshape(-1)).view(two, heads, b, -1, dh)  # [2, Hkv, B, J, Dh]
            out = F.scaled_dot_product_attention(q, read[0].transpose(0, 1), read[1].transpose(0, 1),
                                                 attn_mask=index.mask, enable_gqa=True)  # [B, H, T, Dh]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


def write_entries(kv: torch.Tensor, index: PagedIndex, entries: torch.Tensor) -> torch.Tensor:
    """Entries [P, B, Hkv, T, Dh] (keys and values, or one latent) into kv [P, Hkv, N, Bs, Dh] at
    `index.write`; returns kv viewed as [P, Hkv, N*Bs, Dh]."""
    parts, heads, n, bs, dh = kv.shape
    flat = kv.view(parts, heads, n * bs, dh)
    flat.index_copy_(2, index.write, entries.transpose(1, 2).reshape(parts, heads, -1, dh))
    return flat


@torch.library.custom_op("moeserve::gather_blocks", mutates_args=())
def gather_blocks(paged: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """paged [P, Hkv, N, Bs, Dh] -> its blocks `blocks` [M] in order, [P, Hkv, M, Bs, Dh]: aten's
    index_select (a copy per block), where inductor's own gather computes an index per element."""
    return paged.index_select(2, blocks)


@gather_blocks.register_fake
def _(paged: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    two, heads, _, bs, dh = paged.shape
    return paged.new_empty(two, heads, blocks.shape[0], bs, dh)


def read_blocks(paged: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """`gather_blocks`; the custom op is for inductor alone, so an eager pass calls aten's directly."""
    return gather_blocks(paged, blocks) if torch.compiler.is_compiling() else paged.index_select(2, blocks)


def indexed_attention(q: torch.Tensor, flat: torch.Tensor, index: PagedIndex) -> torch.Tensor:
    """Decode attention from the cache: q [B, H, 1, Dh], flat [2, Hkv, N*Bs, Dh] -> [B, 1, H*Dh], as
    gather-multiply-sums that inductor fuses into reductions loading keys by index (no copies)."""
    b, h, _, dh = q.shape
    heads = flat.shape[1]
    keys = flat[0][:, index.keys_at].transpose(0, 1)  # [B, Hkv, J, Dh]
    values = flat[1][:, index.values_at].transpose(0, 1)  # [B, Hkv, J, Dh]
    # the query's rotary embedding (cos, sin) would otherwise be recomputed for every key
    q = materialize(q).view(b, heads, h // heads, 1, dh)  # query head i reads key head i // (H/Hkv), as enable_gqa
    scores = (q * keys[:, :, None]).sum(-1) * dh**-0.5  # [B, Hkv, H/Hkv, J]
    p = torch.softmax(scores.masked_fill(~index.mask, float("-inf")), dim=-1)
    return (p[..., None] * values[:, :, None]).sum(-2).reshape(b, 1, h * dh)  # [B, 1, H*Dh]
