"""Prompt lookup (n-gram) proposer."""

import random
import time

import pytest

from moeserve.spec import NgramProposer, ProposalRequest


def _propose(proposer: NgramProposer, tokens: list[int], k: int, seq_id: str = "s") -> list[int]:
    (proposal,) = proposer.propose([ProposalRequest(seq_id=seq_id, token_ids=tokens, num_tokens=k)])
    assert proposal.probs is None
    return proposal.token_ids


def test_match_found_proposes_what_followed() -> None:
    assert _propose(NgramProposer(), [10, 11, 12, 13, 14, 99, 11, 12], 2) == [13, 14]


def test_no_match_proposes_nothing() -> None:
    assert _propose(NgramProposer(), [1, 2, 3, 4], 3) == []
    assert _propose(NgramProposer(), [], 3) == []
    assert _propose(NgramProposer(), [5], 3) == []


def test_min_n_excludes_short_matches() -> None:
    tokens = [7, 1, 2, 8, 1]
    assert _propose(NgramProposer(min_n=1), tokens, 1) == [2]
    assert _propose(NgramProposer(min_n=2), tokens, 1) == []


def test_longest_n_wins_over_more_recent_shorter_match() -> None:
    # Suffix [1, 2, 3]: matched in full at the start (-> 50), and as [2, 3] more recently (-> 60).
    tokens = [1, 2, 3, 50, 9, 2, 3, 60, 9, 1, 2, 3]
    assert _propose(NgramProposer(max_n=3), tokens, 1) == [50]
    assert _propose(NgramProposer(max_n=2), tokens, 1) == [60]


def test_most_recent_match_among_equal_lengths() -> None:
    tokens = [4, 5, 1, 4, 5, 2, 4, 5, 3, 4, 5]
    assert _propose(NgramProposer(max_n=2), tokens, 1) == [3]


def test_match_length_is_capped_at_max_n() -> None:
    # With max_n=2 both occurrences of [8, 9] tie, so the recent one wins although the
    # older one matches 4 tokens.
    tokens = [6, 7, 8, 9, 100, 0, 8, 9, 200, 6, 7, 8, 9]
    assert _propose(NgramProposer(max_n=2), tokens, 1) == [200]
    assert _propose(NgramProposer(max_n=4), tokens, 1) == [100]


def test_k_caps_the_proposal() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert _propose(NgramProposer(), tokens, 3) == [3, 4, 5]
    assert _propose(NgramProposer(), tokens, 0) == []


def test_proposal_beyond_the_end_repeats_the_pattern() -> None:
    # [1, 2] last occurred two tokens back; what follows runs into the end, then the
    # copy continues from its own output.
    assert _propose(NgramProposer(), [9, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert _propose(NgramProposer(), [3, 3], 4) == [3, 3, 3, 3]


def test_history_is_incremental_and_freed() -> None:
    proposer = NgramProposer()
    tokens = [1, 2, 3, 4]
    assert _propose(proposer, tokens, 2) == []
    tokens += [1, 2]
    assert _propose(proposer, tokens, 2) == [3, 4]
    assert proposer.num_tracked == 1
    # A reused id with different text is detected and rebuilt, not mixed with the old one.
    assert _propose(proposer, [7, 8, 9, 7], 2) == [8, 9]
    proposer.on_finished("s")
    proposer.on_finished("never-seen")
    assert proposer.num_tracked == 0


def test_batch_of_sequences_keeps_them_apart() -> None:
    proposer = NgramProposer(max_n=3)
    requests = [
        ProposalRequest("a", [1, 2, 3, 1, 2], 1),
        ProposalRequest("b", [1, 2, 4, 1, 2], 1),
        ProposalRequest("c", [1, 2, 4, 1, 2], 0),
    ]
    assert [p.token_ids for p in proposer.propose(requests)] == [[3], [4], []]


def test_lookup_of_a_fresh_history_agrees_with_brute_force() -> None:
    rng = random.Random(0)
    proposer = NgramProposer(min_n=1, max_n=3)
    for i in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        assert proposer.propose([ProposalRequest(f"s{i}", tokens, 3)])[0].token_ids == _brute_force(tokens, 3, 1, 3)


def _brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                ext = list(tokens)
                for j in range(k):
                    ext.append(ext[start + n + j])
                return ext[length:]
    return []


def test_step_cost_stays_small_for_long_sequences() -> None:
    rng = random.Random(1)
    proposer = NgramProposer()
    tokens = [rng.randrange(32_000) for _ in range(4000)]
    _propose(proposer, tokens, 4)
    start = time.perf_counter()
    for _ in range(100):
        tokens.extend(rng.randrange(32_000) for _ in range(3))
        _propose(proposer, tokens, 4)
    per_step = (time.perf_counter() - start) / 100
    # Generous bound for a shared CPU; typically well under 0.1 ms.
    assert per_step < 2e-3


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError):
        NgramProposer(min_n=0)
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)
