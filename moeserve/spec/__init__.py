"""Speculative decoding, the model-independent core: proposers, the rejection sampler, the policy
that picks k, and the metrics (the draft model runs through the engine's runner: engine/draft_model.py)."""

from moeserve.spec.metrics import SpecMetrics, expected_tokens_per_pass
from moeserve.spec.ngram import NgramProposer
from moeserve.spec.policy import AdaptiveK, AdaptiveKConfig, CostModel, PayGuard, SpecConfig, StepCostMeter
from moeserve.spec.proposer import Proposal, ProposalRequest, Proposer, pad_proposals
from moeserve.spec.rejection_sampler import RejectionSampler, SpecOutput

__all__ = [
    "AdaptiveK", "AdaptiveKConfig", "CostModel", "NgramProposer", "PayGuard", "Proposal", "ProposalRequest",
    "Proposer", "RejectionSampler", "SpecConfig", "SpecMetrics", "SpecOutput", "StepCostMeter",
    "expected_tokens_per_pass", "pad_proposals",
]
