"""Tiny target/draft pairs for speculative-decoding tests (test helper).

Drafts of three qualities, so that every verification path runs: the target itself
(alpha ~ 1: all accepted, bonus tokens), a noisy copy of it (partial acceptance,
rollbacks of every length) and an unrelated random model (alpha ~ 0: nearly every step
recovers at the first position).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import transformers as T

from model_shards import CausalLM, load_checkpoint
from moeserve.engine import LLMEngine, ModelRunner, SpecConfig
from moeserve.sampling_params import SamplingParams
from moeserve.spec.proposer import Proposer


def noisy_copy(model: CausalLM, scale: float, seed: int = 0) -> CausalLM:
    """A draft that agrees with `model` often but not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return draft


def save_small_vocab(family: str, folder: Path, vocab: int, seed: int, spread: float = 1.0) -> None:
    """A random model with a tiny vocabulary whose logits have a standard deviation of about `spread`."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                  eos_token_id=vocab - 1, bos_token_id=0, tie_word_embeddings=False)
    if family == "mixtral":
        cfg = T.MixtralConfig(**common, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    else:
        cfg = T.LlamaConfig(**common, intermediate_size=48)
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        model.lm_head.weight.mul_(spread / cfg.hidden_size**0.5 / model.lm_head.weight.std())
    model.save_pretrained(folder)


def random_prompts(n: int, vocab: int, seed: int, lengths: tuple[int, int] = (2, 30)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lengths[0], lengths[1], (1,), generator=g))
        out.append(torch.randint(2, vocab, (length,), generator=g).tolist())
    return out


def make_engine(
    target: str | Path | CausalLM,
    proposer: Proposer | None = None,
    k: int = 0,
    max_num_seqs: int = 4,
    max_model_len: int = 96,
    adaptive: bool = False,
) -> LLMEngine:
    model = target if isinstance(target, CausalLM) else load_checkpoint(target)
    runner = ModelRunner(model, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    return LLMEngine(runner, proposer=proposer, spec=SpecConfig(num_tokens=k, adaptive=adaptive))


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Token ids per prompt; requests join as slots free up and leave at their own length."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[rid] for rid in ids]
