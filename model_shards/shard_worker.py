"""The shard group's step protocol over torch.distributed: rank 0 drives, the others follow.

Each rank holds the dense weights, its own experts and its own sequences' KV cache (data-parallel
attention); rank 0 keeps every rank's block tables. Per step rank 0 broadcasts one message, every
rank runs its rows (joining the all-to-all), and hidden states are gathered to rank 0 for the LM
head. Nothing per step goes through Ray.

Message (int64): header [cmd, rows, Tq, last_only, copies, n, trace], then
- CMD_STEP: copies [C, 3] (rank, src block, dst block: copy-on-write before the step) and rows
  [B, 3 + Tq + n] (rank, start, q_len, tokens..., n block ids padded with the scratch block 0);
  with `trace`, every rank also gathers its rows' routing to rank 0;
- CMD_PLACE (live re-placement, between steps): n values, each rank's expert count, then every
  rank's expert ids; each rank reloads its experts and re-wires its all-to-all (caches stay).
Shapes: B rows, Tq query tokens, D hidden, V vocab, W ranks.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from model_shards.all_to_all import AllToAllDispatch, wait_for_group
from model_shards.kv_cache import BlockManager, PagedKVCache, StepBatch
from model_shards.loader import reload_experts
from model_shards.model import CausalLM, split_routing
from moeserve.config import EngineSection, default_of
from router_service.placement import Placement

CMD_STEP, CMD_STOP, CMD_PLACE = 1, 2, 3
_HEADER = 7
_ROW = 3  # rank, start, q_len
BALANCE_SLACK = 2  # see ShardedRunner


def _body_size(header: list[int]) -> int:
    cmd, rows, tq, _, copies, n, _ = header
    return n if cmd == CMD_PLACE else copies * 3 + rows * (_ROW + tq + n)


def _broadcast(header: list[int] | None, body: torch.Tensor | None, group) -> tuple[list, torch.Tensor]:
    """Rank 0 sends (header, body), the others receive them, over gloo: plans stay on the host."""
    h = torch.tensor(header, dtype=torch.long) if header is not None else torch.empty(_HEADER, dtype=torch.long)
    dist.broadcast(h, src=0, group=group)
    header = h.tolist()
    size = _body_size(header)
    body = body.cpu() if body is not None else torch.empty(size, dtype=torch.long)
    if size:
        dist.broadcast(body, src=0, group=group)
    return header, body


def _split(header: list[int], body: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, rows, tq, _, copies, n, _ = header
    return body[: copies * 3].view(copies, 3), body[copies * 3 :].view(rows, _ROW + tq + n)


def _encode_placement(placement: Placement) -> list[int]:
    sizes = [len(r) for r in placement.rank_experts]
    return sizes + [e for r in placement.rank_experts for e in r]


def _decode_placement(world_size: int, values: list[int]) -> Placement:
    sizes, ids = values[:world_size], values[world_size:]
    bounds = [sum(sizes[:r]) for r in range(world_size + 1)]
    return Placement(tuple(tuple(ids[bounds[r] : bounds[r + 1]]) for r in range(world_size)))


class _Shard:
    """What every rank does with a step message."""

    def __init__(self, model: CausalLM, rank: int, world_size: int, max_num_seqs: int, max_model_len: int,
                 block_size: int = default_of(EngineSection, "block_size"), compile: bool = False) -> None:
        self.model, self.rank, self.world_size = model, rank, world_size
        self.device = model.device
        self.block_size = block_size
        self.num_blocks = max_num_seqs * -(-max_model_len // block_size) + 1  # room for every sequence (+ scratch)
        cfg, w = model.config, model.lm_head.weight
        self.cache = PagedKVCache.for_model(cfg, self.num_blocks, block_size, w.dtype, w.device)  # all reserved now
        self.compiled = None  # decode and verify passes compiled between the collectives (compiled_step.py)
        if compile:
            from model_shards.compiled_step import CompiledShardStep

            self.compiled = CompiledShardStep(model, self.cache)
            self.compiled.warm_up()  # this rank's graphs alone: they hold no collective
        # step messages on the host: the default group when it is gloo, else a gloo group beside NCCL's
        self.host_group = None if not dist.is_initialized() or dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        wait_for_group(rank, world_size)  # no step before every rank is ready: a collective would time out

    def place(self, placement: Placement) -> None:
        """Hold `placement`'s experts for this rank from now on (every rank does this together)."""
        reload_experts(self.model, placement.rank_experts[self.rank])
        current = self.model.moe_blocks[0].dispatch
        padded = current.padded if isinstance(current, AllToAllDispatch) else None  # the layout stays
        self.model.set_dispatch(AllToAllDispatch(placement, self.rank, padded=padded))

    def run(self, header: list[int], body: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
        """Copy this rank's blocks, run its rows, gather hidden states [W, Bmax, T', D] to rank 0
        (elsewhere: empty); traced, also every rank's expert ids and weights [W, Bmax, Tq, L', K]."""
        _, _, tq, last_only, _, _, traced = header
        if bool(traced) != (self.model.routing_trace is not None):
            self.model.record_routing(bool(traced))
        trace = self.model.routing_trace
        if trace is not None:
            trace.clear()
        copies, rows = _split(header, body)
        mine = rows[rows[:, 0] == self.rank]  # [Br, 3 + Tq + n]
        counts = torch.bincount(rows[:, 0], minlength=self.world_size)  # [W] rows per rank
        bmax = int(counts.max())
        dispatch = self.model.moe_blocks[0].dispatch if self.model.moe_blocks else None  # every layer's
        if isinstance(dispatch, AllToAllDispatch):
            dispatch.max_tokens = bmax * tq  # no rank routes more tokens this pass: the padded layout's size
        on_device = lambda t: t.contiguous().to(self.device, non_blocking=True)  # noqa: E731
        ids, tables = on_device(mine[:, _ROW : _ROW + tq]), on_device(mine[:, _ROW + tq :])
        if len(mine):
            self.cache.copy_blocks([(src, dst) for _, src, dst in copies[copies[:, 0] == self.rank].tolist()])
            start, q_lens = on_device(mine[:, 1]), on_device(mine[:, 2])
            if self.compiled is not None and bool((mine[:, 1] > 0).all()) and self.compiled.accepts(len(mine), tq):
                h = self.compiled.hidden_states(ids, tables, start, q_lens, bool(last_only), mine[:, 2].tolist())
            else:
                batch = StepBatch(tables, start, q_lens, self.block_size)
                h = self.model.hidden_states(ids, self.cache, batch, last_only=bool(last_only))  # [Br, T', D]
        else:
            h = self.model.hidden_states(ids, last_only=bool(last_only))
        padded = h.new_zeros(bmax, 1 if last_only else tq, h.shape[-1])  # [Bmax, T', D]
        padded[: len(h)] = h
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(padded, gathered, dst=0)
        routing = None
        if trace is not None:
            routing = self._gather_routing(trace, mine[:, 2].tolist(), bmax, tq)
        return (torch.stack(gathered) if gathered is not None else h.new_empty(0)), routing

    def _gather_routing(self, trace: list, lengths: list[int], bmax: int, tq: int) -> tuple | None:
        """This rank's recorded routing as [Bmax, Tq, L', K] ids and weights, gathered to rank 0."""
        k = self.model.config.top_k
        layers = len(self.model.moe_blocks)
        ids = torch.full((bmax, tq, layers, k), -1, dtype=torch.long)
        weights = torch.zeros(bmax, tq, layers, k)
        for b, per_layer in enumerate(split_routing(trace, lengths, tq)):
            for j, (_, i, w) in enumerate(per_layer):
                ids[b, : len(i), j], weights[b, : len(i), j] = i, w
        both = torch.stack((ids.double(), weights.double())).to(self.device)  # [2, Bmax, Tq, L', K]
        gathered = [torch.empty_like(both) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(both, gathered, dst=0)
        if gathered is None:
            return None
        stacked = torch.stack(gathered).cpu()  # [W, 2, Bmax, Tq, L', K]
        return stacked[:, 0].long(), stacked[:, 1].float()


class ShardWorker(_Shard):
    """Ranks 1..W-1: follow rank 0's messages until told to stop (or the group breaks)."""

    def serve_forever(self) -> None:
        while True:
            header, body = _broadcast(None, None, self.host_group)
            if header[0] == CMD_STOP:
                return
            if header[0] == CMD_PLACE:
                self.place(_decode_placement(self.world_size, body.tolist()))
            else:
                self.run(header, body)


class ShardedRunner(_Shard):
    """Rank 0: the model runner of a whole shard group (ModelRunner's interface). `max_num_seqs` is
    per rank; a sequence goes to the rank caching most of its prefix, within BALANCE_SLACK of the least busy."""

    def __init__(self, model: CausalLM, world_size: int, max_num_seqs: int, max_model_len: int,
                 block_size: int = default_of(EngineSection, "block_size"),
                 prefix_caching: bool = default_of(EngineSection, "prefix_caching"), compile: bool = False) -> None:
        super().__init__(model, 0, world_size, max_num_seqs, max_model_len, block_size, compile)
        self.max_model_len = max_model_len
        self.per_rank = max_num_seqs
        self.prefix_caching = prefix_caching
        self.vocab_size = model.config.vocab_size
        self.managers = [BlockManager(self.num_blocks, block_size, prefix_caching) for _ in range(world_size)]
        self._rank_of: dict[str, int] = {}
        self.routing: dict[str, list[tuple]] = {}  # while routing is recorded: the last passes' (routing_by_row)

    @property
    def max_num_seqs(self) -> int:
        return self.per_rank * self.world_size

    @property
    def num_free_slots(self) -> int:
        return self.max_num_seqs - len(self._rank_of)

    def add(self, seq_id: str, token_ids: list[int] | tuple[int, ...] = ()) -> int:
        """Start the sequence on a rank; returns how many of its leading tokens that rank has cached."""
        loads = [len(m) for m in self.managers]
        least = min(loads)
        if least >= self.per_rank:
            raise RuntimeError("no room for another sequence")
        candidates = [r for r in range(self.world_size) if loads[r] < min(least + BALANCE_SLACK, self.per_rank)]
        rank = max(candidates, key=lambda r: (self.managers[r].cached_prefix(token_ids), -loads[r], -r))
        self._rank_of[seq_id] = rank
        return self.managers[rank].add(seq_id, token_ids)

    def remove(self, seq_id: str) -> None:
        rank = self._rank_of.pop(seq_id, None)
        if rank is not None:
            self.managers[rank].remove(seq_id)

    @torch.no_grad()  # not inference mode: the engine masks the logits in place afterwards
    def forward(self, rows: list, logits: Literal["all", "last"] = "last") -> torch.Tensor:
        """rows: engine Rows (seq_id, tokens, start). Returns logits [B, V] or [B, Tq, V] in row order."""
        tq = max(len(r.tokens) for r in rows)
        copies, tables = [], []
        for r in rows:
            if r.start + len(r.tokens) > self.max_model_len:
                raise ValueError(f"sequence {r.seq_id!r} exceeds max_model_len={self.max_model_len}")
            rank = self._rank_of[r.seq_id]
            copies += [(rank, src, dst) for src, dst in self.managers[rank].write(r.seq_id, r.start, r.tokens)]
            tables.append(self.managers[rank].tables[r.seq_id])
        n = max(max(map(len, tables)), -(-max(r.start + tq for r in rows) // self.block_size))
        packed = torch.zeros(len(rows), _ROW + tq + n, dtype=torch.long)  # [B, 3 + Tq + n]
        for i, (r, table) in enumerate(zip(rows, tables)):
            packed[i, :_ROW] = torch.tensor([self._rank_of[r.seq_id], r.start, len(r.tokens)])
            packed[i, _ROW : _ROW + len(r.tokens)] = torch.tensor(r.tokens)
            packed[i, _ROW + tq : _ROW + tq + len(table)] = torch.tensor(table)
        order = torch.argsort(packed[:, 0], stable=True)  # rows grouped by rank
        packed = packed[order]
        traced = int(self.model.routing_trace is not None)  # the engine turns recording on for rank 0's model
        header = [CMD_STEP, len(rows), tq, int(logits == "last"), len(copies), n, traced]
        body = torch.cat([torch.tensor(copies, dtype=torch.long).view(-1), packed.view(-1)])
        header, body = _broadcast(header, body, self.host_group)
        gathered, routing = self.run(header, body)  # [W, Bmax, T', D]
        ranks = packed[:, 0]
        within = torch.cat([torch.arange(int(c)) for c in torch.bincount(ranks, minlength=self.world_size)])
        h = gathered[ranks.to(self.device), within.to(self.device)]  # [B, T', D] in packed order
        if routing is not None:
            layers = [b.layer_idx for b in self.model.moe_blocks]
            ids, weights = routing[0][ranks, within], routing[1][ranks, within]  # [B, Tq, L', K] in packed order
            for b, i in enumerate(order.tolist()):
                n = len(rows[i].tokens)
                self.routing[rows[i].seq_id] = [(layer, ids[b, :n, j], weights[b, :n, j]) for j, layer in enumerate(layers)]
        out = self.model.lm_logits(h).cpu()
        out = out[:, 0] if logits == "last" else out
        if logits == "last":  # prefill or plain decode: every fed token is final
            for r in rows:
                self.managers[self._rank_of[r.seq_id]].commit(r.seq_id, r.start + len(r.tokens))
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return out[inverse]

    def replace(self, placement: Placement) -> None:
        """Live re-placement between steps: every rank moves to `placement`; KV caches stay."""
        if placement.world_size != self.world_size:
            raise ValueError(f"placement has {placement.world_size} ranks, the group {self.world_size}")
        values = _encode_placement(placement)
        _broadcast([CMD_PLACE, 0, 0, 0, 0, len(values), 0], torch.tensor(values, dtype=torch.long), self.host_group)
        self.place(placement)

    def stats(self) -> dict[str, int | float]:
        """Every rank's blocks and prefix-cache counters, summed (for /metrics)."""
        per_rank = [m.stats() for m in self.managers]
        total = {k: sum(s[k] for s in per_rank) for k in per_rank[0]}
        total["prefix_cache_hit_rate"] = total["prefix_cache_hit_blocks"] / max(total["prefix_cache_query_blocks"], 1)
        return total

    def shutdown(self) -> None:
        _broadcast([CMD_STOP, 0, 0, 0, 0, 0, 0], None, self.host_group)
