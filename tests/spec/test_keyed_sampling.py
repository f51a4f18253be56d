"""Seeded sampling keyed by (seed, position): exact in distribution (chi-square, with a negative
control), and a seeded reply that is a function of the request alone: the same alone or amid
other requests, with speculation off, with n-gram drafts, with a sampling draft model, and when
resumed from the middle of its own output."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from model_shards import load_checkpoint
from moeserve.engine.draft_model import DraftModelProposer
from moeserve.sampler import keyed_noise, keyed_sample
from moeserve.sampling_params import SamplingParams
from moeserve.spec.ngram import NgramProposer
from tests.spec.tiny_pair import make_engine, noisy_copy, random_prompts, run, save_small_vocab

VOCAB = 24
N = 20_000


def test_keyed_samples_follow_p_and_a_wrong_distribution_is_caught():
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    keys = [(seed, 7) for seed in range(N)]
    counts = torch.bincount(keyed_sample(p.expand(N, -1), keys), minlength=6).double()
    assert chisquare(counts.numpy(), (p.double() * N).numpy()).pvalue > 1e-3
    q = torch.tensor([0.25, 0.25, 0.2, 0.1, 0.1, 0.1])  # negative control: samples of q tested against p
    wrong = torch.bincount(keyed_sample(q.expand(N, -1), keys), minlength=6).double()
    assert chisquare(wrong.numpy(), (p.double() * N).numpy()).pvalue < 1e-6
    # the noise is the key's alone: another batch, another order, the same numbers
    assert torch.equal(keyed_noise([(3, 9), (5, 1)], 6)[0], keyed_noise([(8, 2), (3, 9)], 6)[1])


def test_a_draft_with_the_same_keys_proposes_the_targets_token_where_they_agree():
    """Coupling: with the same keyed noise, the draft's sample equals the target's far more
    often than independent draws would (sum p*q), and always when q == p."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(VOCAB) * 1.5, dim=-1)
    q = torch.softmax(torch.log(p) + torch.randn(VOCAB) * 0.3, dim=-1)
    keys = [(seed, 3) for seed in range(4000)]
    target, draft = keyed_sample(p.expand(4000, -1), keys), keyed_sample(q.expand(4000, -1), keys)
    coupled = (target == draft).double().mean().item()
    assert coupled > float((p * q).sum()) + 0.2 and coupled <= float(torch.minimum(p, q).sum()) + 0.02
    assert torch.equal(keyed_sample(p.expand(4000, -1), keys), target)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small-vocab")
    save_small_vocab("mixtral", folder, VOCAB, seed=1, spread=2.0)
    return load_checkpoint(folder)


def test_a_seeded_reply_is_a_function_of_the_request_alone(target):
    prompt = random_prompts(1, VOCAB, seed=5)[0]
    seeded = SamplingParams(max_tokens=24, temperature=0.9, seed=1234, ignore_eos=True)
    alone = run(make_engine(target), [prompt], [seeded])[0]
    crowd = random_prompts(15, VOCAB, seed=6)
    others = [SamplingParams(max_tokens=20, temperature=1.0, seed=s if s % 2 else None, ignore_eos=True)
              for s in range(15)]
    amid = run(make_engine(target, max_num_seqs=8), [*crowd[:7], prompt, *crowd[7:]], [*others[:7], seeded,
                                                                                       *others[7:]])[7]
    ngram = run(make_engine(target, NgramProposer(), k=4), [prompt], [seeded])[0]
    draft = DraftModelProposer(noisy_copy(target, 0.05), max_num_seqs=4, max_model_len=96)
    drafted_engine = make_engine(target, draft, k=3)
    drafted = run(drafted_engine, [prompt], [seeded])[0]
    assert alone == amid == ngram == drafted
    assert drafted_engine.spec_metrics.num_accepted_tokens > 0  # the coupled draft was accepted, not just run
    engine = make_engine(target, NgramProposer(), k=4)  # resumed after 10 tokens, as after a failover
    rid = engine.add_request(prompt, seeded, resume_ids=alone[:10])
    resumed = []
    while engine.has_unfinished():
        resumed += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    assert alone[:10] + resumed == alone
