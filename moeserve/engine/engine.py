"""The in-process engine: continuous batching over a target model, optional speculation.

One step = schedule -> (propose) -> run the target -> sample or verify -> postprocess.
Everything per step stays in this process; callers (CLI, Serve deployment) add requests
and call `step()` in a loop.

Shapes: B rows, K draft tokens (widest row), V vocab.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass, field

import torch

from moeserve.engine.model_runner import ModelRunner, Row
from moeserve.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from moeserve.sampler import Sampler, make_generator
from moeserve.sampling_params import SamplingParams
from moeserve.sequence import RequestOutput, Sequence
from moeserve.spec.adaptive import AdaptiveK
from moeserve.spec.metrics import SpecMetrics
from moeserve.spec.proposer import ProposalRequest, Proposer, pad_proposals
from moeserve.spec.rejection_sampler import RejectionSampler


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: `num_tokens` draft tokens per step (the cap when adaptive)."""

    num_tokens: int = 4
    adaptive: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.num_tokens <= 16:
            raise ValueError(f"num_tokens: must be in [0, 16], got {self.num_tokens}")


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer=None,
        scheduler: SchedulerConfig | None = None,
        proposer: Proposer | None = None,
        spec: SpecConfig | None = None,
        adaptive: AdaptiveK | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        cfg = scheduler or SchedulerConfig(max_num_seqs=runner.max_num_seqs, max_model_len=runner.max_model_len)
        if cfg.max_num_seqs > runner.max_num_seqs or cfg.max_model_len > runner.max_model_len:
            raise ValueError("scheduler limits exceed the model runner's KV cache")
        self.scheduler = Scheduler(cfg)
        self.proposer = proposer
        self.spec = spec or SpecConfig(num_tokens=4 if proposer else 0)
        self.adaptive = adaptive
        self.sampler = Sampler()
        self.rejection = RejectionSampler()
        self.spec_metrics = SpecMetrics()
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = {eos} if eos is not None else set(runner.model.config.eos_token_id)
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self, prompt: str | Seq[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        params = params or SamplingParams()
        prompt_ids = list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else [int(t) for t in prompt]
        limit = self.scheduler.cfg.max_model_len
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= limit:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context holds {limit}, output included")
        if any(not 0 <= t < self.runner.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.runner.vocab_size})")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, prompt_ids, params, arrival=time.monotonic())
        if params.seed is not None:
            seq.generator = make_generator(params.seed)
        if self.tokenizer is not None:
            from moeserve.detokenizer import IncrementalDetokenizer

            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.is_finished:
            self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        if batch.is_prefill:
            for seq in batch.seqs:
                self.runner.add(seq.seq_id)
            new_tokens = self._prefill(batch)
        else:
            new_tokens = self._decode(batch)
        return [self._postprocess(seq, toks) for seq, toks in zip(batch.seqs, new_tokens)]

    def _prefill(self, batch: ScheduledBatch) -> list[list[int]]:
        rows = [Row(s.seq_id, s.pending_ids, s.num_cached) for s in batch.seqs]
        logits = self.runner.forward(rows, logits="last")  # [B, V]
        for s in batch.seqs:
            s.num_cached = s.num_tokens
        tokens = self.sampler.sample(logits, [s.params for s in batch.seqs], [s.generator for s in batch.seqs])
        return [[t] for t in tokens.tolist()]

    def _decode(self, batch: ScheduledBatch) -> list[list[int]]:
        seqs = batch.seqs
        t0 = time.perf_counter()
        proposals = self._propose(seqs)
        t1 = time.perf_counter()
        rows = [Row(s.seq_id, s.pending_ids + p, s.num_cached) for s, p in zip(seqs, proposals)]
        if not any(proposals):
            logits = self.runner.forward(rows, logits="last")  # [B, V]
            for s in seqs:
                s.num_cached = s.num_tokens
            tokens = self.sampler.sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
            return [[t] for t in tokens.tolist()]
        logits = self.runner.forward(rows, logits="all")  # [B, K+1, V]
        t2 = time.perf_counter()
        out = self._verify(seqs, logits, proposals)
        accepted = out.num_accepted.tolist()
        for s, a, p in zip(seqs, accepted, proposals):
            s.num_cached += 1 + a  # the fed token + accepted drafts; rejected ones are rolled back
            if self.adaptive is not None:
                self.adaptive.observe(s.seq_id, len(p), a)
        self.spec_metrics.record([len(p) for p in proposals], accepted, t1 - t0, t2 - t1)
        return out.token_ids

    def _propose(self, seqs: list[Sequence]) -> list[list[int]]:
        if self.proposer is None or self.spec.num_tokens == 0:
            return [[] for _ in seqs]
        requests = []
        for s in seqs:
            k = self.adaptive.choose_k(s.seq_id) if self.adaptive else self.spec.num_tokens
            room = min(s.params.max_tokens - len(s.output_ids), self.scheduler.cfg.max_model_len - s.num_tokens) - 1
            requests.append(ProposalRequest(s.seq_id, s.token_ids, max(0, min(k, room))))
        self._last_proposals = self.proposer.propose(requests)
        return [list(p.token_ids) for p in self._last_proposals]

    def _verify(self, seqs: list[Sequence], logits: torch.Tensor, proposals: list[list[int]]):
        k = max(len(p) for p in proposals)
        draft_ids, draft_probs, num_draft = pad_proposals(self._last_proposals, width=k)
        logits = logits[:, : k + 1]  # [B, K+1, V]
        params = [s.params for s in seqs]
        if all(p.greedy for p in params):
            return self.rejection.greedy(logits.argmax(-1), draft_ids, num_draft)
        target_probs = self.sampler.probs(logits, params)  # [B, K+1, V]
        return self.rejection.sample(target_probs, draft_ids, draft_probs, num_draft, [s.generator for s in seqs])

    # ---- after a step ------------------------------------------------------------------------
    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        return None

    def _postprocess(self, seq: Sequence, tokens: list[int]) -> RequestOutput:
        added: list[int] = []
        reason = None
        for t in tokens:
            reason = self._stop_reason(seq, t)
            if reason:
                break
            added.append(t)
            seq.output_ids.append(t)
            if len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.scheduler.cfg.max_model_len:
                reason = "length"
                break
        text = ""
        if seq.detokenizer is not None:
            text = seq.detokenizer.push(added)
            if seq.detokenizer.stopped:
                reason = "stop"
            elif reason:
                text += seq.detokenizer.finish()
        if reason:
            self._finish(seq, reason)
        return RequestOutput(
            seq.seq_id, added, text, seq.is_finished, seq.finish_reason, len(seq.prompt_ids), len(seq.output_ids)
        )

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.runner.remove(seq.seq_id)
        if self.proposer is not None:
            self.proposer.on_finished(seq.seq_id)
        if self.adaptive is not None:
            self.adaptive.on_finished(seq.seq_id)
        self._seqs.pop(seq.seq_id, None)

    # ---- conveniences ------------------------------------------------------------------------
    def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Generate one request, yielding its outputs step by step (other requests keep running)."""
        rid = self.add_request(prompt, params)
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return

    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | None = None) -> list[Completion]:
        """Run a batch of prompts to completion; results in prompt order."""
        ids = [self.add_request(p, params) for p in prompts]
        done: dict[str, Completion] = {rid: Completion(rid) for rid in ids}
        while any(not c.finished for c in done.values()):
            for out in self.step():
                c = done.get(out.request_id)
                if c is not None:
                    c.token_ids += out.new_token_ids
                    c.text += out.new_text
                    c.finished, c.finish_reason = out.finished, out.finish_reason
        return [done[rid] for rid in ids]


@dataclass
class Completion:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
