"""Verifying a batch's drafts against the target's pass: which draft tokens each row keeps.

Shapes: B rows, K draft tokens (widest row), V vocab, Tq positions the target was fed.
"""

from __future__ import annotations

import torch

from moeserve.sampler import Sampler
from moeserve.sampling_params import SamplingParams
from moeserve.sequence import Sequence
from moeserve.spec.rejection_sampler import RejectionSampler, SpecOutput

_GREEDY = SamplingParams(temperature=0.0)  # a placeholder for rows verified by rejection sampling


def verify(sampler: Sampler, rejection: RejectionSampler, seqs: list[Sequence], logits: torch.Tensor,
           draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, num_draft: torch.Tensor) -> SpecOutput:
    """logits [B, K+1, V] at the verification positions; drafts as `pad_proposals` packs them.
    Greedy and seeded rows keep drafts while they equal the target's own token (its argmax, or
    its keyed sample: the same reply with or without speculation); other rows: rejection sampling."""
    params = [s.params for s in seqs]
    drawn = [i for i, p in enumerate(params) if not p.greedy and p.seed is None]
    own = [p if i not in drawn else _GREEDY for i, p in enumerate(params)]
    target = sampler.sample(logits, own, positions=[s.num_tokens for s in seqs])  # [B, K+1]
    out = rejection.greedy(target, draft_ids, num_draft)
    if not drawn:
        return out
    rows = torch.tensor(drawn)
    q = draft_probs[rows] if draft_probs is not None else None
    sampled = rejection.sample(sampler.probs(logits[rows], [params[i] for i in drawn]), draft_ids[rows], q,
                               num_draft[rows])
    token_ids, accepted = list(out.token_ids), out.num_accepted.clone()
    for j, i in enumerate(drawn):
        token_ids[i], accepted[i] = sampled.token_ids[j], sampled.num_accepted[j]
    return SpecOutput(token_ids, accepted)


def verify_window(logits: torch.Tensor, fed: list[int], k: int) -> torch.Tensor:
    """The K+1 verification positions of each row: logits [B, Tq, V] -> [B, K+1, V], starting at
    its last fed token (fed[b] - 1; more than 0 after jump-forward appended forced tokens)."""
    if all(n == 1 for n in fed):
        return logits[:, : k + 1]
    start = torch.tensor(fed).unsqueeze(1) - 1  # [B, 1]
    pos = (start + torch.arange(k + 1)).clamp(max=logits.shape[1] - 1)  # [B, K+1]
    return logits[torch.arange(len(fed)).unsqueeze(1), pos]  # [B, K+1, V]
