"""Speculative decoding, the model-independent core.

A proposer guesses k tokens per sequence, the target scores the k guesses plus one in a
single forward pass, and the rejection sampler keeps the longest prefix the target agrees
with. What the engine imports:

- `RejectionSampler`, `SpecOutput` — exact verification (greedy and sampled).
- `Proposer`, `ProposalRequest`, `Proposal`, `pad_proposals` — drafting.
- `NgramProposer` — prompt lookup, the model-free proposer.
- (the draft model's proposer runs a model through the engine's runner, so it lives there:
  `moeserve.engine.draft_model.DraftModelProposer`).
- `AdaptiveK`, `AdaptiveKConfig`, `CostModel`, `StepCostMeter`, `PayGuard`, `SpecConfig` — the
  speculation policy (policy.py): k per step from acceptance and measured step costs, and drafting
  refused where it has not paid, as realized.
- `SpecMetrics` — acceptance rate, tokens per pass, and the formula next to it.
"""

from moeserve.spec.metrics import SpecMetrics, expected_tokens_per_pass
from moeserve.spec.ngram import NgramProposer
from moeserve.spec.policy import AdaptiveK, AdaptiveKConfig, CostModel, PayGuard, SpecConfig, StepCostMeter
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
    "SpecConfig",
    "SpecOutput",
    "StepCostMeter",
    "expected_tokens_per_pass",
    "pad_proposals",
]
