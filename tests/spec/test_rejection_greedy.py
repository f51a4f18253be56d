"""Greedy verification: hand-made cases, and sampled verification with one-hot target
probabilities agreeing with it.

Shapes: B sequences, K draft tokens, V vocabulary.
"""

import pytest
import torch

from moeserve.spec import RejectionSampler, SpecOutput


def test_all_accepted_emits_bonus() -> None:
    out = RejectionSampler().greedy(
        torch.tensor([[5, 6, 7, 8]]),  # [B, K+1]
        torch.tensor([[5, 6, 7]]),  # [B, K]
        torch.tensor([3]),
    )
    assert out.token_ids == [[5, 6, 7, 8]]
    assert out.num_accepted.tolist() == [3]
    assert [len(t) for t in out.token_ids] == (out.num_accepted + 1).tolist() == [4]


def test_first_mismatch_emits_target_token() -> None:
    out = RejectionSampler().greedy(torch.tensor([[5, 6, 7, 8]]), torch.tensor([[5, 9, 7]]), torch.tensor([3]))
    # 7 matches the target at position 2, but nothing after a rejection is kept.
    assert out.token_ids == [[5, 6]]
    assert out.num_accepted.tolist() == [1]


def test_first_token_rejected() -> None:
    out = RejectionSampler().greedy(torch.tensor([[5, 6, 7, 8]]), torch.tensor([[4, 6, 7]]), torch.tensor([3]))
    assert out.token_ids == [[5]]
    assert out.num_accepted.tolist() == [0]


def test_no_draft_emits_target_token() -> None:
    out = RejectionSampler().greedy(torch.tensor([[5, 6, 7, 8]]), torch.tensor([[5, 6, 7]]), torch.tensor([0]))
    assert out.token_ids == [[5]]
    out = RejectionSampler().greedy(torch.tensor([[5], [9]]), torch.zeros(2, 0, dtype=torch.long), torch.tensor([0, 0]))
    assert out.token_ids == [[5], [9]]


def test_mixed_rows_with_padding() -> None:
    target = torch.tensor(
        [
            [1, 2, 3, 4],  # all 3 accepted -> bonus 4
            [1, 2, 3, 4],  # 2 drafts, both accepted -> bonus is the target at position 2
            [1, 2, 3, 4],  # mismatch at 1
            [7, 0, 0, 0],  # no drafts
        ]
    )
    drafts = torch.tensor([[1, 2, 3], [1, 2, -1], [1, 5, 3], [-1, -1, -1]])
    out = RejectionSampler().greedy(target, drafts, torch.tensor([3, 2, 3, 0]))
    assert out.token_ids == [[1, 2, 3, 4], [1, 2, 3], [1, 2], [7]]
    assert out.num_accepted.tolist() == [3, 2, 1, 0]


def test_padding_that_happens_to_match_is_not_accepted() -> None:
    out = RejectionSampler().greedy(torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2]]), torch.tensor([1]))
    assert out.token_ids == [[1, 2]]
    assert out.num_accepted.tolist() == [1]


def test_sample_with_one_hot_target_equals_greedy() -> None:
    gen = torch.Generator().manual_seed(0)
    batch, k, vocab = 64, 4, 7
    target_argmax = torch.randint(vocab, (batch, k + 1), generator=gen)  # [B, K+1]
    # Drafts agree with the target most of the time so that all paths occur.
    drafts = torch.where(
        torch.rand(batch, k, generator=gen) < 0.7,
        target_argmax[:, :k],
        torch.randint(vocab, (batch, k), generator=gen),
    )  # [B, K]
    num_draft = torch.randint(k + 1, (batch,), generator=gen)  # [B]
    target_probs = torch.nn.functional.one_hot(target_argmax, vocab).float()  # [B, K+1, V]
    draft_probs = torch.softmax(torch.randn(batch, k, vocab, generator=gen), dim=-1)  # [B, K, V]

    greedy = RejectionSampler().greedy(target_argmax, drafts, num_draft)
    for q in (None, draft_probs):
        sampled = RejectionSampler().sample(target_probs, drafts, q, num_draft)
        assert sampled.token_ids == greedy.token_ids
        assert torch.equal(sampled.num_accepted, greedy.num_accepted)


def test_identical_draft_is_always_accepted() -> None:
    gen = torch.Generator().manual_seed(1)
    batch, k, vocab = 256, 3, 5
    probs = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen), dim=-1)  # [B, K+1, V]
    drafts = torch.multinomial(probs[:, :k].reshape(-1, vocab), 1, generator=gen).view(batch, k)  # [B, K]
    out = RejectionSampler().sample(probs, drafts, probs[:, :k], torch.full((batch,), k))
    assert out.num_accepted.tolist() == [k] * batch


def test_bad_shapes_are_rejected() -> None:
    sampler = RejectionSampler()
    with pytest.raises(ValueError, match="K\\+1"):
        sampler.greedy(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="num_draft"):
        sampler.greedy(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="draft_probs"):
        sampler.sample(
            torch.rand(2, 4, 5), torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 3, 6), torch.tensor([1, 1])
        )
    with pytest.raises(ValueError, match="generator"):
        sampler.sample(torch.rand(2, 4, 5), torch.zeros(2, 3, dtype=torch.long), None, torch.tensor([1, 1]), [None])
    with pytest.raises(ValueError, match="emit"):
        SpecOutput(token_ids=[[1, 2]], num_accepted=torch.tensor([0]))
