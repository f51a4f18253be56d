"""Sampled speculative decoding follows the target's distribution (a chi-square test).

A target and an unrelated draft with a 4-token vocabulary: 20,000 requests of 4 tokens
each, decoded with drafts of up to 3 tokens, give 20,000 samples of the joint distribution
of the first 4 generated tokens (256 outcomes). The exact joint comes from the target's own
logits over every 3-token prefix, processed with the same temperature / top-k / top-p.
The draft's joint is a negative control: the same samples must reject it, or the test
would have no power.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from model_shards import CausalLM, load_checkpoint
from moeserve.engine import LLMEngine, ModelRunner, SchedulerConfig, SpecConfig
from moeserve.engine.draft_model import DraftModelProposer
from moeserve.sampler import Sampler
from moeserve.sampling_params import SamplingParams
from tests.spec.tiny_pair import save_small_vocab

VOCAB, NEW_TOKENS, NUM_SAMPLES, BATCH = 4, 4, 20_000, 2_500
PROMPT = [0, 2, 1, 3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, draft_dir = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    save_small_vocab("mixtral", target_dir, VOCAB, seed=0, spread=1.5)
    save_small_vocab("llama", draft_dir, VOCAB, seed=1, spread=1.5)
    return load_checkpoint(target_dir), load_checkpoint(draft_dir)


def exact_joint(model: CausalLM, params: SamplingParams) -> np.ndarray:
    """P(t1..t4 | prompt) for all VOCAB**4 outcomes, from full forwards over every prefix."""
    prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW_TOKENS - 1)))  # [N, 3]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], dim=1)  # [N, P+3]
    logits = model(ids)[:, len(PROMPT) - 1 :]  # [N, 4, V]: next-token logits for t1..t4
    probs = Sampler().probs(logits, [params] * len(prefixes)).double()  # [N, 4, V]
    joint = np.zeros((VOCAB,) * NEW_TOKENS)
    for n, prefix in enumerate(prefixes.tolist()):
        p = probs[n, 0, prefix[0]] * probs[n, 1, prefix[1]] * probs[n, 2, prefix[2]]
        joint[tuple(prefix)] = (p * probs[n, 3]).numpy()
    return joint.reshape(-1)


def sample_joint(target: CausalLM, draft: CausalLM, params: SamplingParams, greedy_draft: bool):
    runner = ModelRunner(target, max_num_seqs=BATCH, max_model_len=16)
    engine = LLMEngine(
        runner,
        scheduler=SchedulerConfig(max_num_seqs=BATCH, max_num_batched_tokens=len(PROMPT) * BATCH, max_model_len=16),
        proposer=DraftModelProposer(draft, max_num_seqs=BATCH, max_model_len=16, greedy=greedy_draft),
        spec=SpecConfig(num_tokens=3),
    )
    torch.manual_seed(0)
    counts = np.zeros(VOCAB**NEW_TOKENS, dtype=np.int64)
    for _ in range(NUM_SAMPLES // BATCH):
        for out in engine.generate([PROMPT] * BATCH, params):
            assert len(out.token_ids) == NEW_TOKENS
            counts[np.ravel_multi_index(out.token_ids, (VOCAB,) * NEW_TOKENS)] += 1
    return counts, engine.spec_metrics


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test; outcomes expected fewer than 5 times are pooled into one cell.
    An outcome of probability 0 that occurred fails the test outright (p-value 0)."""
    possible = probs > 0
    if counts[~possible].any():
        return 0.0
    counts, probs = counts[possible], probs[possible]
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return chisquare(counts, expected).pvalue


@pytest.mark.parametrize(
    ("params", "greedy_draft"),
    [
        (SamplingParams(max_tokens=NEW_TOKENS, temperature=0.7, top_k=3, top_p=0.9, ignore_eos=True), False),
        (SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True), True),
    ],
    ids=["t0.7-topk3-topp0.9-sampled-drafts", "t1.0-argmax-drafts"],
)
def test_speculative_samples_follow_the_target(pair, params, greedy_draft):
    target, draft = pair
    counts, metrics = sample_joint(target, draft, params, greedy_draft)
    assert counts.sum() == NUM_SAMPLES
    assert metrics.num_accepted_tokens > 0.1 * metrics.num_draft_tokens  # the draft's tokens were used
    assert metrics.tokens_per_pass > 1.15
    assert chi_square_pvalue(counts, exact_joint(target, params)) > 1e-3
    assert chi_square_pvalue(counts, exact_joint(draft, params)) < 1e-6  # power: the draft's law is rejected
