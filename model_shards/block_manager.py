"""Which KV cache blocks each sequence holds: block tables, reference counts and automatic prefix caching.

Bookkeeping only (no tensors); the blocks themselves are model_shards/kv_cache.py's. Block 0 is
scratch: padded query positions write there, and block tables are padded with it. A sequence
holds ceil(tokens / Bs) blocks (Bs tokens each), listed in its block table, and gets more as it
grows; the allocator hands out the lowest free ids first.

Prefix caching (vLLM's automatic prefix caching): a block whose Bs tokens are all committed is
identified by a hash of those tokens chained with its parent block's hash, so equal hashes
mean equal prefixes. A new sequence reuses the longest chain of cached blocks matching its
tokens (their reference counts go up; they are never written again). A block no sequence
holds stays cached, least recently used first out, until an allocation needs it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

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

    def is_cached(self, h: int) -> bool:
        return h in self._cached

    def is_committed(self, block: int) -> bool:
        return self._blocks[block].hash is not None


class BlockManager:
    """Which blocks each sequence holds: block tables, the tokens behind them and prefix caching.
    Bookkeeping only (no tensors): the model runner owns one per cache, a shard group one per rank."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.tables: dict[str, list[int]] = {}  # sequence -> its blocks, in position order
        self._tokens: dict[str, list[int]] = {}  # sequence -> the tokens at its positions so far
        self._hashes: dict[str, list[int]] = {}  # sequence -> hashes of its committed full blocks

    def __len__(self) -> int:
        return len(self.tables)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.tables

    def add(self, seq_id: str, token_ids: list[int] | tuple[int, ...] = ()) -> int:
        """Start a sequence; returns how many of its leading tokens are already cached (a
        multiple of the block size, always leaving the last token to compute)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} is already running")
        bs = self.block_size
        hashes: list[int] = []
        if self.prefix_caching:
            for i in range((len(token_ids) - 1) // bs):  # full blocks before the last token
                hashes.append(block_hash(hashes[-1] if hashes else None, tuple(token_ids[i * bs : (i + 1) * bs])))
        found = self.allocator.lookup(hashes)
        self.tables[seq_id] = found
        self._hashes[seq_id] = hashes[: len(found)]
        self._tokens[seq_id] = list(token_ids[: len(found) * bs])
        return len(found) * bs

    def cached_prefix(self, token_ids: list[int] | tuple[int, ...]) -> int:
        """How many leading tokens `add` would find cached now (nothing is taken)."""
        if not self.prefix_caching:
            return 0
        bs, h, n = self.block_size, None, 0
        for i in range((len(token_ids) - 1) // bs):
            h = block_hash(h, tuple(token_ids[i * bs : (i + 1) * bs]))
            if not self.allocator.is_cached(h):
                break
            n += bs
        return n

    def remove(self, seq_id: str) -> None:
        for block in self.tables.pop(seq_id, ()):
            self.allocator.free(block)
        self._tokens.pop(seq_id, None)
        self._hashes.pop(seq_id, None)

    def write(self, seq_id: str, start: int, tokens: list[int], reserve: int = 0) -> list[tuple[int, int]]:
        """Make room for `tokens` at positions start.. (and `reserve` more positions after them).

        Tokens before `start` are final: their full blocks become findable. Blocks past the end
        (rejected drafts) are freed. A block this write would touch that others share or the
        prefix cache holds (the sequence rewound into it) is first replaced by a block of its
        own: the returned (src, dst) pairs are the block copies the cache must make before
        writing. May raise OutOfBlocks (then the sequence holds what it held before)."""
        bs, table, known = self.block_size, self.tables[seq_id], self._tokens[seq_id]
        hashes = self._hashes[seq_id]
        del hashes[start // bs :]  # blocks at or after `start` are no longer final
        self.commit(seq_id, start)
        need = -(-(start + len(tokens) + reserve) // bs)
        a = self.allocator
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
        for i in range(len(hashes), min(upto, len(tokens)) // bs):
            hashes.append(block_hash(hashes[-1] if hashes else None, tuple(tokens[i * bs : (i + 1) * bs])))
            self.allocator.commit(table[i], hashes[-1])

    def record(self, seq_id: str, tokens: list[int]) -> None:
        """The tokens now at the sequence's positions 0.. (after writes whose tokens came one by
        one, e.g. a draft's own proposals): what later commits hash."""
        self._tokens[seq_id] = list(tokens)

    def stats(self) -> dict[str, int | float]:
        """Blocks in use and the prefix cache's counters (for /metrics)."""
        a = self.allocator
        total = a.num_blocks - 1
        return {"kv_blocks_total": total, "kv_blocks_free": a.num_free, "kv_blocks_held": total - a.num_free,
                "prefix_cache_blocks": a.num_cached, "prefix_cache_hit_blocks": a.hits,
                "prefix_cache_query_blocks": a.queries, "prefix_cache_hit_tokens": a.hits * self.block_size,
                "prefix_cache_hit_rate": a.hits / max(a.queries, 1)}
