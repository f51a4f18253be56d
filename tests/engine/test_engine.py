"""The engine against transformers `generate` (greedy), batching invariance, speculation exactness."""

from __future__ import annotations

import time

import pytest
import torch

from model_shards import load_checkpoint
from moeserve.engine import LLMEngine, ModelRunner, SchedulerConfig, SpecConfig
from moeserve.engine.model_runner import length_groups
from moeserve.sampling_params import SamplingParams
from moeserve.spec.ngram import NgramProposer
from moeserve.spec.proposer import Proposal, ProposalRequest, Proposer
from tests.model_shards.hf_tiny import save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixtral")
    hf = save_tiny("mixtral", folder)
    return folder, hf


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 96, (int(torch.randint(3, 15, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def make_engine(folder, max_num_seqs=8, proposer=None, k=0) -> LLMEngine:
    runner = ModelRunner(load_checkpoint(folder), max_num_seqs=max_num_seqs, max_model_len=128)
    return LLMEngine(runner, proposer=proposer, spec=SpecConfig(num_tokens=k))


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_greedy_matches_transformers_generate(tiny):
    folder, hf = tiny
    ps = prompts(5)
    outs = make_engine(folder).generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(hf, p, 12)
        assert o.finish_reason == "length"


def test_batch_composition_does_not_change_output(tiny):
    """Requests joining mid-flight (fewer slots than requests) give the same tokens as alone."""
    folder, _ = tiny
    ps = prompts(7, seed=1)
    alone = [make_engine(folder, max_num_seqs=1).generate([p], GREEDY)[0].token_ids for p in ps]
    together = make_engine(folder, max_num_seqs=3).generate(ps, GREEDY)
    assert [o.token_ids for o in together] == alone


def test_ragged_prompts_prefill_in_length_groups_with_unchanged_output(tiny, monkeypatch):
    """Two 120-token prompts and four short ones: the prefill runs as two passes (long, then
    short), and every sequence still matches transformers."""
    folder, hf = tiny
    ps = [(p * 40)[:120] for p in prompts(2, seed=3)] + [p[:5] for p in prompts(4, seed=4)]
    engine = make_engine(folder)
    runner_forward, passes = engine.runner.forward, []

    def counting_forward(rows, logits="last"):
        passes.append(len(rows))
        return runner_forward(rows, logits)

    monkeypatch.setattr(engine.runner, "forward", counting_forward)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = engine.generate(ps, params)
    assert passes[:2] == [2, 4]
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(hf, p, 4)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_ngram_speculation_is_exact_under_greedy(tiny, k):
    folder, _ = tiny
    ps = [p * 3 for p in prompts(6, seed=2)]  # repetitive prompts so lookup proposes often
    plain = make_engine(folder).generate(ps, GREEDY)
    engine = make_engine(folder, proposer=NgramProposer(), k=k)
    spec = engine.generate(ps, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.spec_metrics.num_draft_tokens > 0


def test_speculation_pauses_while_the_batch_is_big(tiny):
    """disable_by_batch_size=4: six prompts decode plainly until fewer than four remain, then draft."""
    folder, _ = tiny
    ps = [p * 3 for p in prompts(6, seed=2)]
    lengths = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, 4, 4, 24, 24, 24)]
    runner = ModelRunner(load_checkpoint(folder), max_num_seqs=8, max_model_len=128)
    engine = LLMEngine(runner, proposer=NgramProposer(), spec=SpecConfig(num_tokens=3, disable_by_batch_size=4))
    for p, params in zip(ps, lengths):
        engine.add_request(p, params)
    widths = []
    while engine.has_unfinished():
        running = len(engine.scheduler.running)
        before = engine.spec_metrics.num_seq_passes
        engine.step()
        widths.append((running, engine.spec_metrics.num_seq_passes - before))
    assert engine.num_spec_disabled_steps > 0 and engine.spec_metrics.num_draft_tokens > 0
    assert all(passes == 0 for running, passes in widths if running >= 4)
    assert any(passes > 0 for running, passes in widths if running < 4)
    plain = make_engine(folder).generate(ps, GREEDY)
    assert [o.token_ids for o in engine.generate(ps, GREEDY)] == [o.token_ids for o in plain]
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpecConfig(disable_by_batch_size=-1)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    folder, _ = tiny
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    p = prompts(1, seed=3)[0]
    a = make_engine(folder).generate([p], params)[0].token_ids
    b = make_engine(folder).generate([p] + prompts(3, seed=4), params)[0].token_ids
    assert a == b


def test_stop_token_and_abort(tiny):
    folder, hf = tiny
    p = prompts(1, seed=5)[0]
    ref = hf_greedy(hf, p, 12)
    engine = make_engine(folder)
    out = engine.generate([p], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(ref[3],)))[0]
    assert out.token_ids == ref[: ref.index(ref[3])] and out.finish_reason == "stop"
    rid = engine.add_request(p, GREEDY)
    engine.step()
    engine.abort(rid)
    assert not engine.has_unfinished() and engine.runner.num_free_slots == engine.runner.max_num_seqs


def test_bad_prompts_raise(tiny):
    engine = make_engine(tiny[0])
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="context"):
        engine.add_request([3] * 200, GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1000], GREEDY)


def test_kv_budget_preempts_and_recomputes_without_changing_output(tiny):
    """A KV budget too small for every sequence at once preempts the newest (recompute);
    greedy outputs are exactly those of an unconstrained run."""
    folder, _ = tiny
    ps = prompts(6, seed=11)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    free = make_engine(folder).generate(ps, params)
    runner = ModelRunner(load_checkpoint(folder), max_num_seqs=8, max_model_len=128)
    tight = LLMEngine(runner, scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=128, kv_budget_tokens=150))
    out = tight.generate(ps, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in free]
    assert tight.scheduler.num_preemptions > 0
    assert runner.num_free_slots == 8 and tight.scheduler.kv_tokens_used == 0


def test_kv_budget_must_hold_one_sequence():
    with pytest.raises(ValueError, match="kv_budget_tokens"):
        SchedulerConfig(max_model_len=128, kv_budget_tokens=64)


def _partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]


@pytest.mark.parametrize("seed", range(20))
def test_length_groups_is_the_cheapest_partition(seed):
    """Oracle: every way to split up to 7 rows into passes, costed as padded positions plus
    the per-pass overhead; the dynamic program must find the minimum and cover each row once."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 8, (1,), generator=g))
    lengths = torch.randint(1, 400, (n,), generator=g).tolist()
    overhead = int(torch.randint(0, 300, (1,), generator=g))

    def cost(groups):
        return sum(overhead + len(grp) * max(lengths[i] for i in grp) for grp in groups)

    groups = length_groups(lengths, overhead)
    assert sorted(i for grp in groups for i in grp) == list(range(n))
    assert cost(groups) == min(cost(p) for p in _partitions(list(range(n))))


def test_length_groups_keeps_similar_lengths_together():
    assert length_groups([1] * 16) == [list(range(16))]
    assert length_groups([]) == []
    assert length_groups([382, 31, 380], overhead_tokens=0) == [[0], [2], [1]]


class _Replay(Proposer):
    """Proposes the reference continuation (every draft accepted), to exercise the verify pass."""

    def __init__(self, prompts: list[list[int]], continuations: list[list[int]]) -> None:
        self.full = [p + c for p, c in zip(prompts, continuations)]

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        out = []
        for r in requests:
            ids = list(r.token_ids)
            ref = next(f for f in self.full if f[: len(ids)] == ids)
            out.append(Proposal(ref[len(ids) : len(ids) + r.num_tokens]))
        return out

    def on_finished(self, seq_id: str) -> None:
        pass


def test_logprobs_from_the_verify_pass_equal_plain_decoding(tiny):
    """Greedy and sampled (top-k) logprobs: one per token, the greedy token the maximum, and
    the same values whether the tokens came from plain decode steps or were verified drafts."""
    folder, _ = tiny
    ps = prompts(3, seed=8)
    for params in (SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3),
                   SamplingParams(max_tokens=10, temperature=0.7, top_k=4, seed=5, ignore_eos=True, logprobs=4)):
        plain = _run_with_logprobs(make_engine(folder), ps, params)
        replay = _Replay(ps, [tokens for tokens, _ in plain])
        spec = _run_with_logprobs(make_engine(folder, proposer=replay, k=4), ps, params)
        for (tokens, lps), (spec_tokens, spec_lps) in zip(plain, spec):
            assert spec_tokens == tokens and [e.token_id for e in lps] == tokens
            for a, b in zip(lps, spec_lps):
                assert abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]
                assert a.logprob <= 0 and len(a.top) == params.logprobs
                if params.greedy:
                    assert a.top[0][0] == a.token_id
                else:
                    assert a.token_id in [t for t, _ in a.top]  # top-k 4: the whole final distribution


def _run_with_logprobs(engine: LLMEngine, ps: list[list[int]], params: SamplingParams) -> list[tuple[list, list]]:
    ids = [engine.add_request(p, params) for p in ps]
    out = {rid: ([], []) for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(o.logprobs)
    return [out[rid] for rid in ids]


class SlowPerfectDraft(Proposer):
    """Proposes the known greedy continuation (every draft accepted), taking `delay_s` per call."""

    def __init__(self, continuations: dict[tuple, list[int]], delay_s: float) -> None:
        self.continuations, self.delay_s = continuations, delay_s

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        time.sleep(self.delay_s)
        out = []
        for r in requests:
            for prompt, cont in self.continuations.items():
                if tuple(r.token_ids[: len(prompt)]) == prompt:
                    done = len(r.token_ids) - len(prompt)
                    out.append(Proposal(cont[done : done + r.num_tokens]))
        return out

    def on_finished(self, seq_id: str) -> None:
        pass


def test_drafting_that_does_not_pay_as_realized_is_refused(tiny):
    """Adaptive k's cost model believes drafting is free (never refit here); the draft is perfect
    but takes 30 ms a call, far more than the 2 tokens per pass it buys: the engine's PayGuard
    measures whole steps, with and without drafts, and stops drafting. The same draft without
    the delay keeps drafting (2 tokens per step). Output is plain decoding's either way."""
    from moeserve.spec import AdaptiveK, AdaptiveKConfig, CostModel

    folder, _ = tiny
    ps = prompts(2, seed=3)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in make_engine(folder).generate(ps, params)]
    continuations = {tuple(p): o for p, o in zip(ps, plain)}
    drafted = {}
    for delay in (0.03, 0.0):
        runner = ModelRunner(load_checkpoint(folder), max_num_seqs=8, max_model_len=128)
        free = CostModel(target_base_s=1e-3, target_per_token_s=1e-6, draft_per_token_s=1e-6)
        engine = LLMEngine(runner, proposer=SlowPerfectDraft(continuations, delay),
                           spec=SpecConfig(num_tokens=1, adaptive=True),
                           adaptive=AdaptiveK(AdaptiveKConfig(k_max=1), free, refit_every=10**6))
        assert [o.token_ids for o in engine.generate([ps[0]], params)] == [plain[0]]
        before = engine.spec_metrics.num_seq_passes
        assert [o.token_ids for o in engine.generate([ps[1]], params)] == [plain[1]]
        drafted[delay] = engine.spec_metrics.num_seq_passes - before  # steps that drafted, second request
    # slow: at most one recheck's min_steps (8) drafting steps in the second request's ~60 steps
    assert drafted[0.03] <= engine.adaptive.guard.min_steps and drafted[0.0] >= 25, drafted
