"""Verification of draft tokens by the target: greedy and exact rejection sampling.

Shapes: B sequences, K draft tokens (the widest row; shorter rows right-padded), V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SpecOutput:
    """What one verification step emits: per row, the accepted draft tokens and then exactly one
    recovered or bonus token (token_ids), and how many draft tokens it kept (num_accepted [B]; the
    engine rolls the KV caches of target and draft back past the rest)."""

    token_ids: list[list[int]]
    num_accepted: Tensor  # [B]

    def __post_init__(self) -> None:
        if self.num_accepted.dim() != 1 or self.num_accepted.shape[0] != len(self.token_ids):
            raise ValueError(f"num_accepted must have shape [{len(self.token_ids)}], got {list(self.num_accepted.shape)}")
        for row, (tokens, n) in enumerate(zip(self.token_ids, self.num_accepted.tolist())):
            if len(tokens) != n + 1:
                raise ValueError(f"row {row}: {n} accepted tokens must emit {n + 1} tokens, got {len(tokens)}")


class RejectionSampler:
    """Keeps the longest prefix of the draft that the target agrees with (the accepted tokens), plus
    one token: at the first rejected position a recovered token from the residual max(0, p - q)
    (greedy: the target's argmax), or the bonus token from p after all k drafts were accepted.

    Exactness (Leviathan et al. 2023; Chen et al. 2023): accepting x ~ q with probability
    min(1, p(x) / q(x)), else sampling the normalised residual, yields a token distributed exactly
    as p. p and q are taken as given (the caller applies sampling parameters and grammar masks).
    """

    def greedy(self, target_argmax: Tensor, draft_ids: Tensor, num_draft: Tensor) -> SpecOutput:
        """Keeps proposals while they equal the target's argmax. target_argmax: [B, K+1] after
        0 .. K draft tokens; draft_ids: [B, K] right-padded; num_draft: [B] real proposals per row."""
        _, k_max = _check_common(draft_ids, num_draft, target_argmax.shape[:2], "target_argmax")
        device = draft_ids.device
        num_draft = num_draft.to(device)
        valid = torch.arange(k_max, device=device) < num_draft[:, None]  # [B, K]
        matches = (draft_ids == target_argmax[:, :k_max].to(device)) & valid  # [B, K]
        num_accepted = matches.long().cumprod(dim=1).sum(dim=1)  # [B]
        # accepted drafts equal the argmax: emit the argmax up to the first mismatch (or the bonus)
        rows, counts = target_argmax.tolist(), num_accepted.tolist()
        return SpecOutput(token_ids=[row[: n + 1] for row, n in zip(rows, counts)], num_accepted=num_accepted)

    def sample(self, target_probs: Tensor, draft_ids: Tensor, draft_probs: Tensor | None, num_draft: Tensor,
               generators: list[torch.Generator | None] | None = None) -> SpecOutput:
        """Sampled verification, exact in distribution. target_probs: [B, K+1, V]; draft_ids: [B, K]
        right-padded; num_draft: [B] real proposals per row; draft_probs: [B, K, V], or None for
        deterministic drafts (one-hot q). generators: one per row (None: the default); a row with
        its own draws exactly num_draft[b] + 1 uniforms from it, whatever the batch."""
        batch, k_max = _check_common(draft_ids, num_draft, target_probs.shape[:2], "target_probs")
        if target_probs.dim() != 3:
            raise ValueError(f"target_probs must be [B, K+1, V], got {list(target_probs.shape)}")
        vocab = target_probs.shape[-1]
        if draft_probs is not None and draft_probs.shape != (batch, k_max, vocab):
            raise ValueError(f"draft_probs must be [{batch}, {k_max}, {vocab}], got {list(draft_probs.shape)}")
        if generators is not None and len(generators) != batch:
            raise ValueError(f"need one generator (or None) per row: {batch} rows, {len(generators)} generators")

        device = target_probs.device
        num_draft = num_draft.to(device)
        rows = torch.arange(batch, device=device)
        valid = torch.arange(k_max, device=device) < num_draft[:, None]  # [B, K]
        # Padding may hold any id (e.g. -1); point it at token 0 so gathers stay in range.
        ids = torch.where(valid, draft_ids.to(device).long(), 0)  # [B, K]
        uniform, final_uniform = _draw_uniforms(num_draft.tolist(), k_max, generators, device)  # [B, K], [B]

        # Gather first, convert after: probabilities may arrive in bf16 and [B, K+1, V] is big.
        p_draft = target_probs[:, :k_max].gather(-1, ids[..., None]).squeeze(-1).float()  # [B, K]
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)  # [B, K]
        else:
            draft_probs = draft_probs.to(device)
            q_draft = draft_probs.gather(-1, ids[..., None]).squeeze(-1).float()  # [B, K]
        # Accept with probability min(1, p/q). Written as u * q < p so that q = 0 < p (a
        # token the draft could not have sampled) is accepted rather than divided by zero.
        accepted = (uniform * q_draft < p_draft) & valid  # [B, K]
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]

        # The position after the accepted prefix either held the first rejected draft token
        # (sample the recovered token from the residual) or is the bonus position (from p).
        p_next = target_probs[rows, num_accepted].float()  # [B, V]
        rejected = num_accepted < num_draft  # [B]
        if k_max > 0:
            slot = num_accepted.clamp(max=k_max - 1)  # [B]
            if draft_probs is None:
                q_next = torch.nn.functional.one_hot(ids[rows, slot], vocab).float()  # [B, V]
            else:
                q_next = draft_probs[rows, slot].float()  # [B, V]
            dist = torch.where(rejected[:, None], self.recovery_distribution(p_next, q_next), p_next)  # [B, V]
        else:
            dist = p_next  # [B, V]
        final = _sample_inverse_cdf(dist, final_uniform)  # [B]

        out = torch.cat([ids, torch.zeros(batch, 1, dtype=torch.long, device=device)], dim=1)  # [B, K+1]
        out[rows, num_accepted] = final
        counts = num_accepted.tolist()
        token_ids = [row[: n + 1] for row, n in zip(out.tolist(), counts)]
        return SpecOutput(token_ids=token_ids, num_accepted=num_accepted)

    @staticmethod
    def recovery_distribution(p: Tensor, q: Tensor) -> Tensor:
        """The unnormalised residual max(0, p - q) [B, V]; p where it is all zeros (p == q up to
        rounding: the rejection was a floating-point accident)."""
        residual = (p - q).clamp_min(0.0)  # [B, V]
        empty = residual.sum(dim=-1, keepdim=True) <= 0.0  # [B, 1]
        return torch.where(empty, p, residual)  # [B, V]


def _check_common(draft_ids: Tensor, num_draft: Tensor, target_shape: torch.Size, name: str) -> tuple[int, int]:
    """Validates the shapes shared by greedy and sampled verification; returns (B, K)."""
    if draft_ids.dim() != 2:
        raise ValueError(f"draft_ids must be [B, K], got {list(draft_ids.shape)}")
    batch, k_max = draft_ids.shape
    if tuple(target_shape) != (batch, k_max + 1):
        raise ValueError(f"{name} must start with [{batch}, {k_max + 1}] (K+1 positions), got {list(target_shape)}")
    if num_draft.shape != (batch,):
        raise ValueError(f"num_draft must be [{batch}], got {list(num_draft.shape)}")
    if batch and (int(num_draft.min()) < 0 or int(num_draft.max()) > k_max):
        raise ValueError(f"num_draft must lie in [0, {k_max}], got {num_draft.tolist()}")
    return batch, k_max


def _draw_uniforms(num_draft: list[int], k_max: int, generators: list[torch.Generator | None] | None,
                   device: torch.device) -> tuple[Tensor, Tensor]:
    """Uniforms for acceptance [B, K] and for the recovered or bonus token [B]: a seeded row draws
    exactly num_draft[b] + 1 from its own generator; unseeded rows share one default draw."""
    batch = len(num_draft)
    gens = list(generators) if generators is not None else [None] * batch
    uniform = torch.ones(batch, k_max + 1, device=device)  # [B, K+1]
    unseeded = [b for b, gen in enumerate(gens) if gen is None]
    if len(unseeded) == batch:
        uniform.uniform_()
    elif unseeded:
        uniform[torch.tensor(unseeded, device=device)] = torch.rand(len(unseeded), k_max + 1, device=device)
    final = uniform[:, -1].clone()  # [B]
    for b, gen in enumerate(gens):
        if gen is not None:
            # Padding slots keep 1.0, never accepted (they are masked by num_draft anyway).
            n = num_draft[b]
            draws = torch.rand(n + 1, generator=gen, device=gen.device).to(device)  # [n+1]
            uniform[b, :n] = draws[:n]
            final[b] = draws[n]
    return uniform[:, :k_max], final


def _sample_inverse_cdf(weights: Tensor, uniform: Tensor) -> Tensor:
    """One index per row, proportional to weights [B, V], from uniform [B] (inverse CDF). The CDF
    is summed in float64 so rounding cannot shift mass between tokens; the first cdf > u * total
    never lands on a zero-weight token."""
    cdf = weights.double().cumsum(dim=-1)  # [B, V]
    target = uniform.double() * cdf[:, -1]  # [B]
    index = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)  # [B]
    return index.clamp_(max=weights.shape[-1] - 1)
