"""Prompt lookup: propose the tokens that followed the last time the current suffix occurred; pays
off when the answer quotes its context (RAG, code edits, formulaic replies, JSON).

Shapes: L tokens in one sequence's history, P = max_n sentinel slots in front of them,
C candidate match positions, n tokens compared per candidate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moeserve.spec.proposer import Proposal, ProposalRequest, Proposer

# Never a token id. The history keeps max_n of these in front of the tokens, so that
# comparing backwards from a match near the start fails without a bounds check.
_SENTINEL = -1


class _History:
    """One sequence's tokens in a growing numpy buffer, appended to between steps."""

    def __init__(self, pad: int) -> None:
        self.pad = pad
        self.buf = np.full(pad + 64, _SENTINEL, dtype=np.int64)  # [P + capacity]
        self.length = 0

    def sync(self, token_ids: Sequence[int]) -> None:
        """Copies in the new tail of token_ids; rebuilds where they no longer extend what is held
        (shorter, or another first or last known token: a reused seq_id)."""
        n, have, pad = len(token_ids), self.length, self.pad
        if have and (n < have or token_ids[0] != self.buf[pad] or token_ids[have - 1] != self.buf[pad + have - 1]):
            have = 0
        if pad + n > self.buf.shape[0]:
            grown = np.full(pad + max(n, 2 * (self.buf.shape[0] - pad)), _SENTINEL, dtype=np.int64)
            grown[: pad + have] = self.buf[: pad + have]
            self.buf = grown
        if n > have:
            self.buf[pad + have : pad + n] = token_ids[have:n]
        self.length = n

    @property
    def padded(self) -> np.ndarray:
        return self.buf[: self.pad + self.length]  # [P + L]


class NgramProposer(Proposer):
    """Prompt lookup: matches the last n tokens (longest n in [min_n, max_n] first, the most recent
    occurrence among the longest) and proposes up to k tokens that followed. A copy that runs into
    the end of the sequence continues with its own output ("a b a b ..."), as in LZ77."""

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._offsets = np.arange(max_n)  # [max_n]
        self._histories: dict[str, _History] = {}

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """One deterministic proposal (probs None) per request; empty when nothing matches."""
        proposals = []
        for req in requests:
            if req.num_tokens == 0:
                proposals.append(Proposal(token_ids=[]))
                continue
            history = self._histories.get(req.seq_id)
            if history is None:
                history = self._histories[req.seq_id] = _History(self.max_n)
            history.sync(req.token_ids)
            proposals.append(Proposal(token_ids=self._lookup(history, req.num_tokens)))
        return proposals

    def on_finished(self, seq_id: str) -> None:
        """Drops the sequence's history."""
        self._histories.pop(seq_id, None)

    @property
    def num_tracked(self) -> int:
        """How many sequences currently hold a history (for leak checks)."""
        return len(self._histories)

    def _lookup(self, history: _History, k: int) -> list[int]:
        length = history.length
        if k <= 0 or length < self.min_n + 1:
            return []
        seq = history.padded  # [P + L]
        last = seq.shape[0] - 1
        # Candidate ends e of an earlier n-gram: they hold the last token and have at least
        # one token after them (e < last), so the suffix never matches itself.
        ends = np.flatnonzero(seq[history.pad : last] == seq[last]) + history.pad  # [C]
        if ends.shape[0] == 0:
            return []
        # Compare backwards from each candidate against the suffix: at most max_n tokens,
        # and at most L - 1 (an earlier n-gram ends by L - 2), so the suffix itself never
        # reaches the sentinels while a candidate may (and then stops matching).
        offsets = self._offsets[: min(self.max_n, length - 1)]  # [n]
        equal = seq[ends[:, None] - offsets[None, :]] == seq[last - offsets][None, :]  # [C, n]
        match_len = equal.cumprod(axis=1).sum(axis=1)  # [C]
        longest = match_len.max()
        if longest < self.min_n:
            return []
        best = np.flatnonzero(match_len == longest)[-1]  # most recent among the longest
        start = int(ends[best]) + 1
        copied = seq[start : min(start + k, last + 1)]
        # Past the end, the continuation copies itself: period L - start.
        return np.resize(copied, k).tolist() if copied.shape[0] < k else copied.tolist()
