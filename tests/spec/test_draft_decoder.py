"""The lean one-token decode step computes what the draft model's own forward computes."""

from __future__ import annotations

import copy

import pytest
import torch

from model_shards import StepBatch, load_checkpoint
from moeserve.spec.draft_decoder import DenseDecodeStep
from tests.model_shards.hf_tiny import save_tiny


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, folder, seed=2)
    return load_checkpoint(folder)


def _prefilled(model, lengths: list[int]):
    cache = model.make_cache(len(lengths), 64)
    ids = torch.randint(2, 96, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(0))
    model(ids, cache, StepBatch.build(list(range(len(lengths))), [0] * len(lengths), lengths), logits="last")
    return cache


@pytest.mark.parametrize("slots", [[0, 1, 2], [2, 0], [1]])
def test_step_equals_the_model_forward(model, slots):
    lengths = [20, 13, 7]
    cache = _prefilled(model, lengths)
    reference = copy.deepcopy(cache)
    lean = DenseDecodeStep(model, cache)
    positions = torch.tensor([lengths[s] for s in slots])  # each row at its own length
    tokens = torch.tensor([5, 6, 7][: len(slots)])
    for step in range(3):  # the step's own keys/values must be read back by the next one
        rows = slice(slots[0], slots[0] + 1) if len(slots) == 1 else torch.tensor(slots)
        got = lean.step(tokens, rows, positions + step, int(positions.max()) + step + 1)
        want = model(tokens[:, None], reference, StepBatch.build(slots, (positions + step).tolist(), [1] * len(slots)),
                     logits="last")
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        tokens = want.argmax(-1)


def test_moe_models_are_not_supported(tmp_path):
    save_tiny("mixtral", tmp_path)
    model = load_checkpoint(tmp_path)
    assert not DenseDecodeStep.supports(model)
    with pytest.raises(ValueError, match="dense"):
        DenseDecodeStep(model, model.make_cache(1, 8))
