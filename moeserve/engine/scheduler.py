"""Continuous batching: which sequences run in the next step.

A step is either a prefill (new sequences' whole prompts) or a decode (every running sequence
feeds its pending token plus any drafts); prefill goes first so new requests start quickly.

KV budget: running sequences hold at most `kv_budget_tokens` of KV cache (their tokens plus
`lookahead` drafts, in whole blocks). When growing sequences would overflow it, the newest are
preempted: back to the front of the queue with their output (vLLM's recompute preemption).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from moeserve.config import EngineSection, default_of
from moeserve.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = default_of(EngineSection, "max_num_seqs")  # running batch size
    max_num_batched_tokens: int = default_of(EngineSection, "max_num_batched_tokens")  # per prefill step
    max_model_len: int = default_of(EngineSection, "max_model_len")
    kv_budget_tokens: int = default_of(EngineSection, "kv_budget_tokens")  # all running seqs; 0: derived
    lookahead: int = 0  # tokens a sequence may add in one step beyond the next one (draft tokens)
    block_size: int = default_of(EngineSection, "block_size")  # KV is held in blocks of this many tokens
    # with prefix caching: of waiting sequences sharing a prompt, prefill one; the rest reuse its blocks next step
    share_prefill: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.lookahead < 0:
            raise ValueError(f"lookahead: must be >= 0, got {self.lookahead}")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        if self.kv_budget_tokens and self.kv_budget_tokens < self.max_model_len + self.lookahead:
            raise ValueError(
                f"kv_budget_tokens: {self.kv_budget_tokens} cannot hold one sequence of max_model_len "
                f"{self.max_model_len} (+ lookahead {self.lookahead})"
            )

    @property
    def kv_budget(self) -> int:
        return self.kv_budget_tokens or self.max_num_seqs * self.held(self.max_model_len + self.lookahead)

    def held(self, tokens: int) -> int:
        """KV tokens a sequence of `tokens` tokens holds: whole blocks."""
        return -(-tokens // self.block_size) * self.block_size


@dataclass
class ScheduledBatch:
    is_prefill: bool
    seqs: list[Sequence]
    preempted: list[Sequence] = field(default_factory=list)  # lost their KV cache this step


class Scheduler:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # after a failed step: only this sequence is scheduled (the others wait) until the core clears it
        self.focus: Sequence | None = None

    @property
    def kv_tokens_used(self) -> int:
        return sum(self.cfg.held(s.num_tokens) for s in self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        if self.focus is not None:
            return self._schedule_focus(self.focus)
        admitted: list[Sequence] = []
        tokens = 0
        grow = 1 + self.cfg.lookahead
        kv_free = self.cfg.kv_budget - sum(self.cfg.held(s.num_tokens + grow) for s in self.running)
        prompts: set[tuple[int, ...]] = set()  # of this prefill
        for seq in list(self.waiting):
            if len(self.running) + len(admitted) >= self.cfg.max_num_seqs:
                break
            if admitted and tokens + len(seq.pending_ids) > self.cfg.max_num_batched_tokens:
                break
            key = tuple(seq.prompt_ids) if self.cfg.share_prefill and len(seq.prompt_ids) > self.cfg.block_size else None
            if key is not None and key in prompts:
                continue  # its twin's prompt blocks are in the prefix cache after this step: prefill it next
            need = self.cfg.held(seq.num_tokens + grow)
            if need > kv_free and (admitted or self.running):
                break
            kv_free -= need
            tokens += len(seq.pending_ids)
            admitted.append(seq)
            if key is not None:
                prompts.add(key)
        if admitted:
            for seq in admitted:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
            self.running.extend(admitted)
            return ScheduledBatch(is_prefill=True, seqs=admitted)
        if self.running:
            preempted = self._preempt_to_fit()
            return ScheduledBatch(is_prefill=False, seqs=list(self.running), preempted=preempted)
        return None

    def _schedule_focus(self, seq: Sequence) -> ScheduledBatch | None:
        if seq in self.running:
            return ScheduledBatch(is_prefill=False, seqs=[seq])
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            return ScheduledBatch(is_prefill=True, seqs=[seq])
        self.focus = None  # it finished
        return self.schedule()

    def requeue(self, seq: Sequence) -> bool:
        """Running -> front of the queue, to be prefilled again (prompt + output so far). False if
        it was not running."""
        if seq not in self.running:
            return False
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_cached = 0
        self.waiting.appendleft(seq)
        return True

    def _preempt_to_fit(self) -> list[Sequence]:
        """Preempt the newest running sequences until the next step's KV growth fits the budget."""
        preempted = []
        grow = 1 + self.cfg.lookahead
        while len(self.running) > 1 and sum(self.cfg.held(s.num_tokens + grow) for s in self.running) > self.cfg.kv_budget:
            seq = self.running.pop()
            seq.status = SequenceStatus.WAITING
            seq.num_cached = 0  # recompute: the next prefill feeds prompt + output so far
            self.waiting.appendleft(seq)
            preempted.append(seq)
        self.num_preemptions += len(preempted)
        return preempted

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq is self.focus:
            self.focus = None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
