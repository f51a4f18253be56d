"""The lean one-token decode step (over a paged cache) computes what the draft model's own forward computes."""

from __future__ import annotations

import pytest
import torch

from model_shards import StepBatch, load_checkpoint
from model_shards.kv_cache import PagedKVCache
from moeserve.spec.draft_decoder import DenseDecodeStep
from tests.model_shards.hf_tiny import save_tiny


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, folder, seed=2)
    return load_checkpoint(folder)


BLOCK = 4


def _prefilled(model, lengths: list[int]):
    """Two caches, each holding the same prompts (the model's forward's, and the lean step's); the
    rows' blocks are scattered (row r holds blocks r + 1, r + 1 + R, ...) with room for a few more tokens."""
    cfg = model.config
    n = len(lengths)
    tables = torch.tensor([[r + 1 + i * n for i in range(-(-(max(lengths) + 4) // BLOCK))] for r in range(n)])
    ids = torch.randint(2, 96, (n, max(lengths)), generator=torch.Generator().manual_seed(0))
    caches = [PagedKVCache(cfg.num_layers, 64, BLOCK, cfg.num_kv_heads, cfg.head_dim) for _ in range(2)]
    for cache in caches:
        model(ids, cache, StepBatch(tables, torch.zeros(n, dtype=torch.long), torch.tensor(lengths), BLOCK),
              logits="last")
    return *caches, tables


def _batch(tables: torch.Tensor, rows: list[int], start: list[int], q_lens: list[int]) -> StepBatch:
    return StepBatch(tables[rows], torch.tensor(start), torch.tensor(q_lens), BLOCK)


@pytest.mark.parametrize("rows", [[0, 1, 2], [2, 0], [1]])
def test_step_equals_the_model_forward(model, rows):
    lengths = [20, 13, 7]
    reference, cache, tables = _prefilled(model, lengths)
    lean = DenseDecodeStep(model, cache, 64)
    positions = torch.tensor([lengths[s] for s in rows])  # each row at its own length
    tokens = torch.tensor([5, 6, 7][: len(rows)])
    for step in range(3):  # the step's own keys/values must be read back by the next one
        got = lean.step(tokens, tables[rows], positions + step, int(positions.max()) + step + 1)
        want = model(tokens[:, None], reference, _batch(tables, rows, (positions + step).tolist(), [1] * len(rows)),
                     logits="last")
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        tokens = want.argmax(-1)


def test_moe_models_are_not_supported(tmp_path):
    save_tiny("mixtral", tmp_path)
    model = load_checkpoint(tmp_path)
    assert not DenseDecodeStep.supports(model)
    with pytest.raises(ValueError, match="dense"):
        DenseDecodeStep(model, PagedKVCache(1, 4, BLOCK, 1, 8), 8)


@pytest.mark.parametrize("rows", [[0, 1, 2], [2, 0], [1]])
def test_feed_writes_what_the_model_forward_writes(model, rows):
    """A few tokens per row (ragged: padding goes to the scratch block), then a step that reads
    them back: the same logits as the model's own forward."""
    lengths = [20, 13, 7]
    fed = [[5, 6, 7], [9, 10], [11, 12, 13]]  # room for 4 more tokens per row, the step included
    reference, cache, tables = _prefilled(model, lengths)
    lean = DenseDecodeStep(model, cache, 64)
    tails = [fed[s] for s in rows]
    width = max(map(len, tails))
    tokens = torch.tensor([t + [0] * (width - len(t)) for t in tails])
    starts = torch.tensor([lengths[s] for s in rows])
    lean.feed(tokens, torch.tensor([len(t) for t in tails]), tables[rows], starts)
    ends = starts + torch.tensor([len(t) for t in tails])
    for s in rows:  # the reference: each row's tail through the model's forward
        model(torch.tensor([fed[s]]), reference, _batch(tables, [s], [lengths[s]], [len(fed[s])]), logits="last")
    last = torch.tensor([3] * len(rows))
    got = lean.step(last, tables[rows], ends, int(ends.max()) + 1)
    want = model(last[:, None], reference, _batch(tables, rows, ends.tolist(), [1] * len(rows)), logits="last")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
