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

import torch

from model_shards.block_manager import SCRATCH


@dataclass
class StepBatch:
    """Where a forward pass's rows read and write the paged cache.

    block_table: [B, nb] each row's blocks in position order (padded with the scratch block)
    start:       [B] tokens already cached for each row (position of the row's first query token)
    q_lens:      [B] valid query tokens in each row (<= Tq; the rest is padding)

    The per-step index tensors (positions, padding, attention mask, write positions) are built
    once by `prepare(Tq)` and shared by every layer.
    """

    block_table: torch.Tensor
    start: torch.Tensor
    q_lens: torch.Tensor
    block_size: int
    tq: int = 0
    pos: torch.Tensor | None = None  # [B, Tq] absolute position of each query token
    valid_mask: torch.Tensor | None = None  # [B, Tq] False at padding (None: no padding)
    tk: int = 0  # keys attention reads per row (the longest row after this step)
    attn_mask: torch.Tensor | None = None  # [B, 1, Tq, Tk] query i sees keys 0 .. pos[i]; None when fresh
    fresh: bool = False  # every row starts at position 0: plain causal attention over this step's keys
    write_index: torch.Tensor | None = None  # [B*Tq] block * Bs + offset of each query (padding: scratch)

    @classmethod
    def build(cls, tables: list[list[int]], start: list[int], q_lens: list[int], block_size: int,
              device: torch.device | str = "cpu") -> StepBatch:
        """Rows addressed through their block tables, padded to the widest (or to what the
        longest row reads after this step)."""
        tq = max(q_lens)
        width = max(max(map(len, tables)), -(-(max(start) + tq) // block_size))
        table = torch.tensor([t + [SCRATCH] * (width - len(t)) for t in tables], dtype=torch.long, device=device)
        as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        return cls(table, as_long(start), as_long(q_lens), block_size)

    def prepare(self, tq: int) -> StepBatch:
        if self.tq == tq and self.pos is not None:
            return self
        self.tq = tq
        steps = torch.arange(tq, device=self.start.device)
        self.pos = self.start[:, None] + steps  # [B, Tq]
        valid = steps[None, :] < self.q_lens[:, None]  # [B, Tq]
        self.valid_mask = None if bool(valid.all()) else valid
        self.tk = int((self.start + tq).max())
        # Padding is on the right, so with no cached prefix a causal mask is exact for every real token.
        self.fresh = not bool(self.start.any())
        keys = torch.arange(self.tk, device=self.pos.device)
        self.attn_mask = None if self.fresh else (keys[None, None, :] <= self.pos[:, :, None])[:, None]
        pos = self.pos if self.valid_mask is None else self.pos.masked_fill(~self.valid_mask, 0)
        blocks = self.block_table.gather(1, pos // self.block_size)  # [B, Tq]
        if self.valid_mask is not None:
            blocks = blocks.masked_fill(~self.valid_mask, SCRATCH)
        self.write_index = (blocks * self.block_size + pos % self.block_size).view(-1)  # [B*Tq]
        return self


class PagedKVCache:
    """Keys and values of each layer in one tensor [2, Hkv, N, Bs, Dh], every block allocated
    here: a block is Bs consecutive positions of one sequence. One index_copy in and one
    index_select out per layer; what the gather returns is already [B, Hkv, Tk, Dh] with each
    head's [Tk, Dh] contiguous, as attention's matmuls want it."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks: need at least 2 (one is scratch), got {num_blocks}")
        # zeros, not empty: attention weighs unread keys by 0, and 0 * NaN would still be NaN
        shape = (2, num_kv_heads, num_blocks, block_size, head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over every layer (keys and values)."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

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

    def write(self, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's keys/values; k, v: [B, Hkv, Tq, Dh] (batch prepared for Tq)."""
        self.write_at(layer, batch.write_index, k, v)

    def write_at(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, Hkv, Tq, Dh] to the flat positions `index` [B*Tq] (block * Bs + offset)."""
        cache = self.kv[layer]
        two, heads, n, bs, dh = cache.shape
        new = torch.stack((k, v)).transpose(1, 2).reshape(two, heads, -1, dh)  # [2, Hkv, B*Tq, Dh]
        cache.view(two, heads, n * bs, dh).index_copy_(2, index, new)

    def read(self, layer: int, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, Hkv, Tk, Dh] keys and values of the batch's rows."""
        return self.gather(layer, batch.block_table, batch.tk)

    def gather(self, layer: int, block_table: torch.Tensor, tk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, Hkv, Tk, Dh] keys and values through `block_table` [B, nb] (nb * Bs >= Tk): one
        gather (index_select is several times faster than advanced indexing here) and two views."""
        cache = self.kv[layer]
        b, nb = block_table.shape
        blocks = cache.index_select(2, block_table.reshape(-1))  # [2, Hkv, B*nb, Bs, Dh]
        both = blocks.view(2, cache.shape[1], b, nb * self.block_size, cache.shape[4])[:, :, :, :tk]
        return both[0].transpose(0, 1), both[1].transpose(0, 1)  # [B, Hkv, Tk, Dh] each
