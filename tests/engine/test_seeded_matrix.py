"""A seeded request's reply is a function of the request alone, on every runner: the paged runner
(the default), the compiled step, a 2-rank expert-parallel group (gloo), and the paged runner with
the demo draft model speculating (the default configuration); free text and under a JSON schema;
alone, amid 15 other requests, and resumed from prefixes of its reply (as the gateway resumes after
a failover). Demo checkpoint and tokenizer, temperature 0.8 (top-p 0.9 on one seed).

What is bitwise and what is not (CPU, float32): the logits a token is drawn from change in their
last bits with the batch around it (the rows and padding of a pass), between a resumed prefill and
the decode steps it replaces, between the eager and the compiled pass, after verify passes (which
cache several positions at once), and on the group when its ranks hold other sequences; only a request alone on the group gets the single process's logits
bit for bit. The tokens are the same everywhere: a seeded draw is the argmax of p(x) / E_x with
noise keyed by (seed, position), so a last-bits change moves a token only where two candidates
tie to about one part in a million. The tests pin both: tokens equal, logits equal within 1e-4
(bitwise where stated). A token mismatch with logits that close is such a tie, not a lost key."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from bench.local_group import LocalShardGroup
from bench.oracle import check_output
from moeserve.config import AppConfig, GrammarSection
from moeserve.engine import LLMEngine
from moeserve.engine.factory import build_engine, demo_checkpoint
from moeserve.grammar import GrammarCompiler, GrammarMatcher
from tests.engine.seeded_cases import PARAMS, QUESTIONS, SCHEMA_SPEC, Result, Runs, run_matrix

RUNNERS = ("paged", "compiled", "sharded", "drafted")  # drafted: the paged runner + the demo draft model
KINDS = ("free", "schema")
MAX_LEN = 256
ATOL = 1e-4  # logits: only their last bits move (see above)
# resumed from every proper prefix on the default runner; every third on the others, whose resumes
# differ only in the numbers of their passes (the resume itself is the engine's, shared)
CUT_EVERY = {"paged": 1, "compiled": 3, "sharded": 3, "drafted": 3}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@contextmanager
def engine_on(runner: str) -> Iterator[LLMEngine]:
    model = demo_checkpoint("demo-moe")
    cfg = AppConfig.from_options(model, "model" if runner == "drafted" else "none", max_num_seqs=16,
                                 max_model_len=MAX_LEN, compile=runner == "compiled")
    if runner == "sharded":
        with LocalShardGroup(model, 2, max_num_seqs=8, max_model_len=MAX_LEN) as group:
            yield build_engine(cfg, runner=group)
    elif runner == "compiled":
        torch._dynamo.reset()  # graphs of other modules' models would count toward dynamo's recompile limit
        try:
            yield build_engine(cfg)
        finally:
            torch._dynamo.reset()
    else:
        yield build_engine(cfg)


class Matrix:
    """Each runner built once, on first use, and run through every case (seeded_cases.run_matrix)."""

    def __init__(self) -> None:
        self.runs: dict[str, Runs] = {}
        self.compiler: GrammarCompiler | None = None

    def __getitem__(self, runner: str) -> Runs:
        if runner not in self.runs:
            with engine_on(runner) as engine:
                if self.compiler is None:
                    self.compiler = GrammarCompiler(engine.tokenizer, engine.runner.vocab_size, config=GrammarSection().grammar_config())
                grammar = self.compiler.compile(SCHEMA_SPEC)
                self.runs[runner] = run_matrix(engine, grammar, cut_every=CUT_EVERY[runner])
                if runner == "compiled":
                    assert engine.runner.compiled.num_calls > 0  # the graph ran, not only the eager fallback
                if runner == "drafted":
                    assert engine.spec_metrics.num_accepted_tokens > 0  # drafts were verified and accepted
        return self.runs[runner]


@pytest.fixture(scope="module")
def matrix() -> Iterator[Matrix]:
    m = Matrix()
    yield m
    if m.compiler is not None:
        m.compiler.close()


def assert_same(got: Result, want: Result, label: str, want_label: str, what: str, bitwise: bool = False,
                drafted: bool = False) -> None:
    """Tokens and finish reason equal; the logits of every position both runs sampled equal within
    ATOL (or bit for bit). drafted: positions chosen by verify passes are not recorded, so the two
    runs may share none."""
    g, w = got.tokens[label], want.tokens[want_label]
    common = [pos for (lbl, pos) in got.logits if lbl == label and (want_label, pos) in want.logits]
    diffs = {pos: float((got.logits[label, pos] - want.logits[want_label, pos]).abs().max()) for pos in common}
    if g != w:
        i = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        pytest.fail(f"{what} {label}: tokens differ from output index {i} ({g[i:i + 3]} vs {w[i:i + 3]}); "
                    f"largest logit difference {max(diffs.values(), default=0.0):.2e}")
    assert got.finish[label] == want.finish[want_label], f"{what} {label}"
    assert common or drafted, f"{what} {label}: no sampled position in common"
    worst = max(diffs.values(), default=0.0)
    if bitwise:
        assert worst == 0.0, f"{what} {label}: logits not bitwise equal (up to {worst:.2e})"
    assert worst <= ATOL, f"{what} {label}: logits differ by {worst:.2e}"


def labels(runs: Runs, kind: str) -> list[str]:
    return [c.label for c in runs.cases if c.schema == (kind == "schema")]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("runner", RUNNERS)
def test_alone(matrix, runner, kind):
    """The reference replies: under the schema complete and valid (jsonschema, and an independent
    matcher replays the tokens); the sampling is real: the two seeds part ways on most prompts."""
    runs = matrix[runner]
    tokenizer = runs.tokenizer
    for label in labels(runs, kind):
        tokens, reason = runs.alone.tokens[label], runs.alone.finish[label]
        assert reason in ("stop", "length") and tokens, label
        if kind == "schema":
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            assert reason == "stop" and check_output(SCHEMA_SPEC, text) is None, f"{label}: {text!r}"
            guard = GrammarMatcher(matrix.compiler.compile(SCHEMA_SPEC))
            assert guard.accept_tokens(tokens) == len(tokens) and guard.is_completed(), label
    differ = [q for q in range(len(QUESTIONS))
              if len({tuple(runs.alone.tokens[f"{kind}-q{q}-p{s}"]) for s in range(len(PARAMS))}) > 1]
    assert len(differ) >= 2, f"{kind}: the seeds give the same replies on prompts other than {differ}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("runner", RUNNERS)
def test_amid_others_equals_alone(matrix, runner, kind):
    """All 12 cases and 15 other requests (greedy, sampled with and without seeds, top-k, top-p,
    up to 40 tokens, some under the schema) at once, 16 running at a time: every case as alone."""
    runs = matrix[runner]
    for label in labels(runs, kind):
        assert_same(runs.amid, runs.alone, label, label, f"{runner} amid", drafted=runner == "drafted")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("runner", RUNNERS)
def test_resumed_from_every_prefix_equals_alone(matrix, runner, kind):
    """Each case resumed from every proper prefix of its reply (every third off the default runner)
    as `resume_ids`, as the gateway does after a failover; under the schema also from inside the
    text the grammar forces (jump-forward): the same reply."""
    runs = matrix[runner]
    for label in labels(runs, kind):
        cuts = range(1, len(runs.alone.tokens[label]), CUT_EVERY[runner])
        assert len(cuts) >= 20 // CUT_EVERY[runner], label
        for cut in cuts:
            assert_same(runs.resumed, runs.alone, f"{label}@{cut}", label, f"{runner} resumed",
                        drafted=runner == "drafted")


@pytest.mark.parametrize("kind", KINDS)
def test_runners_agree(matrix, kind):
    """The same tokens on every runner, in every mode. Logits (of plain steps and prefills; a verify
    pass's are not recorded): eager vs compiled within ATOL (other kernels); the group vs the single
    process bitwise for a request alone (its rank runs just that sequence, the other rank only its
    experts' share), within ATOL amid others (other batches per rank); with drafts within ATOL."""
    paged = matrix["paged"]
    for runner in RUNNERS[1:]:
        other = matrix[runner]
        for label in labels(paged, kind):
            drafted = runner == "drafted"
            assert_same(other.alone, paged.alone, label, label, f"{runner} vs paged, alone", bitwise=runner == "sharded",
                        drafted=drafted)
            assert_same(other.amid, paged.amid, label, label, f"{runner} vs paged, amid", drafted=drafted)
            for lbl in [lbl for lbl in other.resumed.tokens if lbl.startswith(f"{label}@")]:
                assert_same(other.resumed, paged.resumed, lbl, lbl, f"{runner} vs paged, resumed", drafted=drafted)
