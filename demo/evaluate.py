"""Held-out measures of the demo pair: perplexity, and the draft's greedy agreement with the target.

Greedy agreement is the acceptance rate to expect from greedy speculative decoding: for each
held-out prompt, the target writes its own greedy continuation; then both models read
prompt + continuation in one teacher-forced pass, and we count the positions where the
draft's argmax equals the target's argmax.
"""

from __future__ import annotations

import math

import torch

# shapes: B sequences, T positions, V vocabulary


@torch.no_grad()
def perplexity(model: torch.nn.Module, sequences: torch.Tensor, batch_size: int = 16) -> float:
    """exp(mean next-token cross-entropy) over packed held-out sequences [N, T]."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, sequences.shape[0], batch_size):
        ids = sequences[start:start + batch_size]  # [B, T]
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]  # [B, T-1, V]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
        total, count = total + float(loss), count + ids[:, 1:].numel()
    return math.exp(total / count)


@torch.no_grad()
def greedy_agreement(target: torch.nn.Module, draft: torch.nn.Module, prompts: list[list[int]],
                     new_tokens: int = 32, stop_ids: list[int] | None = None) -> dict[str, float]:
    """Fraction of continuation positions where argmax(draft) == argmax(target), over all prompts."""
    target.eval()
    draft.eval()
    matches = positions = 0
    per_prompt = []
    for prompt in prompts:
        ids = torch.tensor([prompt])  # [1, T]
        full = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=stop_ids,
                               pad_token_id=0, attention_mask=torch.ones_like(ids))  # [1, T + n]
        n = full.shape[1] - ids.shape[1]
        if n == 0:
            continue
        # position t predicts token t+1: the continuation is predicted from positions T-1 .. T+n-2
        window = slice(ids.shape[1] - 1, full.shape[1] - 1)
        t_arg = target(input_ids=full, use_cache=False).logits[0, window].argmax(-1)  # [n]
        d_arg = draft(input_ids=full, use_cache=False).logits[0, window].argmax(-1)  # [n]
        hit = int((t_arg == d_arg).sum())
        matches, positions = matches + hit, positions + n
        per_prompt.append(hit / n)
    return {"agreement": matches / max(positions, 1), "mean_per_prompt": sum(per_prompt) / max(len(per_prompt), 1),
            "positions": positions, "prompts": len(per_prompt)}
