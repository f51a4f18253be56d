"""Grammar-constrained generation in the engine, on a random model (the hardest case).

Oracles: every finished output satisfies its grammar (`check_output`: json + jsonschema,
re.fullmatch, choice membership) and replays through an independent matcher; greedy
speculative decoding under a grammar returns exactly the tokens of greedy decoding without
it, whatever the proposer proposes (garbage drafts are cut, right drafts are accepted).
"""

from __future__ import annotations

import pytest

from bench.oracle import check_output
from bench.tiny_checkpoint import save_tiny_checkpoint
from model_shards import load_checkpoint
from moeserve.config import GrammarSection
from moeserve.engine import LLMEngine, ModelRunner, SpecConfig
from moeserve.engine.structured import StructuredConfig
from moeserve.grammar import GrammarCompiler, GrammarMatcher, GrammarSpec
from moeserve.sampling_params import SamplingParams
from moeserve.spec.ngram import NgramProposer
from moeserve.spec.proposer import Proposal, ProposalRequest, Proposer
from moeserve.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"enum": ["small", "medium", "large"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "vegan": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "size", "count", "vegan"],
    "additionalProperties": False,
}
SPECS = {
    "json_schema": GrammarSpec.json_schema(SCHEMA),
    "json_object": GrammarSpec.json_object(),
    "regex": GrammarSpec.regex(r"[a-z]{3}-\d{2,4}( ok)?"),
    "choice": GrammarSpec.choice(["yes", "no", "maybe later"]),
    "ebnf": GrammarSpec.ebnf('root ::= "(" item ("," item)? ")"\nitem ::= [a-z] [a-z]? [a-z]?'),
}
PROMPTS = ["Order: ", "The bakery sells", '{"item": "bread", "price": 3}']


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-moe"))
    tokenizer = load_tokenizer(folder)
    return folder, tokenizer, GrammarCompiler(tokenizer, len(tokenizer), config=GrammarSection().grammar_config())


def make_engine(folder, tokenizer, proposer=None, k=0, jump_forward=True) -> LLMEngine:
    runner = ModelRunner(load_checkpoint(folder), max_num_seqs=8, max_model_len=512)
    return LLMEngine(runner, tokenizer, proposer=proposer, spec=SpecConfig(num_tokens=k),
                     structured=StructuredConfig(jump_forward=jump_forward))


def run(engine: LLMEngine, jobs: list[tuple[str, SamplingParams, object]]) -> list[tuple[list[int], str, str]]:
    """(tokens, text, finish_reason) per job, all jobs batched together."""
    ids = [engine.add_request(p, params, grammar=g) for p, params, g in jobs]
    got = {rid: ([], None) for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            toks, _ = got[out.request_id]
            got[out.request_id] = (toks + out.new_token_ids, out.finish_reason)
    decode = engine.tokenizer.decode  # the engine is token-only; the serving side makes the text
    return [(got[r][0], decode(got[r][0], skip_special_tokens=True), got[r][1]) for r in ids]


def assert_accepted(spec: GrammarSpec, compiler, tokens: list[int], text: str, reason: str) -> None:
    assert reason == "stop", f"{spec.kind}: finished with {reason!r}: {text!r}"
    assert check_output(spec, text) is None, f"{spec.kind}: {check_output(spec, text)}: {text!r}"
    guard = GrammarMatcher(compiler.compile(spec))  # an independent matcher replays the tokens
    assert guard.accept_tokens(tokens) == len(tokens) and guard.is_completed()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_grammar_kind_gives_accepted_outputs(tiny, temperature):
    folder, tokenizer, compiler = tiny
    engine = make_engine(folder, tokenizer)
    jobs = [
        (prompt, SamplingParams(max_tokens=160, temperature=temperature, seed=i), compiler.compile(spec))
        for i, prompt in enumerate(PROMPTS)
        for spec in SPECS.values()
    ]
    for (_, _, compiled), (tokens, text, reason) in zip(jobs, run(engine, jobs)):
        assert_accepted(compiled.spec, compiler, tokens, text, reason)
    assert engine.structured.num_forced_tokens > 0  # jump-forward fired (e.g. `"size":"` in the schema)


def test_greedy_speculation_under_a_grammar_is_exact(tiny):
    """n-gram drafts + jump-forward (several fed tokens per row) + masks for k+1 positions."""
    folder, tokenizer, compiler = tiny
    jobs = [(p, SamplingParams(max_tokens=160, temperature=0.0), compiler.compile(s))
            for p in PROMPTS for s in SPECS.values()]
    plain = run(make_engine(folder, tokenizer), jobs)
    engine = make_engine(folder, tokenizer, proposer=NgramProposer(), k=3)
    spec = run(engine, jobs)
    assert [t for t, _, _ in spec] == [t for t, _, _ in plain]
    assert engine.spec_metrics.num_draft_tokens > 0 and engine.structured.num_forced_tokens > 0


class FixedProposer(Proposer):
    """Proposes the same tokens every step (to feed the grammar drafts it must refuse)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        return [Proposal(self.tokens[: r.num_tokens]) for r in requests]

    def on_finished(self, seq_id: str) -> None:
        pass


class ReplayProposer(FixedProposer):
    """Proposes the known continuation of a prompt of `prompt_len` tokens (a perfect draft)."""

    def __init__(self, prompt_len: int, continuation: list[int]) -> None:
        self.prompt_len, self.continuation = prompt_len, continuation

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        done = [len(r.token_ids) - self.prompt_len for r in requests]
        return [Proposal(self.continuation[d : d + r.num_tokens]) for d, r in zip(done, requests)]


def test_refused_drafts_are_cut_and_perfect_drafts_accepted(tiny):
    folder, tokenizer, compiler = tiny
    compiled = compiler.compile(SPECS["json_schema"])
    job = [("Order: ", SamplingParams(max_tokens=160, temperature=0.0), compiled)]
    (plain_tokens, _, _), = run(make_engine(folder, tokenizer, jump_forward=False), job)

    garbage = tokenizer.encode("zz zz zz zz")  # never valid where a JSON object starts or continues
    engine = make_engine(folder, tokenizer, proposer=FixedProposer(garbage), k=4, jump_forward=False)
    (tokens, text, reason), = run(engine, job)
    assert tokens == plain_tokens
    assert_accepted(compiled.spec, compiler, tokens, text, reason)

    prompt_len = len(tokenizer.encode("Order: "))
    engine = make_engine(folder, tokenizer, proposer=ReplayProposer(prompt_len, plain_tokens), k=4,
                         jump_forward=False)
    (tokens, _, _), = run(engine, job)
    assert tokens == plain_tokens
    assert engine.spec_metrics.acceptance_rate > 0.9


def test_adaptive_k_counts_a_constrained_draft_that_stops_short_as_a_pass_ending(tiny):
    """A perfect draft that returns 1 token where 4 were asked: under a grammar that is a draft
    stopped where the grammar forces text, so every pass ends after 1 token (alpha ~0.5); for an
    unconstrained row a short proposal says nothing of the text (alpha ~1). Output is plain
    decoding's either way."""
    from moeserve.engine import SchedulerConfig
    from moeserve.spec import AdaptiveK, AdaptiveKConfig, CostModel

    folder, tokenizer, compiler = tiny
    params = SamplingParams(max_tokens=60, temperature=0.0)
    prompt_len = len(tokenizer.encode("Order: "))
    alphas = {}
    for grammar in (None, compiler.compile(SPECS["json_schema"])):
        job = [("Order: ", params, grammar)]
        (plain_tokens, _, _), = run(make_engine(folder, tokenizer), job)
        one = ReplayProposer(prompt_len, plain_tokens)
        one.propose = lambda requests, full=one.propose: [Proposal(p.token_ids[:1]) for p in full(requests)]
        free = CostModel(target_base_s=1e-3, target_per_token_s=1e-6, draft_per_token_s=1e-6)
        engine = LLMEngine(ModelRunner(load_checkpoint(folder), max_num_seqs=8, max_model_len=512), tokenizer,
                           SchedulerConfig(8, 1 << 14, 512), proposer=one,
                           spec=SpecConfig(num_tokens=4, adaptive=True),
                           adaptive=AdaptiveK(AdaptiveKConfig(k_max=4, prior_weight=1e-3), free, refit_every=10**6))
        (tokens, _, _), = run(engine, job)
        assert tokens == plain_tokens
        alphas[grammar is not None] = engine.adaptive.alpha("pool")
    assert alphas[False] > 0.95 and 0.4 < alphas[True] < 0.6, alphas


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(tiny):
    folder, tokenizer, compiler = tiny
    free = ("The bakery sells", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), None)
    (alone, _, _), = run(make_engine(folder, tokenizer), [free])
    mixed = run(make_engine(folder, tokenizer), [free] + [("Order: ", free[1], compiler.compile(SPECS["json_schema"]))])
    assert mixed[0][0] == alone


def test_grammar_from_another_vocabulary_is_refused(tiny):
    folder, tokenizer, _ = tiny
    other = GrammarCompiler(tokenizer, len(tokenizer) + 24, config=GrammarSection().grammar_config())
    engine = make_engine(folder, tokenizer)
    with pytest.raises(ValueError, match="compiled for"):
        engine.add_request("x", SamplingParams(), grammar=other.compile(SPECS["regex"]))


def test_a_refused_sampled_draft_is_rejected_by_the_rule_not_resampled(tiny):
    """The issue's worked case: masked target p = [.5, .5] over tokens a, b; a sampled draft with
    q = [.4, .1, .5] over a, b and a token c the grammar refuses. The first emitted token must
    follow p (cutting c and drawing from p instead gives [.65, .35]); chi-square over 20,000 steps."""
    import torch
    from scipy.stats import chisquare

    from moeserve.engine.structured import StructuredOutput
    from moeserve.sampler import Sampler
    from moeserve.sequence import Sequence
    from moeserve.spec.proposer import pad_proposals
    from moeserve.spec.rejection_sampler import RejectionSampler

    _, tokenizer, compiler = tiny
    a, b, c = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "b", "c"))
    vocab = len(tokenizer)
    structured, sampler, rejection = StructuredOutput(vocab), Sampler(), RejectionSampler()
    seq = Sequence("s", [a], SamplingParams(max_tokens=8, temperature=1.0))
    seq.grammar = structured.new_request(compiler.compile(GrammarSpec.regex("[ab]x")))
    q = torch.zeros(vocab)
    q[a], q[b], q[c] = 0.4, 0.1, 0.5
    target = torch.full((1, 3, vocab), -5.0)  # the draft token, the forced "x" after it, the token after that
    target[0, :, a] = target[0, :, b] = 5.0  # after the mask: p = [.5, .5] over a, b
    gen = torch.Generator().manual_seed(0)
    counts = {a: 0, b: 0}
    for x in torch.multinomial(q, 20_000, replacement=True, generator=gen).tolist():
        (prop,) = structured.cut_and_fill([seq], [Proposal([x], q[None])])
        logits = target[:, : prop.num_tokens + 1].clone()
        structured.apply(logits)
        ids, probs, n = pad_proposals([prop])
        out = rejection.sample(sampler.probs(logits, [seq.params]), ids, probs, n)
        counts[out.token_ids[0][0]] += 1
    assert chisquare([counts[a], counts[b]], [10_000, 10_000]).pvalue > 1e-3, counts


@pytest.mark.parametrize("jump_forward", [True, False])
def test_sampled_drafts_through_forced_text_follow_decoding_with_jump_forward(tiny, jump_forward):
    """Regex [ab]ke: after a or b the grammar forces "ke", which decoding with jump-forward appends
    as the one token `ke`, unsampled. A sampled draft proposes a or b (q = [.7, .3] against the
    masked target's p = [.5, .5]), then `k`, `e`: a split of its own, which the target (preferring
    `k`) would keep if verified as drafted. With jump-forward the engine puts `ke` into the
    proposal after the first token (only it allowed there): over 20,000 steps the first token
    follows p and the second, where the first was accepted, is always `ke`. The negative control (jump_forward=False: verified as
    drafted) emits the `k` split."""
    import torch
    from scipy.stats import chisquare

    from moeserve.engine.structured import StructuredConfig, StructuredOutput
    from moeserve.sampler import Sampler
    from moeserve.sequence import Sequence
    from moeserve.spec.proposer import pad_proposals
    from moeserve.spec.rejection_sampler import RejectionSampler

    _, tokenizer, compiler = tiny
    a, b, k, e, ke = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "b", "k", "e", "ke"))
    vocab = len(tokenizer)
    structured, sampler, rejection = StructuredOutput(vocab, StructuredConfig(jump_forward)), Sampler(), RejectionSampler()
    seq = Sequence("s", [a], SamplingParams(max_tokens=8, temperature=1.0))
    seq.grammar = structured.new_request(compiler.compile(GrammarSpec.regex("[ab]ke")))
    q = torch.zeros(3, vocab)
    q[0, a], q[0, b] = 0.7, 0.3
    q[1, k] = q[2, e] = 1.0
    target = torch.full((1, 4, vocab), -30.0)  # (the mask also allows `ak`, `ake` and the like first)
    target[0, 0, a] = target[0, 0, b] = 5.0  # after the mask: p = [.5, .5] over a, b
    target[0, 1:, k], target[0, 1:, ke], target[0, 1:, e] = 6.0, 4.0, 6.0  # the target prefers the `k` split
    gen = torch.Generator().manual_seed(0)
    firsts, seconds = {a: 0, b: 0}, {}
    for x in torch.multinomial(q[0], 20_000, replacement=True, generator=gen).tolist():
        (prop,) = structured.cut_and_fill([seq], [Proposal([x, k, e], q)])
        logits = target[:, : prop.num_tokens + 1].clone()
        structured.apply(logits)
        ids, probs, n = pad_proposals([prop])
        out = rejection.sample(sampler.probs(logits, [seq.params]), ids, probs, n).token_ids[0]
        firsts[out[0]] += 1
        if len(out) > 1:  # the first token was accepted (else the engine appends the forced text after it)
            seconds[out[1]] = seconds.get(out[1], 0) + 1
    assert chisquare([firsts[a], firsts[b]], [10_000, 10_000]).pvalue > 1e-3, firsts
    if jump_forward:
        assert set(seconds) == {ke} and seconds[ke] > 10_000, seconds
    else:
        assert seconds.get(k, 0) > 10_000, seconds


class NoGrammarDraft(Proposer):
    """The same draft model, not shown the grammar (what a draft deployment sees)."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        return self.inner.propose([ProposalRequest(r.seq_id, r.token_ids, r.num_tokens, r.params) for r in requests])

    def on_finished(self, seq_id: str) -> None:
        self.inner.on_finished(seq_id)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_model_drafts_from_its_own_masked_distribution(tiny, temperature):
    """The target as its own draft: shown the grammar, it masks its own distribution as the target
    masks p, so (greedy) every draft is the target's masked argmax, or (sampled) q equals the
    masked p, and nearly every draft is accepted (the rest: where the target steers toward closing
    the output before max_tokens); not shown it, the draft proposes tokens the grammar refuses,
    which are cut before verification, so a pass yields fewer tokens. Greedy output stays exactly
    plain decoding's; the matchers end where they were (every output replays through its grammar)."""
    from moeserve.engine.draft_model import DraftModelProposer

    folder, tokenizer, compiler = tiny
    jobs = [(p, SamplingParams(max_tokens=60, temperature=temperature, seed=None), compiler.compile(s))
            for p in PROMPTS[:2] for s in (SPECS["json_schema"], SPECS["regex"], SPECS["ebnf"])]
    rates, per_pass, outputs = {}, {}, {}
    for shown in (True, False):
        draft = DraftModelProposer(load_checkpoint(folder), 8, 512, greedy=temperature == 0.0)
        engine = make_engine(folder, tokenizer, proposer=draft if shown else NoGrammarDraft(draft), k=4)
        outputs[shown] = run(engine, jobs)
        rates[shown], per_pass[shown] = engine.spec_metrics.acceptance_rate, engine.spec_metrics.tokens_per_pass
        for spec, (tokens, text, reason) in zip([j[2].spec for j in jobs], outputs[shown]):
            assert_accepted(spec, compiler, tokens, text, reason)
    assert rates[True] > 0.75 and per_pass[True] > per_pass[False] + 0.5, (rates, per_pass)
    if temperature == 0.0:
        assert [t for t, _, _ in outputs[True]] == [t for t, _, _ in run(make_engine(folder, tokenizer), jobs)]


class CountingDraft(Proposer):
    """Counts the draft tokens a proposer returns (before the engine cuts any); `jump_forward`
    overrides what the engine asks for (False: the draft goes token by token through forced text)."""

    def __init__(self, inner: Proposer, jump_forward: bool) -> None:
        self.inner, self.jump_forward, self.num_proposed = inner, jump_forward, 0

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        out = self.inner.propose([ProposalRequest(r.seq_id, r.token_ids, r.num_tokens, r.params, r.grammar,
                                                  jump_forward=self.jump_forward) for r in requests])
        self.num_proposed += sum(len(p.token_ids) for p in out)
        return out

    def on_finished(self, seq_id: str) -> None:
        self.inner.on_finished(seq_id)


def test_a_greedy_draft_drafts_through_the_text_its_grammar_forces(tiny):
    """With jump-forward, decoding without drafts emits a token and then the text the grammar
    forces after it. The engine puts that text into a proposal after the draft token (allowing
    only its own tokens there) and verifies the draft's tokens after it. A draft told the engine
    jump-forwards (`jump_forward`, what the engine asks) puts the same text in itself and drafts
    on after it: with the target as its own draft, the engine keeps every proposal as it came (but
    for the text forced after its last draft token), proposals go on past forced text, and the documents take under half as many target passes as
    plain decoding takes steps. A draft that drafts token by token through forced text (its own
    split of it) has proposals changed by the engine. Output stays exactly plain decoding's."""
    from moeserve.engine.draft_model import DraftModelProposer

    folder, tokenizer, compiler = tiny
    jobs = [(p, SamplingParams(max_tokens=60, temperature=0.0), compiler.compile(SPECS["json_schema"]))
            for p in PROMPTS]
    baseline = make_engine(folder, tokenizer)
    plain = run(baseline, jobs)
    plain_steps = sum(len(t) for t, _, _ in plain) - baseline.structured.num_forced_tokens  # one chosen token a step
    changed, through, passes = {}, {}, {}
    for stop in (True, False):
        draft = CountingDraft(DraftModelProposer(load_checkpoint(folder), 8, 512), stop)
        engine = make_engine(folder, tokenizer, proposer=draft, k=4)
        walk, pairs = engine.structured.cut_and_fill, []

        def recording(seqs, proposals, limits=None, walk=walk, pairs=pairs):
            out = walk(seqs, proposals, limits)
            pairs.extend((list(p.token_ids), list(w.token_ids), w.forced) for p, w in zip(proposals, out))
            return out

        engine.structured.cut_and_fill = recording
        assert [t for t, _, _ in run(engine, jobs)] == [t for t, _, _ in plain]
        assert engine.structured.num_forced_tokens > 0 and engine.spec_metrics.num_draft_tokens > 0
        # changed: anything but the forced text after a proposal's last draft token put in
        changed[stop] = sum(w[: len(raw)] != raw or any(j not in f for j in range(len(raw), len(w)))
                            for raw, w, f in pairs)
        through[stop] = sum(any(j + 1 < len(w) and j + 1 not in f for j in f) for _, w, f in pairs)
        passes[stop] = engine.spec_metrics.num_seq_passes
    assert changed[True] == 0 and changed[False] > 0, changed
    assert through[True] > 0, through
    assert passes[True] < 0.5 * plain_steps, (passes, plain_steps)


def test_the_offline_api_takes_each_structured_output_kind(tiny):
    """`SamplingParams(structured_outputs=StructuredOutputsParams(...))` (vLLM's names) in `LLM.generate`
    and `LLM.stream`: every kind, greedy and sampled, batched with a free request; each output
    satisfies its grammar, and the free one is unconstrained."""
    from moeserve import LLM, StructuredOutputsParams

    folder, _, _ = tiny
    kinds = {"json_schema": {"json": SCHEMA}, "json_object": {"json_object": True},
             "regex": {"regex": SPECS["regex"].value}, "choice": {"choice": ["yes", "no", "maybe later"]},
             "ebnf": {"grammar": SPECS["ebnf"].value}}
    llm = LLM(str(folder), "none", max_model_len=512)
    params = [SamplingParams(max_tokens=160, temperature=t, seed=3, structured_outputs=StructuredOutputsParams(**kw))
              for kw in kinds.values() for t in (0.0, 1.0)]
    outs = llm.generate([PROMPTS[0]] * (len(params) + 1), [*params, SamplingParams(max_tokens=8, temperature=0)])
    for kind, out in zip([k for k in kinds for _ in (0, 1)], outs):
        assert out.finish_reason == "stop", (kind, out.text)
        assert check_output(SPECS[kind], out.text) is None, (kind, out.text)
    assert len(outs[-1].token_ids) == 8  # the free request in the same batch ran its length
    streamed = "".join(text for text, _ in llm.stream(PROMPTS[1], params[0]))
    assert check_output(SPECS["json_schema"], streamed) is None and streamed == llm.generate(PROMPTS[1], params[0])[0].text
    with pytest.raises(ValueError, match="set one of"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams()))
    with pytest.raises(ValueError, match="at most one"):
        StructuredOutputsParams(regex="a", choice=["a"]).spec()


def test_a_stream_left_early_does_not_break_the_next_call(tiny):
    """Breaking out of `LLM.stream` leaves its request in the engine: the next call drops it (an abort)
    instead of failing on its outputs, and writes what it writes alone."""
    from moeserve import LLM

    folder, _, _ = tiny
    llm = LLM(str(folder), "none", max_model_len=512)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], params)[0].text
    for i, _ in enumerate(llm.stream(PROMPTS[0], params)):
        if i == 2:
            break
    assert llm.generate(PROMPTS[1], params)[0].text == alone
    assert "".join(text for text, _ in llm.stream(PROMPTS[1], params)) == alone
    assert not llm.engine.has_unfinished()
