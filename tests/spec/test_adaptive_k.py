"""Adaptive k: the formula, the cost model, and the per-sequence choice."""

import pytest

from moeserve.spec import AdaptiveK, AdaptiveKConfig, CostModel, expected_tokens_per_pass

# A target pass dominated by its fixed cost (memory-bound decoding), a cheap draft.
CHEAP_DRAFT = CostModel(target_base_s=10e-3, target_per_token_s=0.2e-3, draft_per_token_s=0.5e-3)
# A draft that costs half a target step per token.
DEAR_DRAFT = CostModel(target_base_s=10e-3, target_per_token_s=0.5e-3, draft_per_token_s=5e-3)


def test_formula() -> None:
    assert expected_tokens_per_pass(0.8, 4) == pytest.approx(3.3616)
    assert expected_tokens_per_pass(0.6, 4) == pytest.approx(2.3056)
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    assert expected_tokens_per_pass(0.7, 0) == pytest.approx(1.0)
    # Continuous at alpha -> 1.
    assert expected_tokens_per_pass(1 - 1e-7, 4) == pytest.approx(5.0, rel=1e-5)
    with pytest.raises(ValueError):
        expected_tokens_per_pass(1.5, 4)


def test_step_cost_is_linear() -> None:
    assert CHEAP_DRAFT.step_cost(0) == pytest.approx(10.2e-3)
    assert CHEAP_DRAFT.step_cost(4) == pytest.approx(10e-3 + 5 * 0.2e-3 + 4 * 0.5e-3)
    with pytest.raises(ValueError):
        CostModel(target_base_s=-1.0, target_per_token_s=0.0, draft_per_token_s=0.0)
    with pytest.raises(ValueError):
        CostModel(target_base_s=0.0, target_per_token_s=0.0, draft_per_token_s=0.0)


def test_high_acceptance_gives_large_k() -> None:
    adaptive = AdaptiveK(AdaptiveKConfig(k_max=8), CHEAP_DRAFT)
    assert adaptive.best_batch_k([0.95]) >= 7
    assert adaptive.best_batch_k([1.0]) == 8


def test_low_acceptance_gives_zero_when_drafting_does_not_pay() -> None:
    adaptive = AdaptiveK(AdaptiveKConfig(k_max=8), DEAR_DRAFT)
    assert adaptive.best_batch_k([0.1]) == 0
    assert adaptive.best_batch_k([0.0]) == 0
    # Same acceptance with a cheap draft: a little speculation still pays.
    assert AdaptiveK(AdaptiveKConfig(k_max=8), CHEAP_DRAFT).best_batch_k([0.3]) >= 1


def test_best_k_is_the_argmax_of_tokens_per_second() -> None:
    adaptive = AdaptiveK(AdaptiveKConfig(k_max=10), DEAR_DRAFT)
    for alpha in [i / 20 for i in range(21)]:
        rates = [expected_tokens_per_pass(alpha, k) / DEAR_DRAFT.step_cost(k) for k in range(11)]
        assert adaptive.best_batch_k([alpha]) == max(range(11), key=lambda k: (rates[k], -k))


def test_best_k_grows_with_alpha() -> None:
    adaptive = AdaptiveK(AdaptiveKConfig(k_max=8), DEAR_DRAFT)
    ks = [adaptive.best_batch_k([i / 20]) for i in range(21)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 8


def test_per_sequence_acceptance_drives_k() -> None:
    adaptive = AdaptiveK(AdaptiveKConfig(k_max=8, probe_every=1000), DEAR_DRAFT)
    for _ in range(20):
        adaptive.observe("formulaic", num_proposed=4, num_accepted=4)
        adaptive.observe("free-form", num_proposed=4, num_accepted=0)
    assert adaptive.alpha("formulaic") > 0.95
    # its own evidence (~5 recent trials) against 2 pseudo-trials at the pool's alpha (~0.8)
    assert adaptive.alpha("free-form") < 0.25
    assert adaptive.choose_batch(["formulaic"])[0] >= 6
    assert adaptive.choose_batch(["free-form"])[0] == 0


def test_a_sequence_that_stopped_drafting_drifts_back_to_the_pool() -> None:
    """Rejections put a sequence at k = 0, where it learns nothing new; its old evidence ages at
    every plain step, so within a few steps it drafts again at the pool's alpha (the text moved
    on), long before a probe (probe_every=1000 here)."""
    costs = CostModel(target_base_s=1.3e-3, target_per_token_s=0.06e-3, draft_per_token_s=0.1e-3,
                      draft_base_s=0.5e-3)  # the demo pair, about
    adaptive = AdaptiveK(AdaptiveKConfig(k_max=8, probe_every=1000), costs)
    for _ in range(200):
        adaptive.observe("pool", 8, 6)
    for _ in range(4):
        adaptive.observe("s", 2, 0)
    stopped = adaptive.alpha("s")
    assert adaptive.choose_batch(["s"])[0] == 0
    plain = 1
    while adaptive.choose_batch(["s"])[0] == 0:
        plain += 1
        assert plain < 10
    assert stopped < adaptive.alpha("s") < adaptive.alpha("new")


def test_alpha_counts_only_tried_drafts() -> None:
    # One step, 4 proposed, 2 accepted: 2 successes and 1 failure; the 4th draft was never tried.
    adaptive = AdaptiveK(AdaptiveKConfig(decay=1.0, prior_alpha=0.5, prior_weight=1e-9), CHEAP_DRAFT)
    adaptive.observe("s", num_proposed=4, num_accepted=2)
    assert adaptive.alpha("s") == pytest.approx(2 / 3)
    adaptive.observe("s", num_proposed=0, num_accepted=0)  # nothing drafted: nothing learned
    assert adaptive.alpha("s") == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        adaptive.observe("s", num_proposed=1, num_accepted=2)


def test_a_cut_proposal_counts_as_a_pass_ending_so_the_formula_predicts_what_passes_yield() -> None:
    """Under a grammar a draft stops where the grammar forces text (each draft token is followed
    by forced text with probability h here), so a pass yields fewer tokens than alpha alone says.
    Simulated passes are the reference: with cuts counted as failed trials the formula at the
    estimated alpha predicts their mean tokens per pass; counted as accepted it overstates it."""
    import random

    rng = random.Random(0)
    accept, cut_after, k = 0.9, 0.35, 8
    counted, ignored = (AdaptiveK(AdaptiveKConfig(decay=1.0, pool_decay=1.0), CHEAP_DRAFT) for _ in range(2))
    yielded = []
    for _ in range(20_000):
        proposed = next((j + 1 for j in range(k) if rng.random() < cut_after), k)  # the grammar forces text after it
        accepted = next((j for j in range(proposed) if rng.random() >= accept), proposed)
        yielded.append(accepted + 1)
        counted.observe("s", proposed, accepted, cut=proposed < k)
        ignored.observe("s", proposed, accepted)
    mean = sum(yielded) / len(yielded)
    assert expected_tokens_per_pass(counted.alpha("s"), k) == pytest.approx(mean, rel=0.03)
    assert expected_tokens_per_pass(ignored.alpha("s"), k) > 1.5 * mean
    counted.observe("t", 0, 0, cut=True)  # stopped before its first draft: one failed trial
    assert counted.alpha("t") < counted.alpha("new")


def test_zero_k_probes_again() -> None:
    adaptive = AdaptiveK(AdaptiveKConfig(k_max=4, probe_every=3, prior_alpha=0.0), DEAR_DRAFT)
    assert [adaptive.choose_batch(["s"])[0] for _ in range(9)] == [0, 0, 1, 0, 0, 1, 0, 0, 1]


def test_new_sequence_starts_from_pool_alpha() -> None:
    adaptive = AdaptiveK(AdaptiveKConfig(prior_alpha=0.5), CHEAP_DRAFT)
    assert adaptive.alpha("new") == pytest.approx(0.5)
    for i in range(200):
        adaptive.observe(f"old-{i}", num_proposed=4, num_accepted=4)
    assert adaptive.alpha("new") > 0.9
    adaptive.on_finished("old-0")
    adaptive.on_finished("never-seen")


def test_set_costs_changes_the_choice() -> None:
    adaptive = AdaptiveK(AdaptiveKConfig(k_max=8, prior_alpha=0.5, probe_every=1000), CHEAP_DRAFT)
    cheap = adaptive.choose_batch(["s"])[0]
    adaptive.set_costs(DEAR_DRAFT)
    assert adaptive.choose_batch(["s"])[0] < cheap


def test_bad_config_is_rejected() -> None:
    for kwargs in ({"k_max": -1}, {"decay": 0.0}, {"prior_alpha": 2.0}, {"prior_weight": 0.0}, {"probe_every": 0}):
        with pytest.raises(ValueError):
            AdaptiveKConfig(**kwargs)


# A busy batch: the pass is mostly per-position work, so k + 1 positions cost nearly k + 1 passes.
BUSY_BATCH = CostModel(target_base_s=0.1e-3, target_per_token_s=0.6e-3, draft_per_token_s=0.3e-3)


def test_each_batch_size_bucket_chooses_from_its_own_costs() -> None:
    """Cheap positions at one row, dear ones at 32 rows: the same sequences draft alone and not
    in the big batch (no fixed disable-by-batch-size needed); buckets are 1, 2-3, 4-7, ..."""
    adaptive = AdaptiveK(AdaptiveKConfig(k_max=8, prior_alpha=0.8, probe_every=1000), CHEAP_DRAFT)
    adaptive.set_costs(CHEAP_DRAFT, num_rows=1)
    adaptive.set_costs(BUSY_BATCH, num_rows=32)
    batch = [f"s{i}" for i in range(32)]
    assert adaptive.choose_batch(batch) == [0] * 32
    assert adaptive.choose_batch(batch[:1])[0] >= 4
    assert adaptive.costs_for(40) == BUSY_BATCH  # 32-63: one bucket
    assert adaptive.costs_for(20) == CHEAP_DRAFT  # 16-31: unmeasured, the default
    adaptive.set_costs(DEAR_DRAFT)
    assert adaptive.costs_for(2) == DEAR_DRAFT and adaptive.costs_for(1) == CHEAP_DRAFT
    for rows, rate in ((1, CHEAP_DRAFT), (32, BUSY_BATCH)):  # the choice is the argmax at that bucket
        k = adaptive.best_batch_k([0.8], adaptive.costs_for(rows))
        best = max(range(9), key=lambda j: (expected_tokens_per_pass(0.8, j) / rate.step_cost(j), -j))
        assert k == best


def test_a_batch_probes_together() -> None:
    """No row drafts: every probe interval all rows draft one token at once (one wider pass, not
    one per sequence)."""
    quiet = AdaptiveK(AdaptiveKConfig(k_max=4, probe_every=3, prior_alpha=0.0), DEAR_DRAFT)
    rows = ["a", "b", "c"]
    assert [quiet.choose_batch(rows) for _ in range(6)] == [[0] * 3, [0] * 3, [1] * 3] * 2


def test_a_batch_drafts_one_k_chosen_for_all_its_rows() -> None:
    """The pass is as wide as the widest row, so k is the argmax of the batch's summed expected
    tokens over the step cost (brute force here), not each row's own best: one eager row does not
    make 31 reluctant ones pay for 9 positions."""
    import random

    rng = random.Random(0)
    adaptive = AdaptiveK(AdaptiveKConfig(k_max=8), CHEAP_DRAFT)
    for costs in (CHEAP_DRAFT, DEAR_DRAFT, BUSY_BATCH):
        for _ in range(50):
            alphas = [rng.random() for _ in range(rng.randint(1, 32))]
            rate = [sum(expected_tokens_per_pass(a, k) for a in alphas) / costs.step_cost(k) for k in range(9)]
            assert adaptive.best_batch_k(alphas, costs) == max(range(9), key=lambda k: (rate[k], -k))
    middling = CostModel(target_base_s=1e-3, target_per_token_s=0.4e-3, draft_per_token_s=0.2e-3)
    assert adaptive.best_batch_k([0.99], middling) > 0 and adaptive.best_batch_k([0.99] + [0.05] * 31, middling) == 0


def test_pay_guard_refuses_drafting_that_has_not_paid_and_rechecks():
    """Realized tokens per second with and without drafts, per key: while undecided, plain and
    drafting steps take turns; drafting is refused where it emitted fewer per second than plain
    steps; after `recheck` refused steps it is measured afresh, and each recheck that loses again
    doubles the wait for the next, up to max_wait; a win resets it."""
    from moeserve.spec import PayGuard

    guard = PayGuard(window=8, min_steps=2, recheck=4, max_wait=8)
    key = (1, True)
    turns = []
    for _ in range(4):
        turns.append(guard.allows(key))
        guard.record(key, turns[-1], 3 if turns[-1] else 2, 0.010 if turns[-1] else 0.005)  # 300/s vs 400/s
    assert turns == [True, False, True, False]
    assert [guard.allows(key) for _ in range(4)] == [False, False, False, True]  # the 4th refusal rechecks
    assert guard.num_refused == 4
    guard.record(key, True, 3, 0.010)
    guard.record(key, False, 2, 0.005)
    guard.record(key, True, 3, 0.010)  # still 300/s: refused again, and the next recheck waits twice as long
    assert [guard.allows(key) for _ in range(8)] == [False] * 7 + [True]
    guard.record(key, True, 3, 0.010)
    guard.record(key, True, 3, 0.010)  # lost again: the wait stays at max_wait
    assert [guard.allows(key) for _ in range(8)] == [False] * 7 + [True]
    for _ in range(2):
        guard.record(key, True, 6, 0.010)  # 600/s: drafting pays now
    assert guard.allows(key) and guard.allows(key)
    guard.record(key, True, 1, 0.010)
    guard.record(key, True, 1, 0.010)  # loses again after a win: back to the first wait, 4
    assert [guard.allows(key) for _ in range(4)] == [False] * 3 + [True]
    guard.record((2, True), False, 1, 0.010)
    assert guard.allows((2, True))  # another batch-size bucket, undecided: its turn to draft
    for bad in ({"min_steps": 0}, {"window": 8, "min_steps": 9}, {"recheck": 0}, {"recheck": 8, "max_wait": 4}):
        with pytest.raises(ValueError):
            PayGuard(**bad)


def test_pay_guard_is_not_decided_by_one_stalled_step():
    """One drafting step stalled 60x (a collection, a busy neighbour) among steps that pay: the
    medians still say drafting pays, where the steps' summed tokens over summed seconds (72/s
    against 400/s) would refuse it for a whole recheck. Stalls in most of its steps do refuse it."""
    from moeserve.spec import PayGuard

    guard, key = PayGuard(min_steps=8), (1, False)
    for i in range(8):
        guard.record(key, False, 4, 0.010)  # 400/s
        guard.record(key, True, 6, 0.600 if i == 3 else 0.010)  # 600/s, one step at 10/s
    assert guard.allows(key) and guard.num_refused == 0
    for _ in range(8):
        guard.record(key, True, 6, 0.600)
    assert not guard.allows(key)


def test_adaptive_k_drafts_only_where_its_guard_allows() -> None:
    """choose_batch asks the guard of its key (bucket, constrained): a refused key plain-steps."""
    adaptive = AdaptiveK(AdaptiveKConfig(k_max=4, prior_alpha=0.9, probe_every=1000), CHEAP_DRAFT)
    for drafted, seconds in [(True, 0.01), (False, 0.001)] * 8:
        adaptive.record(1, True, int(drafted), 0.0, 0.0, 1, seconds)
    assert adaptive.choose_batch(["s"], constrained=True) == [0]
    assert adaptive.choose_batch(["s"], constrained=False)[0] > 0
