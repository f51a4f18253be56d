"""Batched token sampling with per-row parameters: temperature -> top-k -> top-p -> draw.

Shape legend: B rows, T positions per row (1, or k + 1 when verifying k drafts), V vocab,
S rows that sample (the rest, G, are greedy), C top-p candidates, N rows past C.

Semantics follow vLLM and transformers: top-k keeps ties with the k-th largest logit; top-p
keeps the smallest most-likely set reaching top_p (at least one token). Draws use inverse CDF:
one uniform per position, far cheaper on CPU than V exponential or Gumbel numbers.

Seeded requests draw token i as argmax_x p(x) / E_x with E ~ Exp(1)^V keyed by (seed, i):
Gumbel-max, an exact sample from p that depends on nothing but the request. Its reply is the
same whatever the batch, with or without speculation, and after a resume; a draft that uses
the same keyed noise proposes exactly the target's token wherever p and q agree.
"""

from __future__ import annotations

import torch

from moeserve.sampling_params import SamplingParams, TokenLogprob

__all__ = ["Sampler", "keyed_noise", "keyed_sample", "make_generator", "random_sample"]

NEG_INF = float("-inf")
# top-p first looks for the nucleus among this many most likely tokens, which avoids a
# full-vocabulary sort; rows whose nucleus is larger fall back to the sort.
TOP_P_CANDIDATES = 128


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator for one request; keep it with the request and pass it every step."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


_MASK64 = (1 << 64) - 1


def _key(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): the generator seed of one position's noise."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def keyed_noise(keys: list[tuple[int, int]], vocab: int) -> torch.Tensor:
    """Exp(1) noise [N, V], row i a function of keys[i] = (seed, position) alone."""
    noise = torch.empty(len(keys), vocab, dtype=torch.float64)
    gen = torch.Generator()
    for i, (seed, position) in enumerate(keys):
        gen.manual_seed(_key(seed, position))
        noise[i].exponential_(generator=gen)
    return noise


def keyed_sample(probs: torch.Tensor, keys: list[tuple[int, int]]) -> torch.Tensor:
    """One exact sample per row of probs [N, V] (need not be normalised), keyed: [N] token ids."""
    return (probs.double() / keyed_noise(keys, probs.shape[-1])).argmax(dim=-1)


def random_sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Inverse-CDF draw: probs [B, T, V] (unnormalised; zeros never drawn) -> token ids [B, T].
    Rows with a generator draw from their own, independent of the batch; None: torch's default."""
    cdf = probs.cumsum(dim=-1)  # [B, T, V]
    u = torch.empty(cdf.shape[:-1] + (1,), dtype=cdf.dtype, device=cdf.device)  # [B, T, 1]
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        u.uniform_()
    for i in seeded:
        u[i].uniform_(generator=generators[i])
    u = u * cdf[..., -1:]  # [B, T, 1] in [0, total mass)
    # right=True: the first position whose cdf exceeds u, never a zero-probability token.
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1)  # [B, T]
    # u * total can round up to total (position V); the last token with mass is meant.
    last = cdf.argmax(dim=-1)  # [B, T] first position reaching the total
    return torch.minimum(tokens, last)  # [B, T]


def _apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return logits / temperature.view(-1, 1, 1)  # [S, T, V]


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep logits >= each row's k-th largest (ties kept); top_k [S] <= 0 or >= V is off."""
    vocab = logits.shape[-1]
    active = (top_k > 0) & (top_k < vocab)  # [S]
    if not bool(active.any()):
        return logits
    k = torch.where(active, top_k, 1)  # [S]
    top_values = logits.topk(int(k.max()), dim=-1).values  # [S, T, max_k] descending
    kth = top_values.gather(-1, (k - 1).view(-1, 1, 1).expand(-1, logits.shape[1], 1))  # [S, T, 1]
    kth = kth.masked_fill(~active.view(-1, 1, 1), NEG_INF)  # [S, T, 1]
    return logits.masked_fill(logits < kth, NEG_INF)  # [S, T, V]


def _apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the nucleus and renormalise: probs [S, T, V], top_p [S] in (0, 1] (1 = off). A token
    stays when the mass more likely than it is < top_p (transformers' rule read from the other
    end); ties with the last kept token stay too."""
    vocab = probs.shape[-1]
    p = top_p.view(-1, 1, 1).expand(-1, probs.shape[1], 1)  # [S, T, 1]
    candidates = probs.topk(min(vocab, TOP_P_CANDIDATES), dim=-1).values  # [S, T, C] descending
    inclusive = candidates.cumsum(dim=-1)  # [S, T, C]
    exclusive = torch.cat([torch.zeros_like(inclusive[..., :1]), inclusive[..., :-1]], dim=-1)  # [S, T, C]
    kept = (exclusive < p).sum(dim=-1, keepdim=True)  # [S, T, 1] >= 1, a prefix: exclusive is sorted
    threshold = candidates.gather(-1, kept - 1)  # [S, T, 1] smallest kept probability
    threshold = threshold.masked_fill(p >= 1.0, 0.0)  # [S, T, 1]

    unresolved = ((inclusive[..., -1:] < p) & (p < 1.0)).squeeze(-1)  # [S, T]
    if bool(unresolved.any()):
        threshold[unresolved] = _top_p_threshold_sorted(probs[unresolved], p[unresolved])  # [N, 1]

    probs = probs.masked_fill(probs < threshold, 0.0)  # [S, T, V]
    return probs / probs.sum(dim=-1, keepdim=True)  # [S, T, V]


def _top_p_threshold_sorted(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Full-sort fallback, transformers' formulation: probs [N, V], p [N, 1] -> [N, 1]."""
    probs_sort = probs.sort(dim=-1, descending=False).values  # [N, V]
    remove = probs_sort.cumsum(dim=-1) <= (1.0 - p)  # [N, V]
    remove[:, -1] = False  # the most likely token always stays
    first_kept = remove.sum(dim=-1, keepdim=True)  # [N, 1] removals form a prefix
    return probs_sort.gather(-1, first_kept)  # [N, 1]


class Sampler:
    """Logits to probabilities or tokens, per-row SamplingParams; stateless (generators live with requests)."""

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Processed float32 probabilities shaped as logits; greedy rows one-hot at the argmax.
        The rejection sampler uses these for draft and target: exactly what `sample` draws from."""
        logits3, squeeze = _as_3d(logits, params)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not greedy:
            probs = _processed_probs(logits3, params)  # [B, T, V]
        else:
            probs = torch.zeros(logits3.shape, dtype=torch.float32, device=logits3.device)  # [B, T, V]
            rows = _index(greedy, logits3.device)
            argmax = logits3[rows].argmax(dim=-1, keepdim=True)  # [G, T, 1]
            probs[rows] = probs[rows].scatter_(-1, argmax, 1.0)  # one-hot
            if sampled:
                rows = _index(sampled, logits3.device)
                probs[rows] = _processed_probs(logits3[rows], [params[i] for i in sampled])
        return probs.squeeze(1) if squeeze else probs

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None] | None = None,
               positions: list[int] | None = None) -> torch.Tensor:
        """Token ids [B] for logits [B, V] (or [B, T] for [B, T, V]). Seeded rows draw keyed noise
        for absolute position positions[i] + t; others use generators[i] (make_generator) or
        torch's default (None). All-greedy batches are a plain argmax."""
        logits3, squeeze = _as_3d(logits, params)
        if generators is None:
            generators = [None] * len(params)
        if len(generators) != len(params):
            raise ValueError(f"generators has {len(generators)} entries for {len(params)} rows")
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        keyed = [i for i in sampled if params[i].seed is not None and positions is not None]
        drawn = [i for i in sampled if i not in keyed]
        tokens = logits3.argmax(dim=-1) if len(drawn) < len(params) else None  # [B, T]
        if drawn:
            rows = drawn if tokens is not None else slice(None)
            probs = _processed_probs(logits3[rows], [params[i] for i in drawn])  # [S, T, V]
            picked = random_sample(probs, [generators[i] for i in drawn])  # [S, T]
            if tokens is None:
                tokens = picked
            else:
                tokens[_index(drawn, logits3.device)] = picked
        if keyed:
            t = logits3.shape[1]
            probs = _processed_probs(logits3[keyed], [params[i] for i in keyed])  # [S, T, V]
            keys = [(params[i].seed, positions[i] + j) for i in keyed for j in range(t)]
            tokens[_index(keyed, logits3.device)] = keyed_sample(probs.reshape(-1, probs.shape[-1]), keys).view(-1, t)
        return tokens.squeeze(1) if squeeze else tokens

    def logprobs(self, logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]) -> list[TokenLogprob]:
        """Each chosen token's log-probability, with params[i].logprobs alternatives; logits [N, V]
        already masked. Sampling rows: the processed distribution `sample` draws from. Greedy
        rows: the model's masked softmax (their processed one would be a one-hot)."""
        logp = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)  # [N, V]
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if greedy:
            rows = _index(greedy, logits.device)
            logp[rows] = logits[rows].float().log_softmax(dim=-1)
        if sampled:
            rows = _index(sampled, logits.device)
            logp[rows] = _processed_probs(logits[rows].unsqueeze(1), [params[i] for i in sampled]).squeeze(1).log()
        chosen = logp.gather(1, torch.tensor(tokens, device=logits.device).view(-1, 1)).squeeze(1).tolist()  # [N]
        width = max((p.logprobs or 0) for p in params)
        top_values, top_ids = logp.topk(width, dim=-1) if width else (logp[:, :0], logp[:, :0].long())  # [N, width]
        out = []
        for i, (token, lp) in enumerate(zip(tokens, chosen)):
            k = params[i].logprobs or 0
            top = tuple((t, v) for t, v in zip(top_ids[i, :k].tolist(), top_values[i, :k].tolist()) if v > NEG_INF)
            out.append(TokenLogprob(int(token), lp, top))
        return out


def _processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, softmax, top-p for rows that sample: [S, T, V] -> [S, T, V] float32."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)  # [S]
    scaled = _apply_temperature(logits.float(), temperature)  # [S, T, V]
    if any(p.top_k > 0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)  # [S]
        scaled = _apply_top_k(scaled, top_k)  # [S, T, V]
    probs = scaled.softmax(dim=-1)  # [S, T, V]
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)  # [S]
        probs = _apply_top_p(probs, top_p)  # [S, T, V]
    return probs


def _as_3d(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, bool]:
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must be [B, V] or [B, T, V], got shape {tuple(logits.shape)}")
    if logits.shape[0] != len(params):
        raise ValueError(f"logits has {logits.shape[0]} rows but params has {len(params)} entries")
    if logits.dim() == 2:
        return logits.unsqueeze(1), True  # [B, 1, V]
    return logits, False


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)
