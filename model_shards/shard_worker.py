"""The shard group's step protocol over torch.distributed: rank 0 drives, the others follow.

Each rank holds the dense weights, its own experts and the KV cache of its own sequences
(data-parallel attention). Per step rank 0 broadcasts one message (slot moves + the rows of
every rank), every rank runs its rows (joining each MoE layer's all-to-all), and the final
hidden states are gathered to rank 0, which applies the LM head. Nothing per step goes
through Ray.

Message (int64): header [cmd, rows, Tq, last_only, moves, extra], then moves [M, 4]
(rank, src, dst, length), rows [B, 4 + Tq] (rank, slot, start, q_len, tokens...) and `extra`
more values. CMD_PLACE (live re-placement, between two steps) carries a placement in the
extra values: [experts on rank 0, ..., experts on rank W-1, then every rank's expert ids];
each rank reloads its experts from the checkpoint and re-wires its all-to-all, while the KV
caches (attention is data-parallel) stay as they are.
Shapes: B rows, Tq query tokens, D hidden, V vocab, W ranks.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from model_shards.all_to_all import AllToAllDispatch
from model_shards.kv_cache import SlotTable, StepBatch
from model_shards.loader import reload_experts
from model_shards.model import CausalLM
from router_service.placement import Placement

CMD_STEP, CMD_STOP, CMD_PLACE = 1, 2, 3
_HEADER = 6


def _broadcast(
    header: list[int] | None, body: torch.Tensor | None, device: torch.device
) -> tuple[list[int], torch.Tensor]:
    """Rank 0 sends (header, body), the others receive them; tensors on the group's device."""
    if header is not None:
        h = torch.tensor(header, dtype=torch.long, device=device)
    else:
        h = torch.empty(_HEADER, dtype=torch.long, device=device)
    dist.broadcast(h, src=0)
    header = h.tolist()
    _, rows, tq, _, moves, extra = header
    size = moves * 4 + rows * (4 + tq) + extra
    body = body.to(device) if body is not None else torch.empty(size, dtype=torch.long, device=device)
    if size:
        dist.broadcast(body, src=0)
    return header, body


def _split(header: list[int], body: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, rows, tq, _, moves, _ = header
    return body[: moves * 4].view(moves, 4), body[moves * 4 : moves * 4 + rows * (4 + tq)].view(rows, 4 + tq)


def _encode_placement(placement: Placement) -> list[int]:
    sizes = [len(r) for r in placement.rank_experts]
    return sizes + [e for r in placement.rank_experts for e in r]


def _decode_placement(world_size: int, values: list[int]) -> Placement:
    sizes, ids = values[:world_size], values[world_size:]
    bounds = [sum(sizes[:r]) for r in range(world_size + 1)]
    return Placement(tuple(tuple(ids[bounds[r] : bounds[r + 1]]) for r in range(world_size)))


class _Shard:
    """What every rank does with a step message."""

    def __init__(self, model: CausalLM, rank: int, world_size: int, max_num_seqs: int, max_model_len: int) -> None:
        self.model, self.rank, self.world_size = model, rank, world_size
        self.device = model.device
        self.cache = model.make_cache(max_num_seqs, max_model_len)

    def place(self, placement: Placement) -> None:
        """Hold `placement`'s experts for this rank from now on (every rank does this together)."""
        reload_experts(self.model, placement.rank_experts[self.rank])
        self.model.set_dispatch(AllToAllDispatch(placement, self.rank))

    def run(self, header: list[int], body: torch.Tensor) -> torch.Tensor:
        """Apply this rank's slot moves, run its rows, gather hidden states to rank 0.
        Returns [W, Bmax, T', D] on rank 0 (padding rows are zeros), an empty tensor elsewhere."""
        _, _, tq, last_only, _, _ = header
        moves, rows = _split(header, body)
        for _, src, dst, length in moves[moves[:, 0] == self.rank].tolist():
            self.cache.copy_slot(src, dst, length)
        mine = rows[rows[:, 0] == self.rank]  # [Br, 4 + Tq]
        ids = mine[:, 4:]
        if len(mine):
            batch = StepBatch(slots=mine[:, 1], start=mine[:, 2], q_lens=mine[:, 3])
            h = self.model.hidden_states(ids, self.cache, batch, last_only=bool(last_only))  # [Br, T', D]
        else:
            h = self.model.hidden_states(ids, last_only=bool(last_only))
        counts = torch.bincount(rows[:, 0], minlength=self.world_size)
        padded = h.new_zeros(int(counts.max()), 1 if last_only else tq, h.shape[-1])  # [Bmax, T', D]
        padded[: len(h)] = h
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(padded, gathered, dst=0)
        return torch.stack(gathered) if gathered is not None else h.new_empty(0)


class ShardWorker(_Shard):
    """Ranks 1..W-1: follow rank 0's messages until told to stop (or the group breaks)."""

    def serve_forever(self) -> None:
        while True:
            header, body = _broadcast(None, None, self.device)
            if header[0] == CMD_STOP:
                return
            if header[0] == CMD_PLACE:
                self.place(_decode_placement(self.world_size, body.tolist()))
            else:
                self.run(header, body)


class ShardedRunner(_Shard):
    """Rank 0: the engine's model runner for a whole shard group (same interface as ModelRunner).
    `max_num_seqs` is per rank; sequences go to the rank with the fewest."""

    def __init__(self, model: CausalLM, world_size: int, max_num_seqs: int, max_model_len: int) -> None:
        super().__init__(model, 0, world_size, max_num_seqs, max_model_len)
        self.max_model_len = max_model_len
        self.vocab_size = model.config.vocab_size
        self.tables = [SlotTable(max_num_seqs) for _ in range(world_size)]
        self._rank_of: dict[str, int] = {}
        self._moves: list[tuple[int, int, int, int]] = []  # sent with the next step

    @property
    def max_num_seqs(self) -> int:
        return sum(t.num_slots for t in self.tables)

    @property
    def num_free_slots(self) -> int:
        return sum(t.num_free for t in self.tables)

    def add(self, seq_id: str, token_ids: list[int] | tuple[int, ...] = ()) -> int:
        """Give the sequence a slot on the least busy rank; returns 0 (no prefix cache here)."""
        rank = min(range(self.world_size), key=lambda r: (len(self.tables[r]), r))
        self.tables[rank].add(seq_id)
        self._rank_of[seq_id] = rank
        return 0

    def remove(self, seq_id: str) -> None:
        rank = self._rank_of.pop(seq_id, None)
        if rank is None:
            return
        move = self.tables[rank].remove(seq_id)
        if move is not None:
            self._moves.append((rank, *move))

    def forward(self, rows: list, logits: Literal["all", "last"] = "last") -> torch.Tensor:
        """rows: engine Rows (seq_id, tokens, start). Returns logits [B, V] or [B, Tq, V] in row order."""
        tq = max(len(r.tokens) for r in rows)
        packed = torch.zeros(len(rows), 4 + tq, dtype=torch.long)  # [B, 4 + Tq]
        for i, r in enumerate(rows):
            if r.start + len(r.tokens) > self.max_model_len:
                raise ValueError(f"sequence {r.seq_id!r} exceeds max_model_len={self.max_model_len}")
            rank = self._rank_of[r.seq_id]
            self.tables[rank].written(r.seq_id, r.start + len(r.tokens))
            packed[i, :4] = torch.tensor([rank, self.tables[rank].slot(r.seq_id), r.start, len(r.tokens)])
            packed[i, 4 : 4 + len(r.tokens)] = torch.tensor(r.tokens)
        # Within a rank, rows in slot order: attention then reads contiguous cache views.
        order = torch.argsort(packed[:, 0] * (1 << 20) + packed[:, 1])
        packed = packed[order]
        moves = torch.tensor(self._moves, dtype=torch.long).view(-1, 4)
        self._moves = []
        header = [CMD_STEP, len(rows), tq, int(logits == "last"), len(moves), 0]
        header, body = _broadcast(header, torch.cat([moves.view(-1), packed.view(-1)]), self.device)
        gathered = self.run(header, body)  # [W, Bmax, T', D]
        ranks = packed[:, 0]
        within = torch.cat([torch.arange(int(c)) for c in torch.bincount(ranks, minlength=self.world_size)])
        h = gathered[ranks.to(self.device), within.to(self.device)]  # [B, T', D] in packed order
        out = self.model.lm_logits(h).cpu()
        out = out[:, 0] if logits == "last" else out
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return out[inverse]

    def replace(self, placement: Placement) -> None:
        """Live re-placement: every rank moves to `placement` before the next step (call it
        between steps). Sequences, their ranks and KV caches are untouched."""
        if placement.world_size != self.world_size:
            raise ValueError(f"placement has {placement.world_size} ranks, the group {self.world_size}")
        values = _encode_placement(placement)
        _broadcast([CMD_PLACE, 0, 0, 0, 0, len(values)], torch.tensor(values, dtype=torch.long), self.device)
        self.place(placement)

    def shutdown(self) -> None:
        _broadcast([CMD_STOP, 0, 0, 0, 0, 0], None, self.device)
