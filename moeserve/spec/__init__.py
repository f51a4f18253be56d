"""Speculative decoding, the model-independent core.

A proposer guesses k tokens per sequence, the target scores the k guesses plus one in a
single forward pass, and the rejection sampler keeps the longest prefix the target agrees
with. What the engine imports:

- `RejectionSampler`, `SpecOutput` — exact verification (greedy and sampled).
- `Proposer`, `ProposalRequest`, `Proposal`, `pad_proposals` — drafting.
- `NgramProposer` — prompt lookup, the model-free proposer.
- (the draft model's proposer runs a model through the engine's runner, so it lives there:
  `moeserve.engine.draft_model.DraftModelProposer`).
- `StepCostMeter` — measured step times, refit into the CostModel adaptive k uses.
- `AdaptiveK`, `AdaptiveKConfig`, `CostModel` — per-sequence choice of k; `PayGuard` — drafting
  refused where it has not paid, as realized.
- `SpecMetrics` — acceptance rate, tokens per pass, and the formula next to it.
"""

from moeserve.spec.adaptive import AdaptiveK, AdaptiveKConfig, CostModel, expected_tokens_per_pass
from moeserve.spec.cost_meter import StepCostMeter
from moeserve.spec.metrics import SpecMetrics
from moeserve.spec.ngram import NgramProposer
from moeserve.spec.pay_guard import PayGuard
from moeserve.spec.proposer import (
    Proposal,
    ProposalRequest,
    Proposer,
    pad_proposals,
)
from moeserve.spec.rejection_sampler import RejectionSampler, SpecOutput

__all__ = [
    "AdaptiveK",
    "AdaptiveKConfig",
    "PayGuard",
    "CostModel",
    "NgramProposer",
    "Proposal",
    "ProposalRequest",
    "Proposer",
    "RejectionSampler",
    "SpecMetrics",
    "SpecOutput",
    "StepCostMeter",
    "expected_tokens_per_pass",
    "pad_proposals",
]
