"""Runs the model for an engine step over its paged KV cache (model_shards/kv_cache.py), with prefix caching.

Shapes: B rows, Tq query tokens (the longest row; shorter rows are padded), V vocab.

A prefill's or plain decode's tokens are committed right after the pass, a verify pass's drafts
only at the next one (BlockManager.write).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from model_shards import CausalLM
from model_shards.kv_cache import BlockManager, PagedKVCache, StepBatch
from model_shards.model import split_routing
from moeserve.config import EngineSection, default_of

# A pass's fixed overhead (per-op dispatch, one read of every weight) in token positions, for the
# demo model on CPU: prefill groups split only when that saves more padding than it costs.
FORWARD_OVERHEAD_TOKENS = 256


def length_groups(lengths: list[int], overhead_tokens: int = FORWARD_OVERHEAD_TOKENS) -> list[list[int]]:
    """Row indices grouped into forward passes (longest rows first), minimising padded positions
    plus `overhead_tokens` per pass: dynamic programming over runs of the rows sorted by length."""
    n = len(lengths)
    if n and max(lengths) * n - sum(lengths) <= overhead_tokens:
        return [list(range(n))]  # a second pass costs more than all the padding it could save
    order = sorted(range(n), key=lambda i: -lengths[i])
    best = [0] + [float("inf")] * n  # best[j]: cheapest cost of the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # rows i..j-1 in one pass, padded to the longest, lengths[order[i]]
            cost = best[i] + overhead_tokens + (j - i) * lengths[order[i]]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


@dataclass(frozen=True)
class Row:
    """One sequence in a forward pass: `tokens` are appended to its cache at position `start`."""

    seq_id: str
    tokens: list[int]
    start: int


def forward_last(runner, rows: list[Row], **kwargs) -> torch.Tensor:
    """Logits [B, V] at each row's last token, in row order, rows grouped by length_groups.
    `runner`: a ModelRunner or anything with its forward() (which gets `kwargs`)."""
    groups = length_groups([len(r.tokens) for r in rows])
    if len(groups) == 1:
        return runner.forward(rows, logits="last", **kwargs)
    logits = torch.empty(len(rows), runner.vocab_size)  # [B, V]
    for group in groups:
        logits[group] = runner.forward([rows[i] for i in group], logits="last", **kwargs)
    return logits


def routing_by_row(trace: list, rows: list[Row], tq: int) -> dict[str, list[tuple]]:
    """The routing one pass recorded, by sequence id (see model_shards.model.split_routing)."""
    return dict(zip((r.seq_id for r in rows), split_routing(trace, [len(r.tokens) for r in rows], tq)))


class ModelRunner:
    """The model + a paged KV cache of `num_blocks` blocks of `block_size` tokens (block 0 is
    scratch; 0: room for `max_num_seqs` sequences of `max_model_len` tokens). The cache lives on
    the model's device; logits come back on the CPU (one copy per step), where sampling, grammar
    masks and verification run. compile: decode and verify passes as a compiled graph
    (model_shards/compiled_step.py) when the batch allows it; the rest stays eager."""

    def __init__(self, model: CausalLM, max_num_seqs: int, max_model_len: int, num_blocks: int = 0,
                 block_size: int = default_of(EngineSection, "block_size"),
                 prefix_caching: bool = default_of(EngineSection, "prefix_caching"), compile: bool = False) -> None:
        cfg, w = model.config, model.lm_head.weight
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.vocab_size = cfg.vocab_size
        self.device = model.device
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        num_blocks = num_blocks or max_num_seqs * -(-max_model_len // block_size) + 1
        self.cache = PagedKVCache.for_model(cfg, num_blocks, block_size, w.dtype, w.device)
        self.manager = BlockManager(num_blocks, block_size, prefix_caching)
        self.blocks = self.manager.allocator
        self.routing: dict[str, list[tuple]] = {}  # while routing is recorded: the last passes' (routing_by_row)
        self.compiled = None  # decode and verify passes as a compiled graph (model_shards/compiled_step.py)
        if compile:
            from model_shards.compiled_step import CompiledStep

            self.compiled = CompiledStep(model, self.cache)

    @property
    def num_free_slots(self) -> int:
        return self.max_num_seqs - len(self.manager)

    def add(self, seq_id: str, token_ids: list[int] | tuple[int, ...] = ()) -> int:
        """Start a sequence; returns how many of its leading tokens are already cached (a
        multiple of the block size, always leaving the last token to compute)."""
        if len(self.manager) >= self.max_num_seqs and seq_id not in self.manager:
            raise RuntimeError("no room for another sequence")
        return self.manager.add(seq_id, token_ids)

    def remove(self, seq_id: str) -> None:
        self.manager.remove(seq_id)

    def prepare(self, seq_id: str, start: int, tokens: list[int], reserve: int = 0) -> None:
        """Blocks for `tokens` at positions start.. and `reserve` more (see BlockManager.write)."""
        end = start + len(tokens) + reserve
        if end > self.max_model_len:
            raise ValueError(f"sequence {seq_id!r} exceeds max_model_len={self.max_model_len}")
        self.cache.copy_blocks(self.manager.write(seq_id, start, tokens, reserve))

    def block_tables(self, seq_ids: list[str], width: int = 0) -> torch.Tensor:
        """[B, nb] block ids of these sequences (padded with the scratch block), on the cache's device."""
        tables = [self.manager.tables[s] for s in seq_ids]
        width = max(width, *map(len, tables))
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=self.device)

    def forward(self, rows: list[Row], logits: Literal["all", "last"] = "last", prepared: bool = False) -> torch.Tensor:
        """Logits [B, V] at each row's last token ("last") or [B, Tq, V] for every fed token ("all").
        prepared: the rows' blocks were set up by `prepare` already (with room for what comes after)."""
        if not prepared:
            for r in rows:
                self.prepare(r.seq_id, r.start, r.tokens)
        tq = max(len(r.tokens) for r in rows)
        ids = torch.tensor([r.tokens + [0] * (tq - len(r.tokens)) for r in rows], dtype=torch.long,
                           device=self.device)  # [B, Tq]
        starts, q_lens = [r.start for r in rows], [len(r.tokens) for r in rows]
        trace = self.model.routing_trace
        if trace is not None:
            trace.clear()
        if self.compiled is not None and min(starts) > 0 and self.compiled.accepts(len(rows), tq):
            width = -(-(max(starts) + tq) // self.block_size)
            out = self.compiled(ids, self.block_tables([r.seq_id for r in rows], width), starts, q_lens)  # [B, Tq, V]
            if logits == "last":
                out = out[torch.arange(len(rows), device=out.device), torch.tensor(q_lens, device=out.device) - 1]
        else:
            batch = StepBatch.build([self.manager.tables[r.seq_id] for r in rows], starts, q_lens, self.block_size,
                                    self.device)
            out = self.model(ids, self.cache, batch, logits=logits)
        if trace is not None:
            self.routing.update(routing_by_row(trace, rows, tq))
        if logits == "last" and not prepared:  # prefill or plain decode: every fed token is final
            for r in rows:
                self.manager.commit(r.seq_id, r.start + len(r.tokens))
        return out.to("cpu", copy=True)  # a normal tensor (not an inference one): grammar masks write into it

    def stats(self) -> dict[str, int | float]:
        """Blocks in use and the prefix cache's counters (for /metrics)."""
        return {**self.manager.stats(), "kv_bytes_allocated": self.cache.nbytes}
