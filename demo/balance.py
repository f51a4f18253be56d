"""The Switch load-balancing loss and per-layer expert load, from the router logits of a forward pass.

Per layer, with N experts, T tokens and top-k routing:
  f_i = share of the T*k expert assignments that went to expert i   (sums to 1)
  P_i = mean router probability of expert i over the T tokens       (sums to 1)
  balance = N * sum_i f_i * P_i                                     (1.0 when perfectly even)
The loss is alpha * balance averaged over layers; f_i carries no gradient, P_i does.
"""

from __future__ import annotations

import torch

# shapes: T tokens, E experts, K experts per token


def layer_load(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (f, P), each [E], for one layer's router logits [T, E]."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    expert_ids = probs.topk(top_k, dim=-1).indices  # [T, K]
    counts = torch.zeros_like(probs[0]).scatter_add_(0, expert_ids.reshape(-1), torch.ones_like(probs[:, 0]).repeat_interleave(top_k))
    f = counts / expert_ids.numel()  # [E]
    return f, probs.mean(dim=0)  # [E], [E]


def switch_balance(router_logits: tuple[torch.Tensor, ...], top_k: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Mean over layers of N * sum f_i P_i, and each layer's (f, P) for logging."""
    loads = [layer_load(logits, top_k) for logits in router_logits]
    n = router_logits[0].shape[-1]
    balance = torch.stack([n * (f * p).sum() for f, p in loads]).mean()
    return balance, loads


def format_load(loads: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """One line per layer: f_i and P_i per expert (in %) and the layer's N * sum f_i P_i."""
    lines = []
    for layer, (f, p) in enumerate(loads):
        n = f.numel()
        fs = " ".join(f"{100 * x:4.1f}" for x in f.tolist())
        ps = " ".join(f"{100 * x:4.1f}" for x in p.detach().tolist())
        lines.append(f"  layer {layer}: f% [{fs}]  P% [{ps}]  N*sum(fP)={n * float((f * p.detach()).sum()):.3f}")
    return "\n".join(lines)
