"""Token bitmasks: one int32 row of W = ceil(V / 32) words per sequence, bit t set = token t allowed.

B rows (sequences or verification positions), V vocabulary. CPU logits use xgrammar's C++ kernel;
other devices the torch fallback below, also the reference the tests compare the kernel against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

_BITS = torch.arange(32, dtype=torch.int32)  # [32]


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """[batch, W] int32 on CPU, every token allowed."""
    return xgr.allocate_token_bitmask(batch, vocab_size)


def reset_bitmask(bitmask: torch.Tensor) -> None:
    """Allow every token again (rows of unconstrained sequences must be all ones)."""
    bitmask.fill_(-1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """In place: logits[i, t] = -inf where bit t of bitmask[i] is 0, for i in `rows` (default all).
    logits [B, V], bitmask [B', W] with W * 32 >= V; mixed batches pass only the constrained rows."""
    vocab = logits.shape[-1]
    if bitmask.shape[-1] * 32 < vocab:
        raise ValueError(f"bitmask covers {bitmask.shape[-1] * 32} tokens, logits have {vocab}")
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float16, torch.bfloat16):
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=None if rows is None else list(rows), backend="cpu")
    else:
        apply_bitmask_torch(logits, bitmask.to(logits.device, non_blocking=True), rows)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """Pure-torch `apply_bitmask` for any device (no triton)."""
    vocab = logits.shape[-1]
    index = None if rows is None else torch.as_tensor(list(rows), dtype=torch.long, device=logits.device)
    words = bitmask if index is None else bitmask.index_select(0, index)  # [R, W]
    allowed = (words.unsqueeze(-1) >> _BITS.to(words.device)) & 1  # [R, W, 32]
    allowed = allowed.flatten(1)[:, :vocab].bool()  # [R, V]
    if index is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
