"""Seeded reproducibility: a row's output depends on its seed and its own inputs only.

Shapes: B sequences, K draft tokens, V vocabulary.
"""

import torch

from moeserve.spec import RejectionSampler

VOCAB = 11
Row = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _row(seed: int, k: int) -> Row:
    """One sequence's inputs: target [k+1, V], draft ids [k], draft probs [k, V]."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(k + 1, VOCAB, generator=gen), dim=-1)  # [k+1, V]
    draft = torch.softmax(torch.randn(k, VOCAB, generator=gen), dim=-1)  # [k, V]
    ids = torch.multinomial(draft, 1, generator=gen).squeeze(-1)  # [k]
    return target, ids, draft


def _batch(rows: list[Row], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pads rows to K = width with junk, which must not matter."""
    batch = len(rows)
    target = torch.rand(batch, width + 1, VOCAB)  # [B, K+1, V]
    ids = torch.full((batch, width), 7, dtype=torch.long)  # [B, K]
    draft = torch.rand(batch, width, VOCAB)  # [B, K, V]
    for b, (t, i, d) in enumerate(rows):
        k = i.shape[0]
        target[b, : k + 1], ids[b, :k], draft[b, :k] = t, i, d
    return target, ids, draft, torch.tensor([r[1].shape[0] for r in rows])


def _run(rows: list[Row], seeds: list[int], width: int) -> list[list[int]]:
    target, ids, draft, num_draft = _batch(rows, width)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    return RejectionSampler().sample(target, ids, draft, num_draft, gens).token_ids


def test_same_seed_same_output() -> None:
    rows = [_row(i, 4) for i in range(32)]
    seeds = list(range(100, 132))
    assert _run(rows, seeds, 4) == _run(rows, seeds, 4)


def test_row_output_independent_of_batch_and_padding() -> None:
    a, b, c = _row(1, 3), _row(2, 5), _row(3, 0)
    alone = [_run([r], [s], r[1].shape[0])[0] for r, s in ((a, 10), (b, 11), (c, 12))]
    # Other neighbours, another order, wider padding, and unseeded rows in between.
    target, ids, draft, num_draft = _batch([_row(9, 2), c, a, _row(8, 6), b], width=7)
    gens = [None, torch.Generator().manual_seed(12), torch.Generator().manual_seed(10), None]
    gens.append(torch.Generator().manual_seed(11))
    mixed = RejectionSampler().sample(target, ids, draft, num_draft, gens).token_ids
    assert [mixed[2], mixed[4], mixed[1]] == alone


def test_seed_stream_continues_across_steps() -> None:
    rows = [_row(i, 3) for i in range(16)]
    gens = [torch.Generator().manual_seed(5) for _ in rows]
    target, ids, draft, num_draft = _batch(rows, 3)
    first = RejectionSampler().sample(target, ids, draft, num_draft, gens).token_ids
    second = RejectionSampler().sample(target, ids, draft, num_draft, gens).token_ids
    # The same generator objects moved on: a second step is a fresh draw, not a replay.
    assert first != second


def test_different_seeds_differ() -> None:
    rows = [_row(0, 4)] * 64
    outputs = _run(rows, list(range(64)), 4)
    assert len({tuple(o) for o in outputs}) > 1
