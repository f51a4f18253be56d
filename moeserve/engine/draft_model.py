"""The draft model as a proposer: a small dense LM in this process, batched across sequences.

Shapes: B rows drafting this step (sorted by k, longest first), K draft tokens (the widest
row), V vocab, S rows that sample their drafts.

One `propose` call per engine step, for the whole batch, in three phases: sync (roll each cache
back to its common prefix with the request's tokens), catch-up (feed every row's uncached tail,
batched), then K - 1 batched one-token forwards. Drafts are the argmax unless the proposer and
the request both sample: then they are drawn from the draft's processed probabilities, sent as q.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from dataclasses import replace

import torch

from model_shards import CausalLM, StepBatch
from model_shards.kv_cache import OutOfBlocks
from moeserve.config import EngineSection, default_of
from moeserve.engine.draft_rows import DraftBatch, DraftRow, DraftSeq, common_prefix
from moeserve.engine.model_runner import ModelRunner, Row, forward_last
from moeserve.sampler import Sampler, keyed_sample, random_sample
from moeserve.spec.draft_masks import GrammarMasks
from moeserve.spec.proposer import Proposal, ProposalRequest, Proposer


class DraftModelProposer(Proposer):
    """A dense draft model (a CausalLM or a checkpoint folder, sharing the target's tokenizer)
    proposing k tokens per sequence, with its own paged KV cache. When `max_num_seqs` are held (or
    KV blocks run out) the least recently used one outside this step's batch is evicted, so a
    leaked id costs nothing. greedy: the draft's argmax for every request."""

    def __init__(self, model: CausalLM | str | os.PathLike, max_num_seqs: int = default_of(EngineSection, "max_num_seqs"),
                 max_model_len: int = default_of(EngineSection, "max_model_len"), greedy: bool = True,
                 num_blocks: int = 0, block_size: int = default_of(EngineSection, "block_size"),
                 prefix_caching: bool = default_of(EngineSection, "prefix_caching"), compile: bool = False) -> None:
        if not isinstance(model, CausalLM):
            from model_shards import load_checkpoint

            model = load_checkpoint(model)
        self.runner = ModelRunner(model, max_num_seqs, max_model_len, num_blocks, block_size, prefix_caching, compile)
        if compile:
            self.runner.compiled.warm_up((1, 2))
        self.device = model.device  # the draft's own tensors; sampled drafts are drawn on the CPU
        self.greedy = greedy
        self.sampler = Sampler()
        self._seqs: dict[str, DraftSeq] = {}
        self._clock = 0
        self.num_new_seqs = 0  # sequences prefilled from scratch (new, evicted, or unseen here)
        self.num_rebuilt_tokens = 0  # confirmed tokens re-fed because the cache had lost them
        self.num_evictions = 0

    @property
    def num_tracked(self) -> int:
        """Sequences holding draft KV blocks (for leak checks)."""
        return len(self._seqs)

    def on_finished(self, seq_id: str) -> None:
        """Frees the sequence's KV blocks; unknown ids are ignored."""
        if self._seqs.pop(seq_id, None) is not None:
            self.runner.remove(seq_id)

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest], hypothetical: bool = False) -> list[Proposal]:
        """Up to request.num_tokens draft tokens per request, in order (possibly none).
        hypothetical: the histories are guesses (pre-drafting): no rebuild counted, nothing evicted.
        A greedy row with `jump_forward` drafts through forced text: the text goes into the
        proposal, and the row drafts on after it in one more batched round."""
        self._clock += 1
        proposals, through = self._round(requests, hypothetical)
        left = {i: requests[i].num_tokens - (len(proposals[i].token_ids) - len(f)) for i, f in through.items()}
        while through:  # rows that reached forced text with draft tokens left: one more round
            nxt, advanced = [], []
            for i in through:
                req, got = requests[i], proposals[i].token_ids
                advanced.append((req.grammar, req.grammar.accept_tokens(got)))
                nxt.append((i, replace(req, token_ids=list(req.token_ids) + got, num_tokens=left[i])))
            try:
                more, ended = self._round([r for _, r in nxt], True)
            finally:
                for grammar, n in advanced:
                    grammar.rollback(n)
            through = {}
            for j, ((i, _), p) in enumerate(zip(nxt, more)):
                proposals[i] = replace(proposals[i], token_ids=proposals[i].token_ids + p.token_ids)
                if j in ended:
                    through[i] = ended[j]
                    left[i] -= len(p.token_ids) - len(ended[j])
        return proposals

    def _round(self, requests: list[ProposalRequest], hypothetical: bool) -> tuple[list[Proposal], dict[int, list[int]]]:
        """One batched draft of the requests: their proposals, and the rows (by request index) that
        ended at text their grammar forces with draft tokens left, whose proposals end with that text."""
        rows = self._sync(requests, hypothetical)
        proposals = [Proposal([]) for _ in requests]
        if not rows:
            return proposals, {}
        rows.sort(key=lambda r: -r.k)  # the rows still drafting stay a prefix
        tables = self.runner.block_tables([r.seq_id for r in rows])
        batch = DraftBatch(tables, torch.tensor([len(r.tokens) for r in rows], device=tables.device))
        tokens, probs, masks = self._draft(rows, batch, self._catch_up(rows, batch))  # [B, K] ...
        sampled, through = 0, {}
        for b, (r, row) in enumerate(zip(rows, tokens.tolist())):
            q = None
            if r.params is not None:
                q = probs[sampled, : r.k].clone()  # [k, V] a copy, so pickling it sends k rows only
                sampled += 1
            end = masks.ends.get(b, r.k)
            proposals[r.index] = Proposal(row[:end], q)
            if b in masks.forced and end < r.k:
                through[r.index] = masks.forced[b]
                proposals[r.index] = Proposal(row[:end] + masks.forced[b])
            fed = row[: r.k - 1]  # the last draft was sampled, never fed; -1: not drafted (ended early)
            self._hold(r.seq_id, r.tokens + (fed[: fed.index(-1)] if -1 in fed else fed), len(r.tokens))
        return proposals, through

    def _hold(self, seq_id: str, cached: list[int], confirmed: int) -> None:
        """The sequence's cache holds `cached`; its first `confirmed` tokens' full blocks become
        findable by other sequences."""
        self._seqs[seq_id].cached = cached
        self.runner.manager.record(seq_id, cached)
        self.runner.manager.commit(seq_id, confirmed)

    # ---- the three phases -----------------------------------------------------------------
    def _sync(self, requests: list[ProposalRequest], hypothetical: bool = False) -> list[DraftRow]:
        """Rows that draft this step, each with its cache rolled back to the common prefix."""
        busy = {r.seq_id for r in requests}
        limit = self.runner.max_model_len
        rows = []
        for i, req in enumerate(requests):
            tokens = list(req.token_ids)
            # Draft j is fed at position len + j - 2; the last draft is never fed.
            k = min(req.num_tokens, limit + 1 - len(tokens))
            if k <= 0 or not tokens:
                continue
            state = self._seqs.get(req.seq_id)
            if state is None:
                if not (self.runner.num_free_slots or self._evict(busy)):
                    continue
                cached = self.runner.add(req.seq_id, tokens)  # a prefix-cache hit skips those tokens
                state = self._seqs[req.seq_id] = DraftSeq(tokens[:cached])
                self.num_new_seqs += 1
            start = common_prefix(state.cached, tokens, state.seen)
            if start < state.seen:
                self.num_rebuilt_tokens += state.seen - start
            start = min(start, len(tokens) - 1)  # always feed one token: its logits give draft 1
            if not self._reserve(req.seq_id, start, tokens, k, None if hypothetical else busy):
                continue
            state.last_used = self._clock
            if not hypothetical:
                state.seen = len(tokens)
            params = None if self.greedy or req.params is None or req.params.greedy else req.params
            rows.append(DraftRow(i, req.seq_id, tokens, k, start, params, req.grammar, req.jump_forward))
        return rows

    def _catch_up(self, rows: list[DraftRow], batch: DraftBatch) -> torch.Tensor:
        """Feeds each row's uncached tail; logits [B, V] after each row's last token. Tails of 1
        (a recovered token) or 2 (last draft + bonus) go through one pass of up to two tokens a row;
        longer ones run through the runner's forward up to their last token first, grouped by length."""
        prefill = [Row(r.seq_id, r.tokens[r.start : -1], r.start) for r in rows if len(r.tokens) - r.start > 2]
        if prefill:
            forward_last(self.runner, prefill, prepared=True)
        tails = [r.tokens[-2:] if len(r.tokens) - r.start == 2 else r.tokens[-1:] for r in rows]
        width = max(map(len, tails))
        ids = torch.tensor([t + [0] * (width - len(t)) for t in tails], device=self.device)  # [B, 1 or 2]
        q_lens = [len(t) for t in tails]
        return self._step(ids, batch.tables, batch.lengths - torch.tensor(q_lens, device=self.device), q_lens)

    def _draft(self, rows: list[DraftRow], batch: DraftBatch,
               logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, GrammarMasks]:
        """Draft tokens [B, K]; for sampling rows, their q [S, K, V]; the grammar masks, whose `ends`
        and `forced` say which rows ended at text their grammar forces (or completed their output)."""
        width = rows[0].k
        neg_k = [-r.k for r in rows]  # ascending
        active = [bisect_left(neg_k, -j) for j in range(width)]  # rows with k > j: they need draft j
        sampled = [b for b, r in enumerate(rows) if r.params is not None]
        out = torch.full((len(rows), width), -1, dtype=torch.long, device=self.device)  # [B, K]; -1: not drafted
        probs = torch.empty(len(sampled), width, logits.shape[-1]) if sampled else None  # [S, K, V]
        # a sampled row never ends by its values: a cut that depends on what the draft drew biases the output
        masks = GrammarMasks([r.grammar for r in rows], logits.shape[-1],
                             [r.jump_forward and r.params is None for r in rows])
        try:
            for j in range(width):
                n = active[j]
                if j:  # feed draft j-1 (0-based) at position len + j - 1
                    positions = batch.lengths[:n] + (j - 1)  # [n]
                    logits = self._step(out[:n, j - 1, None], batch.tables[:n], positions)
                masks.apply(logits, out, j)
                if masks.all_ended(n):  # every row still drafting ended (at forced text, or its output)
                    break
                out[:n, j] = logits.argmax(dim=-1)  # [n]
                if s := bisect_left(sampled, n):  # sampling rows among the first n draw theirs
                    self._sample(rows, sampled[:s], logits, j, out, probs)
        finally:
            masks.rollback()
        return out, probs, masks

    def _step(self, tokens: torch.Tensor, tables: torch.Tensor, start: torch.Tensor,
              q_lens: list[int] | None = None) -> torch.Tensor:
        """Row b's first q_lens[b] (default: all) tokens of tokens [n, T] at positions start[b]...:
        logits [n, V] after each row's last one. tables: [n, nb] the rows' blocks."""
        (n, t), compiled = tokens.shape, self.runner.compiled
        q_lens = q_lens or [t] * n
        if compiled is not None and compiled.accepts(n, t):
            logits = compiled(tokens, tables, start.tolist(), q_lens)  # [n, T, V]
            return logits[:, 0] if t == 1 else logits[torch.arange(n), torch.tensor(q_lens, device=logits.device) - 1]
        # known: the shortest row, and a cached prefix (a row at position 0 reads only its own keys)
        batch = StepBatch(tables, start, torch.tensor(q_lens, device=start.device), self.runner.block_size,
                          known=(min(q_lens), False))
        return self.runner.model(tokens, self.runner.cache, batch, logits="last")  # [n, V]

    def _sample(self, rows: list[DraftRow], idx: list[int], logits: torch.Tensor, j: int, out: torch.Tensor,
                probs: torch.Tensor) -> None:
        """Draws draft j for the sampling rows `idx` from their processed q; stores q."""
        q = self.sampler.probs(logits[idx].float().cpu(), [rows[b].params for b in idx])  # [s, V]
        drawn = random_sample(q[:, None], [None] * len(idx)).squeeze(1)  # [s]
        # seeded rows use the target's keyed noise: where q and p agree, the draft is the target's token
        seeded = [i for i, b in enumerate(idx) if rows[b].params.seed is not None]
        if seeded:
            keys = [(rows[idx[i]].params.seed, len(rows[idx[i]].tokens) + j) for i in seeded]
            drawn[seeded] = keyed_sample(q[seeded], keys)
        out[idx, j] = drawn.to(out.device)
        probs[: len(idx), j] = q

    def _reserve(self, seq_id: str, start: int, tokens: list[int], k: int, busy: set[str] | None) -> bool:
        """Blocks for the row's tail and the k - 1 drafts it feeds, evicting sequences outside
        `busy` as needed (None: never evict, e.g. for a guessed history)."""
        while True:
            try:
                self.runner.prepare(seq_id, start, tokens[start:], reserve=k - 1)
                return True
            except OutOfBlocks:
                if busy is None or not self._evict(busy):
                    return False

    def _evict(self, busy: set[str]) -> bool:
        """Evicts the least recently used sequence outside `busy`; False when there is none."""
        idle = [(s.last_used, sid) for sid, s in self._seqs.items() if sid not in busy]
        if not idle:
            return False
        self.on_finished(min(idle)[1])
        self.num_evictions += 1
        return True
