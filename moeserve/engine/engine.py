"""The in-process engine: continuous batching over a target model, optional speculation.
One step = schedule -> (propose) -> run the target -> sample or verify -> postprocess.

Shapes: B rows, K draft tokens (widest row), V vocab.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch

from moeserve.engine.model_runner import ModelRunner, Row, forward_last
from moeserve.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from moeserve.engine.structured import StructuredConfig, StructuredOutput
from moeserve.engine.trace import forced_traces, token_traces
from moeserve.grammar import CompiledGrammar
from moeserve.sampler import Sampler
from moeserve.sampling_params import SamplingParams, TokenLogprob, TokenTrace
from moeserve.sequence import RequestOutput, Sequence
from moeserve.spec.metrics import SpecMetrics
from moeserve.spec.policy import AdaptiveK, AdaptiveKConfig, SpecConfig
from moeserve.spec.proposer import ProposalRequest, Proposer, pad_proposals
from moeserve.spec.rejection_sampler import RejectionSampler
from moeserve.spec.verify import verify, verify_window


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer=None, scheduler: SchedulerConfig | None = None,
                 proposer: Proposer | None = None, spec: SpecConfig | None = None, adaptive: AdaptiveK | None = None,
                 structured: StructuredConfig | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        cfg = scheduler or SchedulerConfig(max_num_seqs=runner.max_num_seqs, max_model_len=runner.max_model_len,
                                           block_size=runner.block_size)
        if cfg.max_num_seqs > runner.max_num_seqs or cfg.max_model_len > runner.max_model_len:
            raise ValueError("scheduler limits exceed the model runner's KV cache")
        self.proposer = proposer
        self.spec = spec or SpecConfig(num_tokens=4 if proposer else 0)
        lookahead = max(cfg.lookahead, self.spec.num_tokens if proposer else 0)  # KV room for the draft tokens
        self.scheduler = Scheduler(replace(cfg, lookahead=lookahead))
        if adaptive is None and self.spec.adaptive and proposer is not None:
            adaptive = AdaptiveK(AdaptiveKConfig(self.spec.num_tokens))
        self.adaptive = adaptive  # the speculation policy: k per step, and PayGuard's check
        self._times = (0, 0.0, 0.0)  # the last decode step's widest proposal, drafting and target seconds
        self._requested: list[int] = []  # the k each row of the last proposing step asked for
        self._rooms: list[int] = []  # the most tokens each row's proposal may hold, that step
        self._forced_emitted = 0  # this step's accepted forced text inside proposals
        self.sampler = Sampler()
        self.rejection = RejectionSampler()
        self.spec_metrics = SpecMetrics()
        self._logprobs: dict[str, list[TokenLogprob]] = {}  # this step's, for requests that asked
        self._trace: dict[str, list[TokenTrace]] = {}  # this step's, for requests that asked
        self.num_spec_disabled_steps = 0  # decode steps without speculation: the batch was too big
        self.num_guard_refusals = 0  # tokens the grammar refused after masking (always 0 unless a bug)
        self.structured = StructuredOutput(runner.vocab_size, structured)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = set(runner.model.config.eos_token_id) | ({eos} if eos is not None else set())
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None, request_id: str | None = None,
                    grammar: CompiledGrammar | None = None, resume_ids: Seq[int] = ()) -> str:
        """Queue a request, its output constrained by `grammar` (GrammarCompiler.compile) and continued
        after `resume_ids` (what an earlier attempt delivered; counted toward max_tokens)."""
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
        resume_ids = [int(t) for t in resume_ids]
        if len(prompt_ids) + len(resume_ids) >= limit or len(resume_ids) >= params.max_tokens:
            raise ValueError("nothing left to generate after the resumed output")
        seq = Sequence(request_id, prompt_ids, params, output_ids=resume_ids)
        if grammar is not None:
            seq.grammar = self.structured.new_request(grammar, resume_ids)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        if (seq := self._seqs.get(request_id)) is not None and not seq.is_finished:
            self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def requests(self) -> Mapping[str, Sequence]:
        """The requests the engine holds (waiting or running), by id; read-only."""
        return MappingProxyType(self._seqs)

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        self._logprobs.clear()
        self._trace.clear()
        self._record_routing(any(s.params.trace_experts for s in batch.seqs))
        for seq in batch.preempted:
            self._release(seq)
        t0 = time.perf_counter()
        try:
            if batch.is_prefill:
                for seq in batch.seqs:  # a paged runner may hold a prefix already (prefix caching)
                    seq.num_cached = max(seq.num_cached, self.runner.add(seq.seq_id, seq.token_ids))
                new_tokens = self._prefill(batch)
            else:
                new_tokens = self._decode(batch)
        except Exception as e:  # nothing was emitted: the step's requests can run it again (requeue)
            raise StepError([s.seq_id for s in batch.seqs]) from e
        outputs = [self._postprocess(seq, toks) for seq, toks in zip(batch.seqs, new_tokens)]
        if self.adaptive is not None and not batch.is_prefill:  # tokens the target chose, not forced text
            self.adaptive.record(len(batch.seqs), any(s.grammar is not None for s in batch.seqs), *self._times,
                                 sum(map(len, new_tokens)) - self._forced_emitted, time.perf_counter() - t0)
        return outputs

    def requeue(self, request_ids: Seq[str]) -> None:
        """Put running requests back in front of the queue (after a failed step, or a replaced runner):
        KV cache and draft state freed, output kept and recomputed by their next prefill."""
        for rid in reversed(list(request_ids)):
            if (seq := self._seqs.get(rid)) is not None and self.scheduler.requeue(seq):
                self._release(seq)

    def _prefill(self, batch: ScheduledBatch) -> list[list[int]]:
        rows = [Row(s.seq_id, s.pending_ids, s.num_cached) for s in batch.seqs]
        return self._sample_next(batch.seqs, forward_last(self.runner, rows))

    def _sample_next(self, seqs: list[Sequence], logits: torch.Tensor) -> list[list[int]]:
        """One new token per sequence from logits [B, V] at its last fed token (grammar-masked)."""
        for s in seqs:
            s.num_cached = s.num_tokens
        if any(s.grammar is not None for s in seqs) and self.structured.fill_last(seqs):  # free text: no masks
            self.structured.apply(logits)
        tokens = self.sampler.sample(logits, [s.params for s in seqs], positions=[s.num_tokens for s in seqs])
        chosen = [[t] for t in tokens.tolist()]
        self._record_logprobs(seqs, logits.unsqueeze(1), chosen)
        self._record_trace(seqs, chosen, [-1] * len(seqs))  # chosen at each row's last fed token
        return chosen

    def _record_logprobs(self, seqs: list[Sequence], logits: torch.Tensor, tokens: list[list[int]]) -> None:
        """For requests that asked: each chosen token's logprob, from the (masked) logits [B, T, V]
        it was chosen at (position j of row i for the j-th token of row i)."""
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not want:
            return
        at = [(i, j) for i in want for j in range(len(tokens[i]))]
        rows = logits[[i for i, _ in at], [j for _, j in at]]  # [N, V]
        entries = iter(self.sampler.logprobs(rows, [seqs[i].params for i, _ in at], [tokens[i][j] for i, j in at]))
        for i in want:
            self._logprobs[seqs[i].seq_id] = [next(entries) for _ in tokens[i]]

    def _record_routing(self, on: bool) -> None:
        """Record the model's routing while a request in the batch asked for its experts (runners that
        report it per row; a shard group's rank 0 then tells every rank to)."""
        routing = getattr(self.runner, "routing", None)
        if routing is None:
            return
        routing.clear()
        if on != (self.runner.model.routing_trace is not None):
            self.runner.model.record_routing(on)

    def _record_trace(self, seqs: list[Sequence], tokens: list[list[int]], first: list[int],
                      accepted: list[int] | None = None, forced: list[tuple[int, ...]] | None = None) -> None:
        """For requests that asked: each new token's source and experts. tokens[i][j] was chosen
        at fed position first[i] + j of row i (negative: from the end); the first accepted[i]
        of them are accepted drafts, but for the grammar's forced text at forced[i]."""
        routing = getattr(self.runner, "routing", {})
        for i, s in enumerate(seqs):
            if s.params.trace_experts or s.params.trace_speculation:
                self._trace[s.seq_id] = token_traces(s.params, tokens[i], first[i],
                                                     None if accepted is None else accepted[i], routing.get(s.seq_id),
                                                     forced[i] if forced else ())

    def _decode(self, batch: ScheduledBatch) -> list[list[int]]:
        seqs = batch.seqs
        t0 = time.perf_counter()
        proposals = self._propose(seqs)
        self._forced_emitted = 0
        constrained = any(s.grammar is not None for s in seqs)  # free text never reaches structured output
        if constrained and any(proposals):  # refused drafts cut, forced text put in; masks for all k+1 positions filled
            self._last_proposals = self.structured.cut_and_fill(seqs, self._last_proposals, self._rooms)
            proposals = [list(p.token_ids) for p in self._last_proposals]
        t1 = time.perf_counter()
        fed = [len(s.pending_ids) for s in seqs]  # 1, or more after jump-forward
        rows = [Row(s.seq_id, s.pending_ids + p, s.num_cached) for s, p in zip(seqs, proposals)]
        if not any(proposals):
            logits = self.runner.forward(rows, logits="last")  # [B, V]
            self._times = (0, t1 - t0, time.perf_counter() - t1)
            return self._sample_next(seqs, logits)
        logits = self.runner.forward(rows, logits="all")  # [B, Tq, V]
        width = max(map(len, proposals))
        logits = verify_window(logits, fed, width)  # [B, K+1, V]
        if constrained:
            self.structured.apply(logits)
        t2 = time.perf_counter()
        draft_ids, draft_probs, num_draft = pad_proposals(self._last_proposals, width=width)
        out = verify(self.sampler, self.rejection, seqs, logits, draft_ids, draft_probs, num_draft)
        self._record_logprobs(seqs, logits, out.token_ids)  # the target's verify pass
        accepted = out.num_accepted.tolist()
        forced = [p.forced for p in self._last_proposals]
        # a bonus the budget pinned to forced text (cut_and_fill) is forced text, emitted when all drafts were accepted
        bonus = [p.bonus is not None and a == p.num_tokens for p, a in zip(self._last_proposals, accepted)]
        self._record_trace(seqs, out.token_ids, [n - 1 for n in fed], accepted,
                           [f + (len(p),) if b else f for f, p, b in zip(forced, proposals, bonus)])
        self.structured.num_forced_tokens += sum(bonus)
        chosen, chosen_accepted = [], []  # draft tokens, and those accepted: the grammar's forced text left out
        for s, a, p, f, n, r, b in zip(seqs, accepted, proposals, forced, fed, self._requested, bonus):
            s.num_cached += n + a  # the fed tokens + accepted drafts; rejected ones are rolled back
            d, a_chosen = len(p) - len(f), a - sum(1 for j in f if j < a)
            self._forced_emitted += a - a_chosen + b
            chosen.append(d)
            chosen_accepted.append(a_chosen)
            if self.adaptive is not None:  # fewer draft tokens than asked: a refusal cut, or the output's end
                self.adaptive.observe(s.seq_id, d, a_chosen, cut=d < r and s.grammar is not None)
        self.spec_metrics.record(chosen, chosen_accepted, t1 - t0, t2 - t1)
        self._times = (width, t1 - t0, t2 - t1)
        return out.token_ids

    def _propose(self, seqs: list[Sequence]) -> list[list[int]]:
        if self.proposer is None or self.spec.num_tokens == 0:
            return [[] for _ in seqs]
        if 0 < self.spec.disable_by_batch_size <= len(seqs):
            self.num_spec_disabled_steps += 1
            return [[] for _ in seqs]
        ks = ([self.spec.num_tokens] * len(seqs) if self.adaptive is None else
              self.adaptive.choose_batch([s.seq_id for s in seqs], any(s.grammar is not None for s in seqs)))
        if not any(ks):  # a plain step: no proposer call (it would draft nothing)
            return [[] for _ in seqs]
        self._rooms = [min(s.params.max_tokens - len(s.output_ids), self.scheduler.cfg.max_model_len - s.num_tokens) - 1
                       for s in seqs]  # the most tokens a proposal may hold (forced text included)
        requests = [ProposalRequest(s.seq_id, s.token_ids, max(0, min(k, room)), s.params,
                                    None if s.grammar is None else s.grammar.matcher, self.structured.cfg.jump_forward)
                    for s, k, room in zip(seqs, ks, self._rooms)]
        self._requested = [r.num_tokens for r in requests]
        self._last_proposals = self.proposer.propose(requests)
        return [list(p.token_ids) for p in self._last_proposals]

    # ---- after a step ------------------------------------------------------------------------
    def _append(self, seq: Sequence, tokens: list[int]) -> tuple[list[int], str | None]:
        """Append tokens up to a stop or length limit: (the tokens added, the finish reason)."""
        added: list[int] = []
        eos = self.eos_ids if not seq.params.ignore_eos or seq.grammar is not None else ()  # under a grammar EOS means "complete"
        for t in tokens:
            if t in eos or t in seq.params.stop_token_ids:
                return added, "stop"
            added.append(t)
            seq.output_ids.append(t)
            if len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.scheduler.cfg.max_model_len:
                return added, "length"
        return added, None

    def _postprocess(self, seq: Sequence, tokens: list[int]) -> RequestOutput:
        added, reason = self._append(seq, tokens)
        logprobs = self._logprobs.pop(seq.seq_id, None)
        trace = self._trace.pop(seq.seq_id, None)
        error = None
        if seq.grammar is not None and reason is None:
            adv = self.structured.advance(seq, added)
            if adv.accepted < len(added):  # the guard: never emit what the grammar refuses (a bug upstream)
                refused = added[adv.accepted]
                del seq.output_ids[len(seq.output_ids) - len(added) + adv.accepted :]
                added = added[: adv.accepted]
                self.num_guard_refusals += 1
                reason, error = "error", f"grammar guard refused token {refused}; the stream was stopped"
            elif adv.finished:
                reason = "stop"
            elif adv.forced:  # jump-forward: fed with the next step's pending token
                forced, reason = self._append(seq, adv.forced)
                if logprobs is not None:  # the grammar allowed nothing else: probability 1
                    logprobs = logprobs[: len(added)] + [TokenLogprob(t, 0.0, ((t, 0.0),) if seq.params.logprobs else ())
                                                         for t in forced]
                if trace is not None:
                    trace = trace[: len(added)] + forced_traces(seq.params, forced)
                added += forced
        if reason:
            self._finish(seq, reason)
        return RequestOutput(seq.seq_id, added, seq.is_finished, seq.finish_reason, len(seq.prompt_ids),
                             len(seq.output_ids), error, None if logprobs is None else logprobs[: len(added)],
                             None if trace is None else trace[: len(added)])

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self._release(seq)
        self._seqs.pop(seq.seq_id, None)

    def _release(self, seq: Sequence) -> None:
        """Free what a sequence holds outside the scheduler: its KV slot and proposer state."""
        self.runner.remove(seq.seq_id)
        if self.proposer is not None:
            self.proposer.on_finished(seq.seq_id)
        if self.adaptive is not None:
            self.adaptive.on_finished(seq.seq_id)

    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | None = None) -> list[Completion]:
        """Run a batch of prompts to completion (token ids only; `moeserve.LLM` adds text)."""
        ids = [self.add_request(p, params) for p in prompts]
        done: dict[str, Completion] = {rid: Completion(rid) for rid in ids}
        while any(not c.finished for c in done.values()):
            for out in self.step():
                c = done.get(out.request_id)
                if c is not None:
                    c.token_ids += out.new_token_ids
                    c.finished, c.finish_reason = out.finished, out.finish_reason
        return [done[rid] for rid in ids]


class StepError(RuntimeError):
    """A step failed before it emitted anything; `request_ids` were in it (the cause is chained)."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"engine step failed with {len(request_ids)} request(s) in it")
        self.request_ids = request_ids


@dataclass
class Completion:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
