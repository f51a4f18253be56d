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
    assert adaptive.best_k(0.95) >= 7
    assert adaptive.best_k(1.0) == 8


def test_low_acceptance_gives_zero_when_drafting_does_not_pay() -> None:
    adaptive = AdaptiveK(AdaptiveKConfig(k_max=8), DEAR_DRAFT)
    assert adaptive.best_k(0.1) == 0
    assert adaptive.best_k(0.0) == 0
    # Same acceptance with a cheap draft: a little speculation still pays.
    assert AdaptiveK(AdaptiveKConfig(k_max=8), CHEAP_DRAFT).best_k(0.3) >= 1


def test_best_k_is_the_argmax_of_tokens_per_second() -> None:
    adaptive = AdaptiveK(AdaptiveKConfig(k_max=10), DEAR_DRAFT)
    for alpha in [i / 20 for i in range(21)]:
        rates = [expected_tokens_per_pass(alpha, k) / DEAR_DRAFT.step_cost(k) for k in range(11)]
        assert adaptive.best_k(alpha) == max(range(11), key=lambda k: (rates[k], -k))


def test_best_k_grows_with_alpha() -> None:
    adaptive = AdaptiveK(AdaptiveKConfig(k_max=8), DEAR_DRAFT)
    ks = [adaptive.best_k(i / 20) for i in range(21)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 8


def test_per_sequence_acceptance_drives_k() -> None:
    adaptive = AdaptiveK(AdaptiveKConfig(k_max=8, probe_every=1000), DEAR_DRAFT)
    for _ in range(20):
        adaptive.observe("formulaic", num_proposed=4, num_accepted=4)
        adaptive.observe("free-form", num_proposed=4, num_accepted=0)
    assert adaptive.alpha("formulaic") > 0.95
    # its own evidence (~5 recent trials) against 2 pseudo-trials at the pool's alpha (~0.8)
    assert adaptive.alpha("free-form") < 0.25
    assert adaptive.choose_k("formulaic") >= 6
    assert adaptive.choose_k("free-form") == 0


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
    assert adaptive.choose_k("s") == 0
    plain = 1
    while adaptive.choose_k("s") == 0:
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
    # a probe that does not win k back doubles the wait for the next (test_probes_that_do_not_pay_back_off)
    assert [adaptive.choose_k("s") for _ in range(9)] == [0, 0, 1, 0, 0, 0, 0, 0, 1]


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
    cheap = adaptive.choose_k("s")
    adaptive.set_costs(DEAR_DRAFT)
    assert adaptive.choose_k("s") < cheap


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
    assert adaptive.costs_for(20) == BUSY_BATCH  # 16-31: unmeasured, the nearest measured bucket
    assert adaptive.costs_for(2) == CHEAP_DRAFT
    for rows, rate in ((1, CHEAP_DRAFT), (32, BUSY_BATCH)):  # the choice is the argmax at that bucket
        k = adaptive.best_k(0.8, adaptive.costs_for(rows))
        best = max(range(9), key=lambda j: (expected_tokens_per_pass(0.8, j) / rate.step_cost(j), -j))
        assert k == best


def test_a_batch_probes_together_and_explores_plain_steps() -> None:
    """No row drafts: every probe interval all rows draft one token at once (one wider pass, not
    one per sequence). Rows draft: every explore_every-th step is plain, to measure a plain pass
    (two in a row: the second is measured as plain steps are)."""
    quiet = AdaptiveK(AdaptiveKConfig(k_max=4, probe_every=3, prior_alpha=0.0), DEAR_DRAFT)
    rows = ["a", "b", "c"]
    assert [quiet.choose_batch(rows) for _ in range(9)] == [[0] * 3, [0] * 3, [1] * 3] + [[0] * 3] * 5 + [[1] * 3]
    busy = AdaptiveK(AdaptiveKConfig(k_max=4, prior_alpha=0.9, explore_every=32), CHEAP_DRAFT)
    steps = [busy.choose_batch(rows) for _ in range(100)]
    plain = [i + 1 for i, s in enumerate(steps) if s == [0] * 3]  # early in a bucket, then two every 32
    assert plain == [4, 8, 16, 32, 33, 64, 65, 96, 97] and all(min(s) > 0 for s in steps if s != [0] * 3)


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
    assert adaptive.best_k(0.99, middling) > 0 and adaptive.best_batch_k([0.99] + [0.05] * 31, middling) == 0


def test_probes_that_do_not_pay_back_off() -> None:
    """Each probe after which k stays 0 doubles the bucket's interval (3, 6, 12, ... steps, up to
    16 intervals); a probe that wins k back resets it."""
    adaptive = AdaptiveK(AdaptiveKConfig(k_max=4, probe_every=3, prior_alpha=0.0), DEAR_DRAFT)
    probes = [i for i in range(200) if adaptive.choose_k("s") == 1]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:5] == [6, 12, 24, 48, 48], gaps  # the first probe comes after 3 plain steps
    for _ in range(50):  # the text turned formulaic: the next probe pays and resets the interval
        adaptive.observe("s", 4, 4)
    assert adaptive.choose_k("s") > 0


def test_pay_guard_refuses_drafting_that_has_not_paid_and_rechecks():
    """Realized tokens per second with and without drafts, per key: while undecided, plain and
    drafting steps take turns; drafting is refused where it emitted fewer per second; every
    `recheck` refused steps (doubling) it is measured afresh."""
    from moeserve.spec import PayGuard

    guard = PayGuard(decay=1.0, min_steps=2, recheck=4, recheck_steps=2, budget=1.0)
    key = (1, True)
    assert not guard.allows(key)  # nothing measured: a plain step first
    guard.record(key, False, 2, 0.005)  # 400 tokens/s without drafts
    assert guard.allows(key)  # then a drafting step
    guard.record(key, True, 1, 0.5)  # the first step with drafts (a channel's set-up): left out
    assert not guard.allows(key)
    guard.record(key, False, 1, 0.010)  # right after drafting: feeds what the drafts left, so drafting's
    assert not guard.allows(key)  # a plain step as plain steps are, before the next drafting one
    guard.record(key, False, 2, 0.005)
    assert guard.allows(key)
    guard.record(key, True, 3, 0.010)  # 300 tokens/s with drafts
    assert guard.rates(key) == (pytest.approx(400), pytest.approx(4 / 0.020))
    decisions = [guard.allows(key) for _ in range(12)]
    assert decisions == [False, False, False, True] + [False] * 8  # the 4th refusal rechecks: one drafting step
    assert guard.num_refused == 4
    for _ in range(2):
        guard.record(key, True, 3, 0.010)  # still 300/s: refused again, now for 8 steps
    assert [guard.allows(key) for _ in range(8)] == [False] * 7 + [True]
    for _ in range(2):
        guard.record(key, True, 6, 0.010)  # 600/s: drafting pays now
    assert guard.allows(key) and guard.allows(key)
    with pytest.raises(ValueError):
        PayGuard(min_steps=0)
    with pytest.raises(ValueError):
        PayGuard(budget=1.5)


def test_a_pay_guard_refuses_a_clear_loss_early_and_decides_a_small_one_at_min_steps():
    """The first decision at a key waits for min_steps drafting steps, unless after recheck_steps
    drafting emitted less than `early` times plain's rate; a recheck decides after recheck_steps.
    Drafting pays where it emitted `margin` times plain's rate, not where it emitted a little more."""
    from moeserve.spec import PayGuard

    def turn(guard: PayGuard, drafting_rate: float) -> None:
        """A drafting step, the plain step after it (drafting's: it feeds what the drafts left), and
        a plain step at 500/s: what an undecided key's steps look like."""
        guard.record(key, True, 2, 2 / drafting_rate)
        guard.record(key, False, 2, 2 / drafting_rate)
        guard.record(key, False, 1, 0.002)

    def measured(drafting_rate: float) -> PayGuard:
        guard = PayGuard(decay=1.0, min_steps=4, recheck=2, recheck_steps=2, budget=1.0)
        guard.record((9, False), True, 1, 1.0)  # the guard's first drafting step: left out
        guard.record((9, False), False, 1, 1.0)  # (counted as drafting's there: a step after drafting)
        for _ in range(4):  # plain at 500/s
            guard.record(key, False, 1, 0.002)
        turn(guard, drafting_rate)
        return guard

    key = (6, False)
    assert not measured(200).allows(key)  # 200/s against 500/s after two steps: refused already
    guard = measured(450)  # 450/s: not a clear loss after two steps
    assert guard.allows(key)
    turn(guard, 450)
    assert [guard.allows(key) for _ in range(2)] == [False, True]  # four steps: refused; then the recheck
    guard.record(key, True, 2, 0.010)
    assert not guard.refused(key)  # one drafting step is not yet a measurement
    guard.record(key, False, 2, 0.010)
    assert not guard.allows(key) and guard.refused(key)  # two are: still losing, refused again
    assert PayGuard(min_steps=2, recheck_steps=5).recheck_steps == 2  # never more than the first decision's
    guard = measured(510)  # 510/s against 500/s: more, but not by `margin` (1.05): refused at min_steps
    turn(guard, 510)
    assert not guard.allows(key)
    guard = measured(530)  # 530/s: by more than the margin, it pays
    turn(guard, 530)
    assert guard.allows(key) and guard.allows(key)
    with pytest.raises(ValueError, match="margin"):
        PayGuard(margin=0.9)


def test_a_pay_guard_follows_a_refusal_at_fewer_rows_and_tries_again_from_a_budget():
    """Where drafting did not pay at a smaller batch-size bucket of the same kind, a bucket not
    decided yet refuses it too (other kinds are their own); once refused, drafting steps tried
    again (rechecks, undecided buckets) stay within `budget` of all decode steps' seconds."""
    from moeserve.spec import PayGuard

    guard = PayGuard(decay=1.0, min_steps=2, recheck=1, recheck_steps=2, budget=0.1)
    small, large, other = (2, True), (4, True), (4, False)
    for key in (small, large, other):
        for _ in range(2):
            guard.record(key, False, 2, 0.005)  # 400/s plain
    guard.record(small, True, 1, 0.001)  # the guard's first drafting step: left out
    for _ in range(2):
        guard.record(small, True, 1, 0.010)  # 100/s with drafts: a clear loss (tried for free: no refusal yet)
    assert guard.rates(small)[1] == pytest.approx(100)
    assert not guard.allows(large)  # follows the smaller bucket's refusal
    assert guard.allows(other)  # unconstrained batches: their own
    assert guard.allows(small)  # the first recheck (recheck=1): nothing spent yet
    for _ in range(2):
        guard.record(small, True, 1, 0.010)  # still 100/s: paid from the budget
    assert guard._spent[(True,)] == pytest.approx(0.020)
    assert [guard.allows(small) for _ in range(2)] == [False, False]  # the next recheck is due, but over budget
    for _ in range(40):  # plain steps grow the budget: 0.1 of all steps' seconds (the first, right after
        guard.record(large, False, 2, 0.005)  # drafting, is paid from it too: 0.025 s spent)
    assert guard._spent[(True,)] == pytest.approx(0.025)
    assert guard.allows(small)  # affordable now: the recheck
    for _ in range(2):
        guard.record(small, True, 8, 0.010)  # 800/s: drafting pays at the small bucket now
    assert guard.allows(small)
    assert not guard.allows(large)  # no longer follows a refusal, but trying it waits for the budget
    for _ in range(60):
        guard.record(other, False, 2, 0.005)
    assert guard._spent[(True,)] == pytest.approx(0.050) and guard.allows(large)
