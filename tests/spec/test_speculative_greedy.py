"""Greedy speculative decoding returns exactly the tokens of greedy target-only decoding.

For both proposers (prompt lookup and the draft model, in-process), k = 1..8, and mixed
batches: prompts of different lengths, more requests than slots (they join as others
leave), different max_tokens, EOS allowed to end a request early.
"""

from __future__ import annotations

import pytest

from model_shards import load_checkpoint
from moeserve.engine.draft_model import DraftModelProposer
from moeserve.sampling_params import SamplingParams
from moeserve.spec import NgramProposer
from moeserve.spec.policy import PRIOR_COSTS
from tests.model_shards.hf_tiny import save_tiny
from tests.spec.tiny_pair import make_engine, noisy_copy, random_prompts, run

NUM_SEQS = 4


def _setup(tmp_path_factory, family: str, noise: float):
    target_dir = tmp_path_factory.mktemp(family)
    save_tiny(family, target_dir)
    target = load_checkpoint(target_dir)
    prompts = random_prompts(10, 96, seed=0, lengths=(2, 24))
    prompts = [p * 3 if i % 2 else p for i, p in enumerate(prompts)]  # repetitive half: lookup proposes
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0) for i in range(len(prompts))]
    plain = run(make_engine(target, max_num_seqs=NUM_SEQS), prompts, params)
    return target, {"self": target, "noisy": noisy_copy(target, noise)}, prompts, params, plain


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """An MoE target; its drafts (itself, a noisy copy) run through the model's own forward."""
    target, drafts, *rest = _setup(tmp_path_factory, "mixtral", 0.02)
    random_dir = tmp_path_factory.mktemp("llama")
    save_tiny("llama", random_dir, seed=3)
    drafts["random"] = load_checkpoint(random_dir)  # a dense draft
    return (target, drafts, *rest)


@pytest.fixture(scope="module")
def dense_setup(tmp_path_factory):
    """A dense target whose noisy copy drafts (a dense draft, as the demo pair's)."""
    return _setup(tmp_path_factory, "llama", 0.08)


def _proposer(kind: str, drafts: dict):
    if kind == "ngram":
        return NgramProposer()
    return DraftModelProposer(drafts[kind], max_num_seqs=NUM_SEQS, max_model_len=96)


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("kind", ["ngram", "noisy", "noisy-dense"])
def test_greedy_speculation_is_exact(request, kind, k):
    target, drafts, prompts, params, plain = request.getfixturevalue("dense_setup" if kind == "noisy-dense" else "setup")
    proposer = _proposer(kind.removesuffix("-dense"), drafts)
    engine = make_engine(target, proposer, k=k, max_num_seqs=NUM_SEQS)
    assert run(engine, prompts, params) == plain
    m = engine.spec_metrics
    assert m.num_draft_tokens > 0 and 0 < m.num_accepted_tokens < m.num_draft_tokens
    assert engine.runner.num_free_slots == NUM_SEQS
    if kind != "ngram":
        assert proposer.num_tracked == 0  # every finished sequence freed its draft slot
        assert proposer.num_rebuilt_tokens == 0  # rejections rolled back, never rebuilt


@pytest.mark.parametrize("kind", ["self", "random"])
@pytest.mark.parametrize("k", [3, 8])
def test_greedy_exact_with_perfect_and_useless_drafts(setup, kind, k):
    target, drafts, prompts, params, plain = setup
    engine = make_engine(target, _proposer(kind, drafts), k=k, max_num_seqs=NUM_SEQS)
    assert run(engine, prompts, params) == plain
    alpha = engine.spec_metrics.alpha
    assert alpha > 0.95 if kind == "self" else alpha < 0.3


def test_greedy_rows_stay_exact_beside_sampled_rows(setup):
    """Sampled rows (with sampled drafts and their q) share the verification pass."""
    target, drafts, prompts, params, plain = setup
    proposer = DraftModelProposer(drafts["noisy"], max_num_seqs=8, max_model_len=96, greedy=False)
    engine = make_engine(target, proposer, k=4, max_num_seqs=8)
    sampled = [SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(len(prompts))]
    mixed = [x for pair in zip(params, sampled) for x in pair]
    out = run(engine, [p for p in prompts for _ in range(2)], mixed)
    assert out[0::2] == plain
    assert all(len(o) == 10 for o in out[1::2])


def test_adaptive_k_is_exact_and_fits_measured_costs(setup):
    target, drafts, prompts, params, plain = setup
    engine = make_engine(target, _proposer("noisy", drafts), k=6, max_num_seqs=NUM_SEQS, adaptive=True)
    assert run(engine, prompts, params) == plain
    # refitted from the measured steps of some batch size (buckets 1, 2-3, 4-7)
    assert engine.adaptive is not None
    assert any(engine.adaptive.costs_for(n) != PRIOR_COSTS for n in (1, 2, 4))
    assert sum(engine.adaptive.meter.num_recorded_at(n) for n in (1, 2, 4)) > engine.adaptive.refit_every
