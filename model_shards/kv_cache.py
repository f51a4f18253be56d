"""The paged KV cache: its blocks, which sequence holds which, and where a pass reads and writes them.

Shapes: N blocks, L layers, Bs tokens per block, Hkv key/value heads, Dh head dim,
B batch rows, Tq query positions this step (rows shorter than Tq are padded), nb blocks per row.

Every block is allocated up front, so the tensors keep one address that captured CUDA graphs can
use. Which blocks a sequence holds is bookkeeping without tensors (`BlockManager`). Block 0 is
scratch: padding writes there and pads block tables. Rolling back rejected drafts is free: stale
entries past a row's length are never read and are overwritten next step.

Prefix caching (as vLLM's): a full, committed block is keyed by a hash of its tokens chained with
its parent's; a block no sequence holds stays cached until evicted, least recently used first.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from model_shards.config import ModelConfig

SCRATCH = 0


class PagedIndex(NamedTuple):
    """Where one pass's rows write and read the cache, shared by every layer. J = nb * Bs keys a row."""

    tables: torch.Tensor  # [B, nb] each row's blocks in position order (padded with the scratch block)
    write: torch.Tensor  # [B*T] flat cache position (block * Bs + offset) of each query's key/value
    keys_at: torch.Tensor | None  # [B, J] flat cache position of each row's key j (decode attention in a graph; eager: None)
    values_at: torch.Tensor | None  # the same positions, for values (see `paged_index`)
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


def paged_index(tables: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor | None, bs: int,
                fresh: bool = False) -> PagedIndex:
    """The PagedIndex for block tables [B, nb], query positions pos [B, T] and real tokens valid
    [B, T] (None: every token is real). The mask spans all nb blocks (a slice's size would become a
    graph guard). Only a graph reads keys by index: eagerly, attention gathers whole blocks, and
    the buffers below (inductor's alone) are left out. In a graph, key positions go to a buffer
    (inlined, the lookup reruns per layer, head and key); the values' copy stays an expression,
    so inductor vectorizes their weighted sum over Dh."""
    p = pos if valid is None else torch.where(valid, pos, 0)
    write = tables.gather(1, p // bs) * bs + p % bs  # [B, T]
    if valid is not None:
        write = torch.where(valid, write, SCRATCH * bs)
    j = torch.arange(tables.shape[1] * bs, device=tables.device)  # [J]
    mask = (j[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, J]
    if not torch.compiler.is_compiling():
        return PagedIndex(tables, write.view(-1), None, None, mask, fresh)
    at = tables[:, j // bs] * bs + j % bs  # [B, J]
    return PagedIndex(tables, materialize(write.view(-1)), materialize(at), at, mask, fresh)


@dataclass
class StepBatch:
    """An eager pass's rows; `prepare(Tq)` builds their PagedIndex once for every layer. `known`
    (from `build`): shortest q_len and all-start-at-0, so `prepare` reads nothing from the device."""

    block_table: torch.Tensor  # [B, nb] each row's blocks in position order (padded with the scratch block)
    start: torch.Tensor  # [B] tokens already cached for each row (position of the row's first query token)
    q_lens: torch.Tensor  # [B] valid query tokens in each row (<= Tq; the rest is padding)
    block_size: int
    tq: int = 0
    pos: torch.Tensor | None = None  # [B, Tq] absolute position of each query token
    valid_mask: torch.Tensor | None = None  # [B, Tq] False at padding (None: no padding)
    index: PagedIndex | None = None
    known: tuple[int, bool] | None = None

    @classmethod
    def build(cls, tables: list[list[int]], start: list[int], q_lens: list[int], block_size: int,
              device: torch.device | str = "cpu") -> StepBatch:
        """Rows' block tables padded to the widest (or to what the longest row reads this step)."""
        tq = max(q_lens)
        width = max(max(map(len, tables)), -(-(max(start) + tq) // block_size))
        table = torch.tensor([t + [SCRATCH] * (width - len(t)) for t in tables], dtype=torch.long, device=device)
        as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        return cls(table, as_long(start), as_long(q_lens), block_size, known=(min(q_lens), not any(start)))

    def prepare(self, tq: int) -> StepBatch:
        if self.tq == tq and self.index is not None:
            return self
        self.tq = tq
        shortest, fresh = self.known or (int(self.q_lens.min()), not bool(self.start.any()))
        steps = torch.arange(tq, device=self.start.device)
        self.pos = self.start[:, None] + steps if tq > 1 else self.start[:, None]  # [B, Tq]
        self.valid_mask = None if shortest >= tq else steps[None, :] < self.q_lens[:, None]  # [B, Tq]
        # Padding is on the right, so with no cached prefix a causal mask is exact for every real token.
        self.index = paged_index(self.block_table, self.pos, self.valid_mask, self.block_size, fresh)
        return self


class PagedKVCache:
    """Each layer's keys and values in one tensor [2, Hkv, N, Bs, Dh], read through a PagedIndex;
    latent attention stores one part, one head: [1, 1, N, Bs, kv_lora_rank + rope] (mla.py)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", parts: int = 2) -> None:
        _check_sizes(num_blocks, block_size)
        # zeros, not empty: attention weighs unread keys by 0, and 0 * NaN would still be NaN
        shape = (parts, num_kv_heads, num_blocks, block_size, head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

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


def _check_sizes(num_blocks: int, block_size: int) -> None:
    if block_size < 1 or num_blocks < 2:
        raise ValueError(f"need block_size >= 1 and num_blocks >= 2 (one is scratch), got {block_size}, {num_blocks}")


def block_hashes(tokens: Sequence[int], bs: int, end: int, parent: int | None = None, first: int = 0) -> Iterator[int]:
    """The ids of full blocks first..end-1 of `tokens`: each block's tokens chained with its parent's id."""
    for i in range(first, end):
        parent = hash((parent, tuple(tokens[i * bs : (i + 1) * bs])))
        yield parent


class OutOfBlocks(RuntimeError):
    """No free or evictable block is left (the scheduler's budget should prevent this)."""


@dataclass
class _Block:
    ref: int = 0
    hash: int | None = None  # set once the block is full and committed (then it is never written again)


class BlockAllocator:
    """Hands out blocks 1..N-1; reference counts; the prefix-cache index and its LRU of idle blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # never-cached free blocks (pop from the end)
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks no one holds, oldest first
        self.hits = self.queries = 0  # blocks reused from the prefix cache, of the full blocks looked up

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
        return block

    def free(self, block: int) -> None:
        b = self._blocks[block]
        if b.ref <= 0:
            raise ValueError(f"block {block} freed more often than it was held")
        b.ref -= 1
        if b.ref == 0 and b.hash is None:
            self._free.append(block)
        elif b.ref == 0:
            self._idle[block] = None  # cached: stays findable until evicted

    def commit(self, block: int, h: int) -> None:
        """`block` is full with the tokens behind hash `h`: make it findable."""
        b = self._blocks[block]
        if b.hash is not None or h in self._cached:  # the same prefix computed twice (in one batch): keep the first
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

    def is_cached(self, h: int) -> bool:
        return h in self._cached

    def is_committed(self, block: int) -> bool:
        return self._blocks[block].hash is not None


class BlockManager:
    """Which blocks each sequence holds, the tokens behind them, prefix caching; one per cache, no tensors."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        _check_sizes(num_blocks, block_size)
        self.allocator = BlockAllocator(num_blocks)
        self.block_size, self.prefix_caching = block_size, prefix_caching
        self.tables: dict[str, list[int]] = {}  # sequence -> its blocks, in position order
        self._tokens: dict[str, list[int]] = {}  # sequence -> the tokens at its positions so far
        self._hashes: dict[str, list[int]] = {}  # sequence -> hashes of its committed full blocks

    def __len__(self) -> int:
        return len(self.tables)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.tables

    def add(self, seq_id: str, token_ids: list[int] | tuple[int, ...] = ()) -> int:
        """Start a sequence; returns its leading tokens already cached (whole blocks, never the last token)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} is already running")
        bs = self.block_size
        full = (len(token_ids) - 1) // bs if self.prefix_caching else 0  # full blocks before the last token
        hashes = list(block_hashes(token_ids, bs, full))
        found = self.allocator.lookup(hashes)
        self.tables[seq_id] = found
        self._hashes[seq_id] = hashes[: len(found)]
        self._tokens[seq_id] = list(token_ids[: len(found) * bs])
        return len(found) * bs

    def cached_prefix(self, token_ids: list[int] | tuple[int, ...]) -> int:
        """How many leading tokens `add` would find cached now (nothing is taken)."""
        if not self.prefix_caching:
            return 0
        full = block_hashes(token_ids, self.block_size, (len(token_ids) - 1) // self.block_size)
        return self.block_size * sum(1 for _ in itertools.takewhile(self.allocator.is_cached, full))

    def remove(self, seq_id: str) -> None:
        for block in self.tables.pop(seq_id, ()):
            self.allocator.free(block)
        self._tokens.pop(seq_id, None)
        self._hashes.pop(seq_id, None)

    def write(self, seq_id: str, start: int, tokens: list[int], reserve: int = 0) -> list[tuple[int, int]]:
        """Make room for `tokens` at positions start.. (and `reserve` more). Tokens before `start`
        are final (committed); blocks past the end are freed. A shared or cached block about to be
        written is replaced by a private copy: returns those (src, dst) copies, to make before
        writing. OutOfBlocks leaves the sequence as it was."""
        bs, table, known = self.block_size, self.tables[seq_id], self._tokens[seq_id]
        del self._hashes[seq_id][start // bs :]  # blocks at or after `start` are no longer final
        self.commit(seq_id, start)
        a, need = self.allocator, -(-(start + len(tokens) + reserve) // bs)
        shared = [i for i in range(start // bs, min(need, len(table)))
                  if a.refcount(table[i]) > 1 or a.is_committed(table[i])]
        if len(shared) + max(need - len(table), 0) > a.num_free:
            raise OutOfBlocks(f"sequence {seq_id!r} needs more KV cache blocks than are free")
        copies = []
        for i in shared:
            block = table[i]
            table[i] = a.allocate()
            a.free(block)
            if i * bs < start:  # it keeps positions before `start`
                copies.append((block, table[i]))
        while len(table) > need:
            a.free(table.pop())
        while len(table) < need:
            table.append(a.allocate())
        del known[start:]
        known.extend(tokens)
        return copies

    def commit(self, seq_id: str, upto: int) -> None:
        """Tokens before `upto` are final: their full blocks become findable."""
        if not self.prefix_caching:
            return
        bs, hashes, tokens, table = self.block_size, self._hashes[seq_id], self._tokens[seq_id], self.tables[seq_id]
        new = block_hashes(tokens, bs, min(upto, len(tokens)) // bs, hashes[-1] if hashes else None, len(hashes))
        for i, h in enumerate(new, len(hashes)):
            hashes.append(h)
            self.allocator.commit(table[i], h)

    def record(self, seq_id: str, tokens: list[int]) -> None:
        """The tokens now at positions 0.. (after writes of one token at a time): what commits hash."""
        self._tokens[seq_id] = list(tokens)

    def stats(self) -> dict[str, int | float]:
        """Blocks in use and the prefix cache's counters (for /metrics)."""
        a, total = self.allocator, self.allocator.num_blocks - 1
        return {"kv_blocks_total": total, "kv_blocks_free": a.num_free, "kv_blocks_held": total - a.num_free,
                "prefix_cache_blocks": a.num_cached, "prefix_cache_hit_blocks": a.hits,
                "prefix_cache_query_blocks": a.queries, "prefix_cache_hit_tokens": a.hits * self.block_size,
                "prefix_cache_hit_rate": a.hits / max(a.queries, 1)}
