"""Speculative decoding, the model-independent core.

A proposer guesses k tokens per sequence, the target scores the k guesses plus one in a single
forward pass, and the rejection sampler keeps the longest prefix the target agrees with
(rejection_sampler.py). Proposers: prompt lookup here (ngram.py); the draft model runs through
the engine's runner, so it lives in moeserve.engine.draft_model. How many tokens to draft:
policy.py. Acceptance and tokens per pass, with the formula beside them: metrics.py.
"""

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
