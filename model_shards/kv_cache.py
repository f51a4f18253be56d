"""The paged KV cache, reserved whole at start, and the per-step description of where a batch reads and writes it.

Shapes: N blocks, L layers, Bs tokens per block, Hkv key/value heads, Dh head dim,
B batch rows, Tq query positions this step (rows shorter than Tq are padded), nb blocks per row.

Every block is allocated when the cache is built (as vLLM and nano-vllm do): memory is the
KV budget from the start and never grows, and the cache tensors keep one address for their
lifetime, so captured CUDA graphs can read and write them. Which blocks a sequence holds is
model_shards/block_manager.py's bookkeeping; block 0 is scratch (padded query positions write
there, and block tables are padded with it). Rolling back rejected speculative tokens is
free: the owner just feeds from an earlier position; stale entries past it are never read
(the attention mask stops at each row's own length) and are overwritten by the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from model_shards.block_manager import SCRATCH
from model_shards.config import ModelConfig


class PagedIndex(NamedTuple):
    """Where one pass's rows write and read the paged cache, built once and shared by every layer
    (`paged_index`). J = nb * Bs key positions per row."""

    tables: torch.Tensor  # [B, nb] each row's blocks in position order (padded with the scratch block)
    write: torch.Tensor  # [B*T] flat cache position (block * Bs + offset) of each query's key/value
    keys_at: torch.Tensor  # [B, J] flat cache position of each row's key j (decode attention, in a graph)
    values_at: torch.Tensor  # the same positions, for values (see `paged_index`)
    mask: torch.Tensor  # [B, 1, T, J] query i sees keys j <= its position
    fresh: bool = False  # every row starts at position 0: causal attention over the pass's own keys


@torch.library.custom_op("moeserve::materialize", mutates_args=())
def materialize(x: torch.Tensor) -> torch.Tensor:
    """`x`, computed once into a buffer of its own: inductor does not fuse into a custom op, so the
    producer of `x` is not inlined into (and recomputed by) every iteration of the consumer."""
    return x.clone()


@materialize.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def paged_index(tables: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, bs: int,
                fresh: bool = False) -> PagedIndex:
    """The pass's PagedIndex for rows with block tables [B, nb], query positions pos [B, T] and
    real tokens valid [B, T] (padding writes to the scratch block). The mask spans every key of a
    row's nb blocks, not a slice to the keys it holds, whose size would become a graph guard.

    The positions keys are read at are computed once into a buffer: inlined, the block-table
    lookup ran again for every layer, head and key. The values' copy stays an expression, so
    inductor vectorizes their weighted sum over Dh; read from a buffer, it vectorized over the
    keys instead, with gathers, the slower loop."""
    p = torch.where(valid, pos, 0)
    write = torch.where(valid, tables.gather(1, p // bs) * bs + p % bs, SCRATCH * bs)  # [B, T]
    j = torch.arange(tables.shape[1] * bs, device=tables.device)  # [J]
    at = tables[:, j // bs] * bs + j % bs  # [B, J]
    mask = (j[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, J]
    return PagedIndex(tables, materialize(write.view(-1)), materialize(at), at, mask, fresh)


@dataclass
class StepBatch:
    """Where an eager forward pass's rows read and write the paged cache.

    block_table: [B, nb] each row's blocks in position order (padded with the scratch block)
    start:       [B] tokens already cached for each row (position of the row's first query token)
    q_lens:      [B] valid query tokens in each row (<= Tq; the rest is padding)

    `prepare(Tq)` builds the pass's index tensors once for every layer (a compiled step builds
    the same PagedIndex inside its graph). `known`, set by `build` from the host's lists: the
    shortest row's q_len and whether every row starts at 0, so `prepare` reads nothing back
    from the device (else it reads both: two host syncs a pass on a GPU).
    """

    block_table: torch.Tensor
    start: torch.Tensor
    q_lens: torch.Tensor
    block_size: int
    tq: int = 0
    pos: torch.Tensor | None = None  # [B, Tq] absolute position of each query token
    valid_mask: torch.Tensor | None = None  # [B, Tq] False at padding (None: no padding)
    index: PagedIndex | None = None
    known: tuple[int, bool] | None = None

    @classmethod
    def build(cls, tables: list[list[int]], start: list[int], q_lens: list[int], block_size: int,
              device: torch.device | str = "cpu") -> StepBatch:
        """Rows addressed through their block tables, padded to the widest (or to what the
        longest row reads after this step)."""
        tq = max(q_lens)
        width = max(max(map(len, tables)), -(-(max(start) + tq) // block_size))
        table = torch.tensor([t + [SCRATCH] * (width - len(t)) for t in tables], dtype=torch.long, device=device)
        as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        return cls(table, as_long(start), as_long(q_lens), block_size, known=(min(q_lens), not any(start)))

    def prepare(self, tq: int) -> StepBatch:
        if self.tq == tq and self.index is not None:
            return self
        self.tq = tq
        steps = torch.arange(tq, device=self.start.device)
        self.pos = self.start[:, None] + steps  # [B, Tq]
        valid = steps[None, :] < self.q_lens[:, None]  # [B, Tq]
        shortest, fresh = self.known or (int(self.q_lens.min()), not bool(self.start.any()))
        self.valid_mask = None if shortest >= tq else valid
        # Padding is on the right, so with no cached prefix a causal mask is exact for every real token.
        self.index = paged_index(self.block_table, self.pos, valid, self.block_size, fresh)
        return self


class PagedKVCache:
    """Keys and values of each layer in one tensor [2, Hkv, N, Bs, Dh], every block allocated
    here: a block is Bs consecutive positions of one sequence. Attention writes and reads it
    (model_shards/layers.py) through a pass's PagedIndex. Multi-head latent attention stores one
    part, one head: its compressed latent [1, 1, N, Bs, kv_lora_rank + rope] (model_shards/mla.py)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        parts: int = 2,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks: need at least 2 (one is scratch), got {num_blocks}")
        # zeros, not empty: attention weighs unread keys by 0, and 0 * NaN would still be NaN
        shape = (parts, num_kv_heads, num_blocks, block_size, head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> PagedKVCache:
        """The cache for `cfg`'s entries (`ModelConfig.kv_entry`)."""
        parts, heads, dim = cfg.kv_entry
        return cls(cfg.num_layers, num_blocks, block_size, heads, dim, dtype, device, parts)

    @staticmethod
    def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over every layer (keys and values, or latents)."""
        parts, heads, dim = cfg.kv_entry
        return parts * cfg.num_layers * block_size * heads * dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes allocated (all of it, from the start)."""
        return sum(t.numel() * t.element_size() for t in self.kv)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Block dst gets block src's keys and values, for each (src, dst)."""
        if not pairs:
            return
        src, dst = (torch.tensor(ids, device=self.kv[0].device) for ids in zip(*pairs))
        for t in self.kv:
            t.index_copy_(2, dst, t.index_select(2, src))
