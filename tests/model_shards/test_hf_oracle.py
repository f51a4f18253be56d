"""Oracle: our model's logits equal transformers' on the same checkpoint, for every family,
for a full forward, for prefill + token-by-token decode through the paged KV cache, and for the
same layers compiled (decode and verify passes; the draft's and a sharded rank's compiled passes:
tests/spec/test_draft_model.py, tests/model_shards/test_expert_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from model_shards import PagedKVCache, StepBatch, load_checkpoint
from model_shards.compiled_step import CompiledStep
from tests.model_shards.hf_tiny import FAMILIES, fuse_experts, save_tiny

TOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, folder)
    return request.param, folder, hf


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits.float()


def paged_cache(model, num_blocks: int, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache.for_model(model.config, num_blocks, block_size)


def test_full_forward_matches_transformers(pair):
    _, folder, hf = pair
    ours = load_checkpoint(folder)
    ids = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_prefill_then_decode_matches_transformers(pair):
    _, folder, hf = pair
    ours = load_checkpoint(folder)
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(hf, ids)  # [B, T, V]
    cache = paged_cache(ours, num_blocks=12)
    prefill = 12
    # each row's blocks out of order and interleaved with the other's
    tables = [[5, 2, 7, 10, 8], [1, 6, 3, 11, 4]]
    out = ours(ids[:, :prefill], cache, StepBatch.build(tables, [0, 0], [prefill, prefill], 4))
    torch.testing.assert_close(out, ref[:, :prefill], atol=TOL, rtol=0)
    for t in range(prefill, ids.shape[1]):
        step = ours(ids[:, t : t + 1], cache, StepBatch.build(tables, [t, t], [1, 1], 4), logits="last")
        torch.testing.assert_close(step, ref[:, t], atol=TOL, rtol=0)


def test_compiled_verify_then_decode_matches_transformers(pair):
    """The compiled step (traced by dynamo; inductor's kernels against eager:
    tests/model_shards/test_compiled_step.py) after an eager prefill: a verify-shaped pass of three
    positions, then one-token decode passes, through scattered blocks."""
    _, folder, hf = pair
    ours = load_checkpoint(folder)
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(hf, ids)  # [B, T, V]
    cache = paged_cache(ours, num_blocks=12)
    tables = [[5, 2, 7, 10, 8], [1, 6, 3, 11, 4]]
    ours(ids[:, :12], cache, StepBatch.build(tables, [0, 0], [12, 12], 4), logits="last")
    torch._dynamo.reset()
    step = CompiledStep(ours, cache, backend="eager")
    torch.testing.assert_close(step(ids[:, 12:15], torch.tensor(tables), [12, 12], [3, 3]), ref[:, 12:15],
                               atol=TOL, rtol=0)
    for t in range(15, ids.shape[1]):
        got = step(ids[:, t : t + 1], torch.tensor(tables), [t, t], [1, 1])[:, 0]
        torch.testing.assert_close(got, ref[:, t], atol=TOL, rtol=0)
    torch._dynamo.reset()


def test_ragged_batch_matches_per_sequence(pair):
    """Rows of different lengths in one padded step give each row's own logits."""
    _, folder, hf = pair
    ours = load_checkpoint(folder)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 96, (1, 9), generator=g), torch.randint(0, 96, (1, 5), generator=g)
    cache = paged_cache(ours, num_blocks=6)
    padded = torch.zeros(2, 9, dtype=torch.long)
    padded[0], padded[1, :5] = a[0], b[0]
    last = ours(padded, cache, StepBatch.build([[1, 2, 3], [4, 5]], [0, 0], [9, 5], 4), logits="last")
    torch.testing.assert_close(last[0], hf_logits(hf, a)[0, -1], atol=TOL, rtol=0)
    torch.testing.assert_close(last[1], hf_logits(hf, b)[0, -1], atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_fused_expert_layout_loads(family, tmp_path):
    hf = save_tiny(family, tmp_path)
    fuse_experts(tmp_path)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(load_checkpoint(tmp_path)(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_sharded_checkpoint_with_index(tmp_path):
    hf = save_tiny("mixtral", tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(load_checkpoint(tmp_path)(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_loads_only_requested_experts(tmp_path):
    save_tiny("mixtral", tmp_path)
    full = load_checkpoint(tmp_path)
    half = load_checkpoint(tmp_path, experts=[2, 3])
    assert half.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 2
    torch.testing.assert_close(
        half.model.layers[0].mlp.experts.down_proj, full.model.layers[0].mlp.experts.down_proj[2:]
    )
    assert half.loaded_bytes < full.loaded_bytes
