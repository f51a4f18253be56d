"""Sampled verification follows the target's distribution (chi-square tests).

Each test draws tens of thousands of rows in one batched call, with fixed seeds so the
outcome is deterministic, and rejects at p < 1e-3. Negative controls run deliberately
wrong samplers through the same test to show that it can fail.

Shapes: N rows (samples), K draft tokens, V vocabulary, L generated length.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from moeserve.spec import RejectionSampler, SpecOutput

P_MIN = 1e-3
VOCAB = 6
K = 2


def _random_dists(gen: torch.Generator, *shape: int) -> torch.Tensor:
    # Mixed with uniform so every cell keeps enough expected counts for chi-square.
    raw = -torch.log(torch.rand(*shape, generator=gen))  # Exp(1): Dirichlet(1) after normalising
    return 0.7 * raw / raw.sum(-1, keepdim=True) + 0.3 / shape[-1]


def _pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of tokens [n] against probs [V]."""
    observed = torch.bincount(tokens, minlength=probs.shape[0]).double()  # [V]
    p64 = probs.double()  # [V]
    expected = p64 / p64.sum() * tokens.shape[0]  # [V]
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


class _AcceptAlways(RejectionSampler):
    """Wrong: keeps every draft token, so it emits q instead of p."""

    def sample(
        self,
        target_probs: torch.Tensor,
        draft_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        num_draft: torch.Tensor,
        generators: list[torch.Generator | None] | None = None,
    ) -> SpecOutput:
        bonus = torch.multinomial(target_probs[:, -1], 1).squeeze(-1)  # [N]
        tokens = torch.cat([draft_ids, bonus[:, None]], dim=1).tolist()  # [N, K+1]
        return SpecOutput(token_ids=tokens, num_accepted=torch.full((draft_ids.shape[0],), draft_ids.shape[1]))


class _RecoverFromTarget(RejectionSampler):
    """Wrong in the common way: after a rejection, samples from p instead of max(0, p - q)."""

    @staticmethod
    def recovery_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return p


def _one_step(
    sampler: RejectionSampler, deterministic: bool, seed: int, n: int, seeded_rows: bool = False
) -> tuple[SpecOutput, torch.Tensor]:
    """N rows sharing one target p [K+1, V]; drafts from q (or arbitrary fixed proposals)."""
    gen = torch.Generator().manual_seed(seed)
    p = _random_dists(gen, K + 1, VOCAB)  # [K+1, V]
    q = _random_dists(gen, K, VOCAB)  # [K, V]
    drafts = torch.multinomial(q.repeat(n, 1), 1, replacement=True, generator=gen).view(n, K)  # [N, K]
    # A deterministic proposer's tokens can come from anywhere; exactness holds for any
    # proposal once q is one-hot at it, so drawing them from q here is as good as any.
    draft_probs = None if deterministic else q.expand(n, K, VOCAB)  # [N, K, V]
    generators = [torch.Generator().manual_seed(seed * 100_003 + i) for i in range(n)] if seeded_rows else None
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        out = sampler.sample(p.expand(n, K + 1, VOCAB), drafts, draft_probs, torch.full((n,), K), generators)
    return out, p


def _position_pvalues(out: SpecOutput, p: torch.Tensor) -> list[float]:
    """For j = 1 .. K+1: p-value of the j-th emitted token, among rows that emitted it, vs p_j."""
    pvalues = []
    for j in range(K + 1):
        tokens = torch.tensor([row[j] for row in out.token_ids if len(row) > j])
        pvalues.append(_pvalue(tokens, p[j]))
    return pvalues


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-probs", "q-none"])
def test_each_emitted_position_follows_target(deterministic: bool) -> None:
    out, p = _one_step(RejectionSampler(), deterministic, seed=1, n=30_000)
    accepted = out.num_accepted
    # Every path is exercised: first rejected, a later rejection, and the bonus token.
    assert min(int((accepted == n).sum()) for n in range(K + 1)) > 500
    pvalues = _position_pvalues(out, p)
    assert min(pvalues) > P_MIN, pvalues


def test_per_row_generators_follow_target() -> None:
    out, p = _one_step(RejectionSampler(), deterministic=False, seed=2, n=20_000, seeded_rows=True)
    pvalues = _position_pvalues(out, p)
    assert min(pvalues) > P_MIN, pvalues


@pytest.mark.parametrize("wrong", [_AcceptAlways(), _RecoverFromTarget()], ids=["accept-always", "recover-from-p"])
def test_negative_control_wrong_sampler_fails(wrong: RejectionSampler) -> None:
    out, p = _one_step(wrong, deterministic=False, seed=1, n=30_000)
    first = torch.tensor([row[0] for row in out.token_ids])
    assert _pvalue(first, p[0]) < P_MIN


# --- the whole generated text, multi-step, prefix-dependent distributions --------------

JOINT_VOCAB, JOINT_LEN, JOINT_K = 3, 4, 3
BOS = JOINT_VOCAB  # "previous token" index at position 0


def _generate(
    sampler: RejectionSampler, target: torch.Tensor, draft: torch.Tensor, deterministic: bool, n: int, seed: int
) -> torch.Tensor:
    """Speculative generation of L tokens for N rows with a toy model.

    target, draft: [L+K, V+1, V] next-token distribution given (position, previous token).
    Each step gives every unfinished row a random k in 0..K. Returns tokens [N, L].
    """
    gen = torch.Generator().manual_seed(seed)
    vocab, k_max = JOINT_VOCAB, JOINT_K
    seqs: list[list[int]] = [[] for _ in range(n)]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        while True:
            active = [i for i, s in enumerate(seqs) if len(s) < JOINT_LEN]
            if not active:
                break
            pos = torch.tensor([len(seqs[i]) for i in active])  # [N]
            prev = torch.tensor([seqs[i][-1] if seqs[i] else BOS for i in active])  # [N]
            num_draft = torch.randint(k_max + 1, (len(active),), generator=gen)  # [N]
            drafts, q_rows, p_rows = [], [], []
            for j in range(k_max):
                q_j = draft[pos + j, prev]  # [N, V]
                p_rows.append(target[pos + j, prev])
                x_j = q_j.argmax(-1) if deterministic else torch.multinomial(q_j, 1, generator=gen).squeeze(-1)
                drafts.append(x_j)
                q_rows.append(q_j)
                prev = x_j
            p_rows.append(target[pos + k_max, prev])
            target_probs = torch.stack(p_rows, dim=1)  # [N, K+1, V]
            draft_probs = None if deterministic else torch.stack(q_rows, dim=1)  # [N, K, V]
            out = sampler.sample(target_probs, torch.stack(drafts, dim=1), draft_probs, num_draft)
            for i, tokens in zip(active, out.token_ids):
                seqs[i].extend(tokens)
    assert all(0 <= t < vocab for s in seqs for t in s)
    return torch.tensor([s[:JOINT_LEN] for s in seqs])  # [N, L]


def _joint_probs(target: torch.Tensor) -> torch.Tensor:
    """[V^L] the target's probability of every length-L text, in base-V order."""
    probs = []
    for text in itertools.product(range(JOINT_VOCAB), repeat=JOINT_LEN):
        prob, prev = 1.0, BOS
        for pos, tok in enumerate(text):
            prob *= float(target[pos, prev, tok])
            prev = tok
        probs.append(prob)
    return torch.tensor(probs)


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-probs", "q-none"])
def test_generated_text_follows_target_joint(deterministic: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    shape = (JOINT_LEN + JOINT_K, JOINT_VOCAB + 1, JOINT_VOCAB)
    target, draft = _random_dists(gen, *shape), _random_dists(gen, *shape)
    texts = _generate(RejectionSampler(), target, draft, deterministic, n=30_000, seed=4)  # [N, L]
    weights = JOINT_VOCAB ** torch.arange(JOINT_LEN - 1, -1, -1)  # [L]
    cells = (texts * weights).sum(-1)  # [N]
    assert _pvalue(cells, _joint_probs(target)) > P_MIN


def test_negative_control_joint_fails_for_wrong_sampler() -> None:
    gen = torch.Generator().manual_seed(3)
    shape = (JOINT_LEN + JOINT_K, JOINT_VOCAB + 1, JOINT_VOCAB)
    target, draft = _random_dists(gen, *shape), _random_dists(gen, *shape)
    texts = _generate(_RecoverFromTarget(), target, draft, False, n=30_000, seed=4)  # [N, L]
    weights = JOINT_VOCAB ** torch.arange(JOINT_LEN - 1, -1, -1)  # [L]
    assert _pvalue((texts * weights).sum(-1), _joint_probs(target)) < P_MIN


def test_zero_probability_tokens_are_never_emitted() -> None:
    # As after top-k: the target keeps 3 of 1000 tokens, the draft another 3 (overlapping).
    gen = torch.Generator().manual_seed(5)
    n, k, vocab = 2000, 3, 1000
    target = torch.zeros(n, k + 1, vocab)  # [N, K+1, V]
    target[..., [10, 500, 999]] = torch.tensor([0.2, 0.3, 0.5])
    draft = torch.zeros(n, k, vocab)  # [N, K, V]
    draft[..., [0, 10, 500]] = torch.tensor([0.6, 0.2, 0.2])
    drafts = torch.multinomial(draft.view(-1, vocab), 1, generator=gen).view(n, k)  # [N, K]
    out = RejectionSampler().sample(target, drafts, draft, torch.full((n,), k))
    emitted = {t for row in out.token_ids for t in row}
    assert emitted <= {10, 500, 999} and emitted == {10, 500, 999}


def test_residual_falls_back_to_target_when_empty() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])  # [B, V]
    q = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.3, 0.2]])  # [B, V]
    residual = RejectionSampler.recovery_distribution(p, q)
    assert torch.equal(residual[0], p[0])
    assert torch.allclose(residual[1], torch.tensor([0.0, 0.0, 0.3]))
