"""Runs the target model for an engine step: owns the KV cache and which slot each sequence holds.

Shapes: B rows, Tq query tokens (the longest row; shorter rows are padded), V vocab.

Sequences are kept in slots 0..n-1 (a finished sequence's hole is filled by moving the last
one in), so a step's rows are contiguous slots and attention reads cache views, not copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from model_shards import CausalLM, StepBatch
from model_shards.kv_cache import SlotTable
from model_shards.model import split_routing

# A forward pass costs about as much fixed overhead (per-op dispatch, one pass over every
# weight) as this many extra token positions: the ratio of a pass's fixed cost to one position's
# for the demo model on CPU. Prefill groups only split when that saves more padding than it costs.
FORWARD_OVERHEAD_TOKENS = 256


def length_groups(lengths: list[int], overhead_tokens: int = FORWARD_OVERHEAD_TOKENS) -> list[list[int]]:
    """Split rows of these lengths into forward passes, minimising the padded token positions
    computed plus `overhead_tokens` per pass. A pass pads its rows to its longest one, so the
    best groups are runs of the rows sorted by length (dynamic programming over the runs).
    Returns lists of row indices; when there are several passes, the longest rows come first."""
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
    """Logits [B, V] at each row's last token, in row order; rows of very different lengths
    (prompts being prefilled) run as separate passes, each padded only to its own longest
    row (length_groups). `runner`: a ModelRunner or anything with its forward() (which gets `kwargs`)."""
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
    """Target model + KV cache for up to `max_num_seqs` sequences of up to `max_model_len` tokens.

    The cache and every per-step tensor live on the model's device; logits come back on the
    CPU (one copy per step), where sampling, grammar masks and verification run.
    compile: run decode and verify passes as a compiled graph (model_shards/compiled_step.py)
    whenever the batch allows it; prefill and anything else stays eager."""

    def __init__(self, model: CausalLM, max_num_seqs: int, max_model_len: int, compile: bool = False) -> None:
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.vocab_size = model.config.vocab_size
        self.device = model.device
        self.cache = model.make_cache(max_num_seqs, max_model_len)
        self.slots = SlotTable(max_num_seqs)
        self.routing: dict[str, list[tuple]] = {}  # while routing is recorded: the last passes' (routing_by_row)
        self.compiled = None
        if compile:
            from model_shards.compiled_step import CompiledStep

            self.compiled = CompiledStep(model, self.cache)

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free

    def add(self, seq_id: str, token_ids: list[int] | tuple[int, ...] = ()) -> int:
        """Give the sequence a slot; returns how many of its tokens are cached already (none here)."""
        self.slots.add(seq_id)
        return 0

    def remove(self, seq_id: str) -> None:
        move = self.slots.remove(seq_id)
        if move is not None:
            self.cache.copy_slot(*move)

    def forward(self, rows: list[Row], logits: Literal["all", "last"] = "last") -> torch.Tensor:
        """Logits [B, V] at each row's last token ("last") or [B, Tq, V] for every fed token ("all"),
        in the order of `rows`."""
        order = sorted(range(len(rows)), key=lambda i: self.slots.slot(rows[i].seq_id))
        tq = max(len(r.tokens) for r in rows)
        ids = [rows[i].tokens + [0] * (tq - len(rows[i].tokens)) for i in order]
        ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [B, Tq]
        ordered = [rows[i] for i in order]
        lists = batch_lists(self.slots, ordered)
        trace = self.model.routing_trace
        if trace is not None:
            trace.clear()
        for r in ordered:
            if r.start + len(r.tokens) > self.max_model_len:
                raise ValueError(f"sequence {r.seq_id!r} exceeds max_model_len={self.max_model_len}")
            self.slots.written(r.seq_id, r.start + len(r.tokens))
        if self._use_compiled(ordered, tq, lists[0]):
            out = self.compiled(ids, *lists)  # [B, Tq, V]
            if logits == "last":
                last = torch.tensor(lists[2], device=out.device) - 1
                out = out[torch.arange(len(ordered), device=out.device), last]  # [B, V]
        else:
            out = self.model(ids, self.cache, StepBatch.build(*lists, device=self.device), logits=logits)
        if trace is not None:
            self.routing.update(routing_by_row(trace, ordered, tq))
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return out.cpu()[inverse]

    def _use_compiled(self, rows: list[Row], tq: int, slots: list[int]) -> bool:
        """Decode and verify passes (every row has cached tokens before it) that the graph takes."""
        return self.compiled is not None and all(r.start > 0 for r in rows) and self.compiled.accepts(len(rows), tq,
                                                                                                      slots)


def batch_lists(slots: SlotTable, rows: list[Row]) -> tuple[list[int], list[int], list[int]]:
    """(slot, start, query length) of each row."""
    return [slots.slot(r.seq_id) for r in rows], [r.start for r in rows], [len(r.tokens) for r in rows]
