"""Paged KV cache: fixed-size blocks allocated on demand, with automatic prefix caching.

Shapes: N blocks, L layers, Bs tokens per block, Hkv key/value heads, Dh head dim,
B batch rows, Tq query positions this step, nb blocks per row (the longest row's).

Memory is at most `num_blocks` blocks (the KV budget), not a slot of max_model_len per
sequence: a sequence holds ceil(tokens / Bs) blocks, listed in its block table, and gets more
as it grows. The cache tensors start small and grow (doubling, up to the budget) as higher
block ids are handed out; the allocator hands out the lowest free ids first, so what is
allocated follows the tokens live (and cached). Block 0 is scratch: padded query positions
write there, and block tables are padded with it.

Prefix caching (vLLM's automatic prefix caching): a block whose Bs tokens are all committed is
identified by a hash of those tokens chained with its parent block's hash, so equal hashes
mean equal prefixes. A new sequence reuses the longest chain of cached blocks matching its
tokens (their reference counts go up; they are never written again). A block no sequence
holds stays cached, least recently used first out, until an allocation needs it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from model_shards.kv_cache import StepBatch

SCRATCH = 0


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The id of a full block: its tokens chained with its parent's id."""
    return hash((parent, tokens))


class OutOfBlocks(RuntimeError):
    """No free or evictable block is left (the scheduler's budget should prevent this)."""


@dataclass
class _Block:
    ref: int = 0
    hash: int | None = None  # set once the block is full and committed (then it is never written again)


class BlockAllocator:
    """Hands out blocks 1..N-1; reference counts; the prefix-cache index and its LRU of idle blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks: need at least 2 (one is scratch), got {num_blocks}")
        self.num_blocks = num_blocks
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # never-cached free blocks (pop from the end)
        self.high_water = 1  # one past the highest block id ever handed out
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks no one holds, oldest first
        self.hits = 0  # blocks reused from the prefix cache
        self.queries = 0  # full blocks looked up

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: free ones plus idle cached ones (evictable)."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._idle:
            block, _ = self._idle.popitem(last=False)  # evict the least recently used
            del self._cached[self._blocks[block].hash]
            self._blocks[block].hash = None
        else:
            raise OutOfBlocks("no free KV cache block")
        self._blocks[block].ref = 1
        self.high_water = max(self.high_water, block + 1)
        return block

    def free(self, block: int) -> None:
        b = self._blocks[block]
        if b.ref <= 0:
            raise ValueError(f"block {block} freed more often than it was held")
        b.ref -= 1
        if b.ref == 0:
            if b.hash is None:
                self._free.append(block)
            else:
                self._idle[block] = None  # stays findable until evicted

    def commit(self, block: int, h: int) -> None:
        """`block` is full with the tokens behind hash `h`: make it findable."""
        b = self._blocks[block]
        if b.hash is not None:
            return
        if h in self._cached:  # the same prefix was computed twice (in one batch): keep the first
            return
        b.hash = h
        self._cached[h] = block

    def lookup(self, hashes: list[int]) -> list[int]:
        """The cached blocks for the longest prefix of `hashes`, each now held once more."""
        found = []
        for h in hashes:
            self.queries += 1
            block = self._cached.get(h)
            if block is None:
                break
            b = self._blocks[block]
            if b.ref == 0:
                del self._idle[block]
            b.ref += 1
            found.append(block)
        self.hits += len(found)
        return found

    def refcount(self, block: int) -> int:
        return self._blocks[block].ref


class PagedKVCache:
    """Keys and values of each layer in one tensor [2, Hkv, N, Bs, Dh]: a block is Bs consecutive
    positions of one sequence. One index_copy in and one index_select out per layer; what the
    gather returns is already [B, Hkv, Tk, Dh] with each head's [Tk, Dh] contiguous, as
    attention's matmuls want it.

    Same interface as the slot cache for attention: `write` this step's keys/values, `read` the
    batch's keys/values up to `batch.tk` as [B, Hkv, Tk, Dh] (a gather through the block tables).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        initial_blocks: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        first = num_blocks if initial_blocks is None else max(1, min(initial_blocks, num_blocks))
        shape = (2, num_kv_heads, first, block_size, head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks = num_blocks  # the most it may grow to
        self.block_size = block_size

    @property
    def nbytes(self) -> int:
        """Bytes allocated now."""
        return sum(t.numel() * t.element_size() for t in self.kv)

    @property
    def capacity(self) -> int:
        return self.kv[0].shape[2]

    def reserve(self, blocks: int) -> None:
        """Room for block ids below `blocks`: grow by doubling (up to num_blocks), keeping contents."""
        have = self.capacity
        if blocks <= have:
            return
        if blocks > self.num_blocks:
            raise ValueError(f"block {blocks - 1} is past the cache's {self.num_blocks} blocks")
        new = min(self.num_blocks, max(blocks, 2 * have))
        for i, t in enumerate(self.kv):
            grown = t.new_zeros(*t.shape[:2], new, *t.shape[3:])
            grown[:, :, :have] = t
            self.kv[i] = grown

    def write(self, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's keys/values; k, v: [B, Hkv, Tq, Dh] (batch prepared for Tq)."""
        cache = self.kv[layer]
        two, heads, n, bs, dh = cache.shape
        new = torch.stack((k, v)).transpose(1, 2).reshape(two, heads, -1, dh)  # [2, Hkv, B*Tq, Dh]
        # slot = block * Bs + offset for each position; padding goes to the scratch block
        cache.view(two, heads, n * bs, dh).index_copy_(2, batch.write_index, new)

    def read(self, layer: int, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, Hkv, Tk, Dh] keys and values of the batch's rows: one gather (index_select is
        several times faster than advanced indexing here) and two views."""
        cache = self.kv[layer]
        b, nb = batch.block_table.shape
        blocks = cache.index_select(2, batch.block_table.view(-1))  # [2, Hkv, B*nb, Bs, Dh]
        both = blocks.view(2, cache.shape[1], b, nb * self.block_size, cache.shape[4])[:, :, :, : batch.tk]
        return both[0].transpose(0, 1), both[1].transpose(0, 1)  # [B, Hkv, Tk, Dh] each


def paged_step_batch(
    tables: list[list[int]], start: list[int], q_lens: list[int], block_size: int, device: torch.device | str = "cpu"
) -> StepBatch:
    """A StepBatch whose rows are addressed through block tables (PagedKVCache)."""
    batch = StepBatch.build([0] * len(tables), start, q_lens, device=device)
    tq = max(q_lens)  # rows are padded to it: attention reads up to max(start) + tq keys
    width = max(max(len(t) for t in tables), -(-(max(start) + tq) // block_size))
    batch.block_table = torch.tensor([t + [SCRATCH] * (width - len(t)) for t in tables], dtype=torch.long,
                                     device=device)  # [B, nb]
    batch.block_size = block_size
    return batch
