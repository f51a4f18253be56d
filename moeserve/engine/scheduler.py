"""Continuous batching: which sequences run in the next step.

A step is either a prefill (new sequences, their whole prompts, padded into one batch) or a
decode (every running sequence feeds its pending token plus any draft tokens). Waiting
requests join between steps whenever a KV slot and the token budget allow; prefill goes
first so new requests start quickly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from moeserve.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32  # running batch size (= KV cache slots)
    max_num_batched_tokens: int = 2048  # prompt tokens in one prefill step (one prompt always fits)
    max_model_len: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")


@dataclass
class ScheduledBatch:
    is_prefill: bool
    seqs: list[Sequence]


class Scheduler:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        admitted: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) + len(admitted) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if admitted and tokens + len(seq.pending_ids) > self.cfg.max_num_batched_tokens:
                break
            tokens += len(seq.pending_ids)
            admitted.append(self.waiting.popleft())
        if admitted:
            for seq in admitted:
                seq.status = SequenceStatus.RUNNING
            self.running.extend(admitted)
            return ScheduledBatch(is_prefill=True, seqs=admitted)
        if self.running:
            return ScheduledBatch(is_prefill=False, seqs=list(self.running))
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
