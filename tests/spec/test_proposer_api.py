"""The Proposer interface, and packing proposals for the rejection sampler.

Shapes: B sequences, K draft tokens, V vocabulary.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeserve.spec import (
    Proposal,
    ProposalRequest,
    Proposer,
    RejectionSampler,
    pad_proposals,
)


class _Fixed(Proposer):
    def __init__(self, token: int = 0) -> None:
        self.token = token

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        return [Proposal([self.token] * r.num_tokens) for r in requests]

    def on_finished(self, seq_id: str) -> None:
        pass


def test_interface_is_abstract() -> None:
    with pytest.raises(TypeError):
        Proposer()  # type: ignore[abstract]


def test_validation() -> None:
    with pytest.raises(ValueError):
        ProposalRequest("a", [1], -1)
    with pytest.raises(ValueError):
        Proposal([1, 2], torch.rand(3, 5))
    assert Proposal([1, 2], torch.rand(2, 5)).num_tokens == 2


def test_pad_deterministic_proposals() -> None:
    ids, probs, num = pad_proposals([Proposal([4, 5]), Proposal([]), Proposal([6])])
    assert ids.tolist() == [[4, 5], [0, 0], [6, 0]]
    assert probs is None
    assert num.tolist() == [2, 0, 1]
    ids, _, _ = pad_proposals([Proposal([4])], width=3)
    assert ids.shape == (1, 3)
    with pytest.raises(ValueError, match="width"):
        pad_proposals([Proposal([4, 5])], width=1)


def test_pad_mixed_proposals_gives_one_hot_q_to_deterministic_rows() -> None:
    q = torch.softmax(torch.randn(2, 5), dim=-1)  # [k, V]
    ids, probs, num = pad_proposals([Proposal([1, 2], q), Proposal([3])])
    assert probs is not None and probs.shape == (2, 2, 5)
    assert torch.equal(probs[0], q)
    assert probs[1, 0].tolist() == [0, 0, 0, 1, 0]
    assert probs[1, 1].sum() == 0  # padding
    # The packed batch goes straight into the sampler.
    out = RejectionSampler().sample(torch.softmax(torch.randn(2, 3, 5), -1), ids, probs, num)
    assert [len(t) for t in out.token_ids] == (out.num_accepted + 1).tolist()


def test_spec_package_does_not_import_ray() -> None:
    code = (
        "import sys, moeserve.spec; sys.exit(1 if any(m == 'ray' or m.startswith('ray.') for m in sys.modules) else 0)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False).returncode == 0
