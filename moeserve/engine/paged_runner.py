"""The model runner over a paged KV cache (model_shards/paged_kv.py), with prefix caching.

Same interface as ModelRunner (add / remove / forward), except that `add` is told the
sequence's tokens and answers how many leading ones the prefix cache already holds: the
engine then feeds only the rest.

What a forward pass does to a sequence's blocks:
- positions before a row's `start` are committed (the engine feeds from its cached length, so
  rejected draft tokens are never behind it): full blocks among them are hashed and become
  findable by later sequences;
- blocks past what this pass writes held only rejected draft tokens: they are freed;
- blocks are allocated for the positions this pass writes; a prefill's or plain decode's
  tokens are committed right after the pass (a verify pass's drafts only at the next one).
Shared blocks are never written: a prefix hit ends on a block boundary before the last
prompt token, so every position a sequence writes lies in a block of its own.
"""

from __future__ import annotations

from typing import Literal

import torch

from model_shards import CausalLM
from model_shards.paged_kv import BlockAllocator, PagedKVCache, block_hash, paged_step_batch
from moeserve.engine.model_runner import Row

INITIAL_BLOCKS = 64  # the cache starts with this many blocks and doubles as sequences need more


class PagedRunner:
    """Target model + a paged KV cache of `num_blocks` blocks of `block_size` tokens (block 0 is
    scratch) for up to `max_num_seqs` sequences of up to `max_model_len` tokens."""

    compiled = None  # the compiled step reads slot views; the paged cache runs eager

    def __init__(self, model: CausalLM, max_num_seqs: int, max_model_len: int, num_blocks: int,
                 block_size: int = 16, prefix_caching: bool = True) -> None:
        cfg, w = model.config, model.lm_head.weight
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.vocab_size = cfg.vocab_size
        self.device = model.device
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.cache = PagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, w.dtype,
                                  w.device, initial_blocks=INITIAL_BLOCKS)
        self.blocks = BlockAllocator(num_blocks)
        self._tables: dict[str, list[int]] = {}  # sequence -> its blocks, in position order
        self._tokens: dict[str, list[int]] = {}  # sequence -> the tokens at its positions so far
        self._hashes: dict[str, list[int]] = {}  # sequence -> hashes of its committed full blocks

    @property
    def num_free_slots(self) -> int:
        return self.max_num_seqs - len(self._tables)

    def add(self, seq_id: str, token_ids: list[int] | tuple[int, ...] = ()) -> int:
        """Start a sequence; returns how many of its leading tokens are already cached (a
        multiple of the block size, always leaving the last token to compute)."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} is already running")
        if len(self._tables) >= self.max_num_seqs:
            raise RuntimeError("no room for another sequence")
        bs = self.block_size
        hashes: list[int] = []
        if self.prefix_caching:
            for i in range((len(token_ids) - 1) // bs):  # full blocks before the last token
                hashes.append(block_hash(hashes[-1] if hashes else None, tuple(token_ids[i * bs : (i + 1) * bs])))
        found = self.blocks.lookup(hashes)
        self._tables[seq_id] = found
        self._hashes[seq_id] = hashes[: len(found)]
        self._tokens[seq_id] = list(token_ids[: len(found) * bs])
        return len(found) * bs

    def remove(self, seq_id: str) -> None:
        for block in self._tables.pop(seq_id, ()):
            self.blocks.free(block)
        self._tokens.pop(seq_id, None)
        self._hashes.pop(seq_id, None)

    def forward(self, rows: list[Row], logits: Literal["all", "last"] = "last") -> torch.Tensor:
        """Logits [B, V] at each row's last token ("last") or [B, Tq, V] for every fed token ("all")."""
        bs = self.block_size
        for r in rows:
            end = r.start + len(r.tokens)
            if end > self.max_model_len:
                raise ValueError(f"sequence {r.seq_id!r} exceeds max_model_len={self.max_model_len}")
            self._commit(r.seq_id, r.start)
            table, tokens = self._tables[r.seq_id], self._tokens[r.seq_id]
            need = -(-end // bs)
            while len(table) > need:  # rejected drafts' blocks
                self.blocks.free(table.pop())
            while len(table) < need:
                table.append(self.blocks.allocate())
            del tokens[r.start :]
            tokens.extend(r.tokens)
        self.cache.reserve(self.blocks.high_water)
        tq = max(len(r.tokens) for r in rows)
        ids = torch.tensor([r.tokens + [0] * (tq - len(r.tokens)) for r in rows], dtype=torch.long,
                           device=self.device)  # [B, Tq]
        batch = paged_step_batch([self._tables[r.seq_id] for r in rows], [r.start for r in rows],
                                 [len(r.tokens) for r in rows], bs, self.device)
        out = self.model(ids, self.cache, batch, logits=logits)
        if logits == "last":  # prefill or plain decode: every fed token is final
            for r in rows:
                self._commit(r.seq_id, r.start + len(r.tokens))
        return out.to("cpu", copy=True)  # a normal tensor (not an inference one): grammar masks write into it

    def _commit(self, seq_id: str, upto: int) -> None:
        """Tokens before `upto` are final: their full blocks become findable."""
        if not self.prefix_caching:
            return
        bs, hashes, tokens, table = self.block_size, self._hashes[seq_id], self._tokens[seq_id], self._tables[seq_id]
        for i in range(len(hashes), min(upto, len(tokens)) // bs):
            hashes.append(block_hash(hashes[-1] if hashes else None, tuple(tokens[i * bs : (i + 1) * bs])))
            self.blocks.commit(table[i], hashes[-1])

    def stats(self) -> dict[str, int]:
        """Blocks in use and the prefix cache's counters (for /metrics)."""
        total = self.blocks.num_blocks - 1
        return {"kv_blocks_total": total, "kv_blocks_free": self.blocks.num_free,
                "kv_bytes_allocated": self.cache.nbytes,
                "kv_blocks_held": total - self.blocks.num_free, "prefix_cache_blocks": self.blocks.num_cached,
                "prefix_cache_hit_blocks": self.blocks.hits, "prefix_cache_query_blocks": self.blocks.queries,
                "prefix_cache_hit_tokens": self.blocks.hits * self.block_size,
                "prefix_cache_hit_rate": self.blocks.hits / max(self.blocks.queries, 1)}
