"""KV cache in per-sequence slots, and the per-step description of which slots a batch uses.

Shapes: S slots, L layers, Hkv key/value heads, Tmax tokens per slot, Dh head dim,
B batch rows, Tq query positions this step (rows shorter than Tq are padded).

A sequence owns one slot for its lifetime. Rolling back rejected speculative tokens is
free: the owner just lowers the sequence's length; stale entries past it are never read
(the attention mask stops at each row's own length) and are overwritten by the next step.
Each slot has one extra scratch column that absorbs the writes of padded query positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepBatch:
    """Which cache slots a forward pass reads and writes.

    slots:   [B] cache slot of each row
    start:   [B] tokens already cached for each row (position of the row's first query token)
    q_lens:  [B] valid query tokens in each row (<= Tq; the rest is padding)

    The per-step index tensors (positions, padding, attention mask) are built once by
    `prepare(Tq)` and shared by every layer.
    """

    slots: torch.Tensor
    start: torch.Tensor
    q_lens: torch.Tensor
    tq: int = 0
    pos: torch.Tensor | None = None  # [B, Tq] absolute position of each query token
    valid_mask: torch.Tensor | None = None  # [B, Tq] False at padding (None: no padding)
    tk: int = 0  # keys attention reads per row (the longest row after this step)
    attn_mask: torch.Tensor | None = None  # [B, 1, Tq, Tk] query i sees keys 0 .. pos[i]; None when fresh
    fresh: bool = False  # every row starts at position 0: plain causal attention over this step's keys
    rows: slice | torch.Tensor | None = None  # cache rows: a slice when slots are contiguous
    # Paged cache (model_shards/paged_kv.py) instead of slots: [B, nb] block ids, and where this
    # step's positions go ([B*Tq] block * block_size + offset; padding to the scratch block 0).
    block_table: torch.Tensor | None = None
    block_size: int = 0
    write_index: torch.Tensor | None = None

    @classmethod
    def build(
        cls, slots: list[int], start: list[int], q_lens: list[int], device: torch.device | str = "cpu"
    ) -> StepBatch:
        as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        return cls(as_long(slots), as_long(start), as_long(q_lens))

    def prepare(self, tq: int) -> StepBatch:
        if self.tq == tq and self.pos is not None:
            return self
        self.tq = tq
        self.pos = self.positions(tq)
        valid = self.valid(tq)
        self.valid_mask = None if bool(valid.all()) else valid
        self.tk = int((self.start + tq).max())
        # Padding is on the right, so with no cached prefix a causal mask is exact for every real token.
        self.fresh = not bool(self.start.any())
        keys = torch.arange(self.tk, device=self.pos.device)
        self.attn_mask = None if self.fresh else (keys[None, None, :] <= self.pos[:, :, None])[:, None]
        if self.block_table is not None:
            pos = self.pos if self.valid_mask is None else self.pos.masked_fill(~self.valid_mask, 0)
            blocks = self.block_table.gather(1, pos // self.block_size)  # [B, Tq]
            if self.valid_mask is not None:
                blocks = blocks.masked_fill(~self.valid_mask, 0)
            self.write_index = (blocks * self.block_size + pos % self.block_size).view(-1)  # [B*Tq]
            return self
        self.rows = self.contiguous_slots()
        if self.rows is None:
            self.rows = self.slots
        return self

    def positions(self, tq: int) -> torch.Tensor:
        return self.start[:, None] + torch.arange(tq, device=self.start.device)  # [B, Tq]

    def valid(self, tq: int) -> torch.Tensor:
        return torch.arange(tq, device=self.q_lens.device)[None, :] < self.q_lens[:, None]  # [B, Tq]

    def contiguous_slots(self) -> slice | None:
        """The slot range when rows are slots s, s+1, ...: attention can then read a view, not a copy."""
        slots = self.slots.tolist()
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            return slice(first, first + len(self.slots))
        return None


class KVCache:
    """Preallocated keys and values: per layer [S, Hkv, Tmax + 1, Dh]."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_slots <= 0 or max_len <= 0:
            raise ValueError(f"KVCache needs num_slots > 0 and max_len > 0, got {num_slots}, {max_len}")
        shape = (num_slots, num_kv_heads, max_len + 1, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's keys/values; k, v: [B, Hkv, Tq, Dh] (batch prepared for Tq)."""
        if batch.tk > self.max_len:
            raise ValueError(f"sequence longer than the KV cache ({self.max_len} tokens)")
        if len(batch.slots) == 1:  # one row: a plain slice copy, no index tensors
            slot, s0 = int(batch.slots[0]), int(batch.start[0])
            n = int(batch.q_lens[0])
            self.k[layer][slot, :, s0 : s0 + n] = k[0, :, :n]
            self.v[layer][slot, :, s0 : s0 + n] = v[0, :, :n]
            return
        pos = batch.pos if batch.valid_mask is None else torch.where(batch.valid_mask, batch.pos, self.max_len)
        rows = batch.slots[:, None]  # [B, 1]; padding goes to the scratch column
        # Advanced indices on dims 0 and 2 put the broadcast [B, Tq] first: values are [B, Tq, Hkv, Dh].
        self.k[layer][rows, :, pos] = k.transpose(1, 2)
        self.v[layer][rows, :, pos] = v.transpose(1, 2)

    def read(self, layer: int, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the batch's rows up to `batch.tk` positions: [B, Hkv, Tk, Dh]."""
        return self.k[layer][batch.rows, :, : batch.tk], self.v[layer][batch.rows, :, : batch.tk]

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Move a sequence between slots (used to keep the running batch in contiguous slots)."""
        for t in self.k + self.v:
            t[dst, :, :length] = t[src, :, :length]


class SlotTable:
    """Which sequence holds which cache slot. Slots stay contiguous (0..n-1): removing a
    sequence moves the last one into its hole, and `remove` returns that move for the cache."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot: dict[str, int] = {}
        self._owner: list[str] = []
        self._length: dict[str, int] = {}  # highest position written: how much a move must copy

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._slot

    @property
    def num_free(self) -> int:
        return self.num_slots - len(self._owner)

    def slot(self, seq_id: str) -> int:
        return self._slot[seq_id]

    def add(self, seq_id: str) -> int:
        if seq_id in self._slot:
            raise ValueError(f"sequence {seq_id!r} already has a slot")
        if not self.num_free:
            raise RuntimeError("no free KV cache slot")
        self._slot[seq_id] = len(self._owner)
        self._owner.append(seq_id)
        self._length[seq_id] = 0
        return self._slot[seq_id]

    def written(self, seq_id: str, length: int) -> None:
        self._length[seq_id] = max(self._length[seq_id], length)

    def remove(self, seq_id: str) -> tuple[int, int, int] | None:
        """Frees the sequence's slot; returns (src, dst, length) when another sequence must move."""
        slot = self._slot.pop(seq_id, None)
        if slot is None:
            return None
        self._length.pop(seq_id)
        last = self._owner.pop()
        if last == seq_id:
            return None
        self._owner[slot] = last
        self._slot[last] = slot
        return len(self._owner), slot, self._length[last]
