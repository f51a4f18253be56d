"""Grammar + sampled drafts stay unbiased up to max_tokens (chi-square, through the engine's verify).

The grammar `[ZU](J|Xthe#){8}`: after X it forces `the#` (jump-forward tokens `the`, `#`; the
mask alone would also let `t` through), after J nothing. A proposer samples i.i.d. drafts from
a fixed q over J, X and Z (the grammar refuses Z there), k = 3, and requests of max_tokens 3..6
run through LLMEngine, so the token budget cuts proposals at every offset of the forced text
(right after X, inside `the#`, after it). The whole output of each request is compared with
the exact law of plain decoding (no drafts, jump-forward, truncated at max_tokens), computed
from the target's masked probabilities over every prefix (the closing steer is off, so that
law is the masked target's alone).

Negative controls run through the same engine and statistic (with fewer requests) and must be
rejected: the old budget rule (cut back before forced text that crosses the budget, which drops
a sampled X for its value; patched in, it reproduces the old code's outputs exactly), the new cut
without pinning the bonus position to the next forced token (the target may pick `t` there),
and a proposer that drops a refused draft token Z and what follows it (the position is then
drawn from the target instead of the residual).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from scipy.stats import chi2

from bench.tiny_checkpoint import save_tiny_checkpoint
from model_shards import CausalLM, load_checkpoint
from moeserve.config import GrammarSection
from moeserve.engine import LLMEngine, ModelRunner, SchedulerConfig, SpecConfig
from moeserve.engine import structured as structured_module
from moeserve.engine.structured import StructuredConfig, StructuredOutput
from moeserve.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarMatcher,
    GrammarSpec,
    allocate_bitmask,
    apply_bitmask,
)
from moeserve.sampling_params import SamplingParams
from moeserve.spec.proposer import Proposal, ProposalRequest, Proposer
from moeserve.tokenizer import load_tokenizer

REGEX = "[ZU](J|Xthe#){8}"  # never complete within the budgets below: every output ends at max_tokens
BUDGETS = (3, 4, 5, 6)
PER_BUDGET = 1000  # requests per budget (fixed seeds: the outcome is deterministic); controls: half
BATCH = 500
K = 3
P_MIN = 1e-3  # the implementation passes above it; every control must fall far below it
P_CONTROL = 1e-6
Q = {"J": 0.2, "X": 0.5, "Z": 0.3}  # the draft's law at every position


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_torch_thread):
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-moe"))
    tokenizer = load_tokenizer(folder)
    compiled = GrammarCompiler(tokenizer, len(tokenizer), config=GrammarSection().grammar_config()).compile(GrammarSpec.regex(REGEX))
    prompt = tokenizer.encode("Code: ")
    model = load_checkpoint(folder)
    laws = {m: plain_law(model, compiled, prompt, m) for m in BUDGETS}
    return model, tokenizer, compiled, prompt, laws


def plain_law(model: CausalLM, compiled: CompiledGrammar, prompt: list[int], max_tokens: int) -> dict[tuple[int, ...], float]:
    """P(output) of decoding without drafts: each token from the target's grammar-masked softmax
    (temperature 1), then the text the grammar forces after it; cut at max_tokens."""
    matcher, bitmask, law = GrammarMatcher(compiled), allocate_bitmask(1, compiled.vocab_size), Counter()

    def walk(out: list[int], prob: float) -> None:
        if len(out) >= max_tokens:
            law[tuple(out[:max_tokens])] += prob
            return
        assert not matcher.is_completed()
        logits = model(torch.tensor([prompt + out]))[:, -1].clone()  # [1, V]
        matcher.fill_bitmask(bitmask, 0)
        apply_bitmask(logits, bitmask)
        p = torch.softmax(logits[0].double(), -1)  # [V]
        for t in p.nonzero().flatten().tolist():
            assert matcher.accept_token(t)
            forced = matcher.forced_tokens()
            n = matcher.accept_tokens(forced)
            walk(out + [t] + forced[:n], prob * float(p[t]))
            matcher.rollback(1 + n)

    walk([], 1.0)
    return dict(law)


class IidDraft(Proposer):
    """Draft tokens drawn independently from a fixed q [V] (a sampled draft, so probs = q).
    cut_before: a known-biased proposer that drops this token and what follows it."""

    def __init__(self, q: torch.Tensor, cut_before: int | None = None, seed: int = 1) -> None:
        self.q, self.cut_before = q, cut_before
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        out = []
        for r in requests:
            tokens = torch.multinomial(self.q, r.num_tokens, replacement=True, generator=self.gen).tolist() \
                if r.num_tokens else []
            if self.cut_before in tokens:
                tokens = tokens[: tokens.index(self.cut_before)]
            out.append(Proposal(tokens, self.q.expand(len(tokens), -1) if tokens else None))
        return out

    def on_finished(self, seq_id: str) -> None:
        pass


def sample_outputs(setup, cut_before: str | None = None, n: int = PER_BUDGET,
                   trace: bool = False) -> tuple[dict[int, Counter], LLMEngine, Counter]:
    model, tokenizer, compiled, prompt, _ = setup
    q = torch.zeros(compiled.vocab_size)
    for name, mass in Q.items():
        q[tokenizer.convert_tokens_to_ids(name)] = mass
    cut = None if cut_before is None else tokenizer.convert_tokens_to_ids(cut_before)
    max_len = len(prompt) + max(BUDGETS) + K + 1
    engine = LLMEngine(
        ModelRunner(model, max_num_seqs=BATCH, max_model_len=max_len), tokenizer,
        SchedulerConfig(max_num_seqs=BATCH, max_num_batched_tokens=len(prompt) * BATCH, max_model_len=max_len),
        proposer=IidDraft(q, cut), spec=SpecConfig(num_tokens=K),
        structured=StructuredConfig(close_margin=0, close_fraction=0.0),
    )  # fmt: skip
    torch.manual_seed(0)
    ids = {}
    for m in BUDGETS:
        for _ in range(n):
            params = SamplingParams(max_tokens=m, temperature=1.0, trace_speculation=trace)
            ids[engine.add_request(prompt, params, grammar=compiled)] = m
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    sources = Counter()  # (token, its traced source)
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            sources.update((e.token_id, e.source) for e in out.trace or ())
            assert out.error is None and out.finish_reason in (None, "length")
    counts = {m: Counter() for m in BUDGETS}
    for rid, m in ids.items():
        counts[m][tuple(got[rid])] += 1
    return counts, engine, sources


def pearson(counts: Counter, law: dict[tuple[int, ...], float]) -> tuple[float, int]:
    """Pearson's statistic of the outputs against the law and its degrees of freedom; outcomes
    expected fewer than 5 times are pooled with the next rarest; an output the law gives
    probability 0 fails outright (an infinite statistic)."""
    if any(out not in law for out in counts):
        return float("inf"), 1
    n = sum(counts.values())
    cells = sorted(law, key=law.get, reverse=True)
    observed = [counts[c] for c in cells]
    expected = [law[c] * n for c in cells]
    while len(expected) > 1 and expected[-1] < 5:  # pool the rarest into the cell before them
        observed[-2] += observed.pop()
        expected[-2] += expected.pop()
    return sum((o - e) ** 2 / e for o, e in zip(observed, expected)), len(expected) - 1


def pvalues(setup, counts: dict[int, Counter]) -> dict[int | str, float]:
    """The p-value per budget, and "all": of the budgets' statistics summed (independent samples)."""
    stats = {m: pearson(counts[m], setup[4][m]) for m in BUDGETS}
    out: dict[int | str, float] = {m: float(chi2.sf(s, d)) for m, (s, d) in stats.items()}
    out["all"] = float(chi2.sf(sum(s for s, _ in stats.values()), sum(d for _, d in stats.values())))
    return out


def old_cut_at_budget(source: list[int], limit: int | None) -> int:
    """The rule before: never end inside forced text, so back to the token before it."""
    keep = len(source) if limit is None else min(len(source), limit)
    while keep < len(source) and source[keep] < 0:
        keep -= 1
    return keep


def test_outputs_near_the_budget_follow_plain_decoding(setup):
    counts, engine, _ = sample_outputs(setup)
    got = pvalues(setup, counts)
    assert min(got.values()) > P_MIN, got
    m = engine.spec_metrics
    assert m.num_draft_tokens > 0 and 0.2 < m.num_accepted_tokens / m.num_draft_tokens < 0.95  # rejections too
    assert engine.structured.num_forced_tokens > 0 and engine.num_guard_refusals == 0


def test_control_the_old_budget_rule_is_rejected(setup, monkeypatch):
    monkeypatch.setattr(structured_module, "_cut_at_budget", old_cut_at_budget)
    got = pvalues(setup, sample_outputs(setup, n=PER_BUDGET // 2)[0])
    assert got["all"] < P_CONTROL, got


def test_control_an_unpinned_bonus_is_rejected(setup, monkeypatch):
    walk = StructuredOutput._walk
    monkeypatch.setattr(StructuredOutput, "_walk", lambda self, *args: replace(walk(self, *args), bonus=None))
    got = pvalues(setup, sample_outputs(setup, n=PER_BUDGET // 8)[0])
    assert got[3] == 0.0, got  # `X t`: the target's own split of forced text, which plain decoding never emits


def test_control_a_refused_draft_drawn_from_the_target_is_rejected(setup):
    """The refused sampled draft (tests/engine/test_structured_output.py): dropping it and drawing
    the position from the masked target instead of rejecting it by the rule leans toward q."""
    got = pvalues(setup, sample_outputs(setup, cut_before="Z", n=PER_BUDGET // 2)[0])
    assert got["all"] < P_CONTROL, got


def test_forced_text_is_traced_as_forced_also_where_the_budget_pinned_the_bonus(setup):
    """`the` and `#` are only ever forced text: whether put into a proposal, appended by
    jump-forward or sampled at a bonus position the budget pinned, each is traced "forced"."""
    _, tokenizer, *_ = setup
    sources = sample_outputs(setup, n=PER_BUDGET // 8, trace=True)[2]
    forced = {tokenizer.convert_tokens_to_ids(t) for t in ("the", "#")}
    assert sum(c for (t, _), c in sources.items() if t in forced) > 0
    assert {src for (t, src) in sources if t in forced} == {"forced"}, sources
    assert "forced" not in {src for (t, src) in sources if t not in forced}, sources
