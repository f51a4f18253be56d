"""Bitmask helpers: the CPU kernel (no triton) agrees with the pure-torch reference."""

from __future__ import annotations

import pytest
import torch

from moeserve.grammar import allocate_bitmask, apply_bitmask, apply_bitmask_torch, reset_bitmask


def random_bitmask(batch: int, vocab: int, seed: int) -> torch.Tensor:
    bitmask = allocate_bitmask(batch, vocab)
    bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int32))
    return bitmask


def reference(logits: torch.Tensor, bitmask: torch.Tensor, rows=None) -> torch.Tensor:
    out = logits.clone()
    for i in range(out.shape[0]) if rows is None else rows:
        for t in range(out.shape[1]):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                out[i, t] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [None, [0, 2]])
def test_kernel_matches_reference(dtype, rows):
    vocab = 1000  # not a multiple of 32: the last word is partly padding
    bitmask = random_bitmask(3, vocab, seed=1)
    logits = torch.randn(3, vocab).to(dtype)
    expected = reference(logits.float(), bitmask, rows).to(dtype)
    fast, slow = logits.clone(), logits.clone()
    apply_bitmask(fast, bitmask, rows)
    apply_bitmask_torch(slow, bitmask, rows)
    assert torch.equal(fast, expected) and torch.equal(slow, expected)


def test_allocate_and_reset():
    bitmask = allocate_bitmask(2, 1024)
    assert bitmask.shape == (2, 32) and bitmask.dtype == torch.int32 and bool((bitmask == -1).all())
    bitmask.zero_()
    reset_bitmask(bitmask)
    logits = torch.zeros(2, 1024)
    apply_bitmask(logits, bitmask)
    assert bool((logits == 0).all())


def test_bitmask_must_cover_the_logits():
    with pytest.raises(ValueError, match="covers 32 tokens"):
        apply_bitmask(torch.zeros(1, 33), allocate_bitmask(1, 32))
