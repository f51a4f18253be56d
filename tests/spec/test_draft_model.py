"""The draft-model proposer: its drafts against transformers' greedy continuation, KV
rollback after rejections, rebuilds on a miss, slot eviction, and sampled drafts with q."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from model_shards import load_checkpoint
from moeserve.engine.draft_model import DraftModelProposer
from moeserve.sampling_params import SamplingParams
from moeserve.spec import ProposalRequest
from tests.model_shards.hf_tiny import save_tiny
from tests.spec.tiny_pair import random_prompts


@pytest.fixture(scope="module", params=["llama", "qwen2", "mixtral"])
def draft(request, tmp_path_factory):
    """Dense drafts (qwen2: with q/k/v biases) and an MoE one, each through the model's own forward."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, folder, seed=1)
    return folder, hf, load_checkpoint(folder)


def continuation(hf, tokens: list[int], k: int) -> list[int]:
    """The draft's own greedy continuation, computed by transformers (no KV state shared)."""
    if k == 0:
        return []
    out = hf.generate(torch.tensor([tokens]), max_new_tokens=k, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(tokens) :].tolist()


@pytest.mark.parametrize("compiled", [False, True])
def test_drafts_follow_the_sequence_through_rollbacks(draft, compiled):
    """Each step accepts a prefix of the drafts (none, some, all) and appends one token,
    as the target does; the draft's cache rolls back and its drafts stay exact, with its
    one-token steps eager or compiled (every family, the MoE draft included)."""
    _, hf, model = draft
    torch._dynamo.reset()
    proposer = DraftModelProposer(model, max_num_seqs=4, max_model_len=96, compile=compiled)
    seqs = {f"s{i}": p for i, p in enumerate(random_prompts(3, 96, seed=1, lengths=(2, 20)))}
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        reqs = [ProposalRequest(sid, toks, (step + 2 * i) % 6) for i, (sid, toks) in enumerate(seqs.items())]
        for i, (req, prop) in enumerate(zip(reqs, proposer.propose(reqs))):
            assert prop.probs is None
            assert prop.token_ids == continuation(hf, req.token_ids, req.num_tokens), (step, req.seq_id)
            accepted = (step + i) % (len(prop.token_ids) + 1)  # 0 .. k, all accepted included
            extra = int(torch.randint(2, 96, (1,), generator=g))  # recovered or bonus token
            seqs[req.seq_id] = list(req.token_ids) + prop.token_ids[:accepted] + [extra]
    assert proposer.num_new_seqs == 3 and proposer.num_rebuilt_tokens == 0
    assert not compiled or proposer.runner.compiled.num_calls > 12


def test_a_rewritten_history_is_rebuilt(draft):
    _, hf, model = draft
    proposer = DraftModelProposer(model, max_num_seqs=2, max_model_len=96)
    first = list(range(10, 40))
    proposer.propose([ProposalRequest("s", first, 4)])
    other = first[:5] + list(range(50, 70))  # same id, history diverges at position 5
    (prop,) = proposer.propose([ProposalRequest("s", other, 4)])
    assert prop.token_ids == continuation(hf, other, 4)
    assert proposer.num_rebuilt_tokens == len(first) - 5


def test_eviction_and_on_finished_free_slots(draft):
    _, hf, model = draft
    proposer = DraftModelProposer(model, max_num_seqs=2, max_model_len=96)
    prompts = random_prompts(3, 96, seed=2)
    for i in range(6):  # three sequences take turns in two slots: the idle one is evicted
        sid = f"s{i % 3}"
        (prop,) = proposer.propose([ProposalRequest(sid, prompts[i % 3], 3)])
        assert prop.token_ids == continuation(hf, prompts[i % 3], 3)
    assert proposer.num_evictions >= 3 and proposer.num_tracked == 2
    for i in range(3):
        proposer.on_finished(f"s{i}")
    proposer.on_finished("unknown")
    assert proposer.num_tracked == 0 and proposer.runner.num_free_slots == 2


def test_rows_beyond_the_slots_and_the_context_get_fewer_drafts(draft):
    _, hf, model = draft
    proposer = DraftModelProposer(model, max_num_seqs=2, max_model_len=32)
    prompts = random_prompts(3, 96, seed=3, lengths=(5, 10))
    near_limit = list(range(2, 31))  # 29 tokens: drafts 1..3 would sit at 29..31; 4 would pass 32
    reqs = [ProposalRequest(f"s{i}", p, 5) for i, p in enumerate(prompts)]
    out = proposer.propose(reqs)
    assert [len(p.token_ids) for p in out] == [5, 5, 0]  # two slots, no idle sequence to evict
    proposer.on_finished("s0")
    (prop,) = proposer.propose([ProposalRequest("long", near_limit, 8)])
    assert prop.token_ids == continuation(hf, near_limit, 4)


def test_the_draft_cache_is_paged_shares_prefixes_and_evicts_when_blocks_run_out(draft):
    _, hf, model = draft
    # 12 blocks of 4 tokens (one is scratch): two 20-token histories plus their drafts fit, three do not
    proposer = DraftModelProposer(model, max_num_seqs=4, max_model_len=96, num_blocks=12, block_size=4)
    shared = random_prompts(1, 96, seed=8, lengths=(16, 17))[0]
    prompts = [shared + p for p in random_prompts(3, 96, seed=9, lengths=(4, 5))]
    (a,) = proposer.propose([ProposalRequest("a", prompts[0], 3)])
    (b,) = proposer.propose([ProposalRequest("b", prompts[1], 3)])  # its first 16 tokens are a's blocks
    assert proposer.runner.blocks.hits == 4
    for prop, prompt in ((a, prompts[0]), (b, prompts[1])):
        assert prop.token_ids == continuation(hf, prompt, 3)
    other = random_prompts(1, 96, seed=10, lengths=(20, 21))[0]
    (c,) = proposer.propose([ProposalRequest("c", other, 3)])  # no prefix in common: needs blocks of its own
    assert c.token_ids == continuation(hf, other, 3) and proposer.num_evictions >= 1 and proposer.num_tracked < 3
    for sid in ("a", "b", "c"):
        proposer.on_finished(sid)
    assert proposer.runner.blocks.num_free == 11 and proposer.num_tracked == 0


def test_sampled_drafts_carry_q_and_are_seed_deterministic(draft):
    _, _, model = draft
    params = SamplingParams(temperature=0.9, top_k=5, seed=11)
    prompt = random_prompts(1, 96, seed=4)[0]
    greedy_req = ProposalRequest("g", prompt, 3, SamplingParams(temperature=0.0))
    a = DraftModelProposer(model, 4, 96, greedy=False).propose([ProposalRequest("s", prompt, 4, params), greedy_req])
    b = DraftModelProposer(model, 4, 96, greedy=False).propose([ProposalRequest("x", prompt, 4, params)])
    sampled, greedy = a
    assert greedy.probs is None
    q = sampled.probs
    assert q.shape == (4, 96) and torch.allclose(q.sum(-1), torch.ones(4))
    assert ((q > 0).sum(-1) <= 5).all()
    assert all(q[j, t] > 0 for j, t in enumerate(sampled.token_ids))
    assert b[0].token_ids == sampled.token_ids and torch.allclose(b[0].probs, q, atol=1e-5)
    plain = DraftModelProposer(model, 4, 96, greedy=True).propose([ProposalRequest("s", prompt, 4, params)])
    assert plain[0].probs is None


def test_sampled_draft_tokens_follow_q(draft):
    """The first draft of 4,000 copies of one prompt, against the q they report."""
    _, _, model = draft
    n = 4000
    proposer = DraftModelProposer(model, max_num_seqs=n, max_model_len=16, greedy=False)
    params = SamplingParams(temperature=1.5, top_k=4)
    prompt = random_prompts(1, 96, seed=5, lengths=(4, 8))[0]
    torch.manual_seed(0)
    out = proposer.propose([ProposalRequest(f"s{i}", prompt, 1, params) for i in range(n)])
    q = out[0].probs[0]
    support = q.nonzero().squeeze(-1)
    counts = torch.bincount(torch.tensor([p.token_ids[0] for p in out]), minlength=96)
    assert counts.sum() == counts[support].sum()
    expected = q[support].double() / q[support].double().sum() * n
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3


def test_it_builds_from_a_checkpoint_folder(draft):
    folder, hf, _ = draft
    proposer = DraftModelProposer(model=str(folder), max_num_seqs=2, max_model_len=64)
    prompt = random_prompts(1, 96, seed=6)[0]
    assert proposer.propose([ProposalRequest("s", prompt, 3)])[0].token_ids == continuation(hf, prompt, 3)
