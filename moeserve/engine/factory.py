"""Build an engine from checkpoint folders: the one place that wires model, tokenizer and proposer."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from model_shards.device import resolve_device, resolve_dtype
from model_shards.kv_cache import PagedKVCache
from moeserve.config import AppConfig, resolve_path
from moeserve.engine.engine import LLMEngine
from moeserve.engine.model_runner import ModelRunner
from moeserve.engine.scheduler import SchedulerConfig
from moeserve.spec.policy import SpecConfig


def demo_checkpoint(name: str) -> str:
    """A shipped demo checkpoint folder (`checkpoints/NAME`, in the checkout or the installed package)."""
    return resolve_path(f"checkpoints/{name}")


def model_path(cfg: AppConfig) -> str:
    """The target's checkpoint folder, absolute."""
    return resolve_path(cfg.model.path)


def draft_path(cfg: AppConfig) -> str:
    """The draft's checkpoint folder, absolute ("" when none is set)."""
    return resolve_path(cfg.speculative.draft_path) if cfg.speculative.draft_path else ""


def speculation(cfg: AppConfig) -> str:
    """none | ngram | model: `speculative.draft`, with auto resolved (the draft model when it
    tokenizes as the target does, else prompt lookup)."""
    draft = cfg.speculative.draft
    if draft == "auto":
        return "model" if same_tokenizer(model_path(cfg), draft_path(cfg)) else "ngram"
    if draft == "model" and not draft_path(cfg):
        raise ValueError("speculative.draft is model but speculative.draft_path is not set")
    return draft


def engine_device(cfg: AppConfig) -> torch.device:
    return resolve_device(cfg.engine.device)


def engine_dtype(cfg: AppConfig) -> torch.dtype:
    return resolve_dtype(cfg.model.dtype, engine_device(cfg))


def kv_blocks(cfg: AppConfig, lookahead: int = 0) -> int:
    """Blocks of the KV cache, the scratch block included: as many as engine.kv_cache_memory holds,
    or kv_budget_tokens in blocks plus the scratch one (0: max_num_seqs sequences of max_model_len
    and `lookahead` draft tokens each)."""
    e = cfg.engine
    if e.kv_cache_memory:
        from model_shards.config import ModelConfig

        block = PagedKVCache.block_bytes(ModelConfig.from_file(model_path(cfg)), e.block_size, engine_dtype(cfg))
        return e.kv_cache_memory // block
    if e.kv_budget_tokens:
        return -(-e.kv_budget_tokens // e.block_size) + 1
    return e.max_num_seqs * -(-(e.max_model_len + lookahead) // e.block_size) + 1


def scheduler_config(cfg: AppConfig, lookahead: int = 0) -> SchedulerConfig:
    """The scheduler's limits; its KV budget is the cache's blocks (less the scratch one) in tokens."""
    e = cfg.engine
    return SchedulerConfig(e.max_num_seqs, e.max_num_batched_tokens, e.max_model_len,
                           kv_budget_tokens=(kv_blocks(cfg, lookahead) - 1) * e.block_size, lookahead=lookahead,
                           block_size=e.block_size, share_prefill=e.prefix_caching)


def same_tokenizer(model: str, draft: str) -> bool:
    """Whether the draft checkpoint folder exists and tokenizes exactly as the target's."""
    files = [Path(folder) / "tokenizer.json" for folder in (model, draft)]
    return all(f.is_file() for f in files) and files[0].read_bytes() == files[1].read_bytes()


def build_proposer(cfg: AppConfig):
    """The proposer `speculation(cfg)` names (None for "none")."""
    kind = speculation(cfg)
    if kind == "none":
        return None
    if kind == "ngram":
        from moeserve.spec.ngram import NgramProposer

        return NgramProposer()
    from model_shards import load_checkpoint
    from moeserve.engine.draft_model import DraftModelProposer  # loads the draft's model stack only when asked

    draft = load_checkpoint(draft_path(cfg), engine_dtype(cfg), device=engine_device(cfg))
    e = cfg.engine
    return DraftModelProposer(model=draft, max_num_seqs=e.max_num_seqs, max_model_len=e.max_model_len,
                              compile=e.compile)


def build_engine(cfg: AppConfig, runner=None, proposer=None) -> LLMEngine:
    """An engine on `runner` (default: the whole target in this process) with the configured
    speculation; `proposer` overrides it (e.g. a remote draft deployment)."""
    from model_shards import load_checkpoint
    from moeserve.tokenizer import load_tokenizer

    e, s = cfg.engine, cfg.speculative
    tokenizer = load_tokenizer(model_path(cfg))
    proposer = proposer if proposer is not None else build_proposer(cfg)
    lookahead = s.num_tokens if proposer is not None else 0
    if runner is None:
        model = load_checkpoint(model_path(cfg), engine_dtype(cfg), device=engine_device(cfg))
        model.set_routing(cfg.routing)
        runner = ModelRunner(model, e.max_num_seqs, e.max_model_len, kv_blocks(cfg, lookahead), e.block_size,
                             e.prefix_caching, compile=e.compile)
    if getattr(runner, "compiled", None) is not None:
        # warm the multi-position graph too (verify passes, short prefills after a prefix hit): compiled
        # on first use, it would stall a request
        if proposer is not None:
            multi = (s.num_tokens + 1,)
        else:
            multi = (2,) if runner.prefix_caching else ()
        seconds = runner.compiled.warm_up((1, *multi))
        logging.getLogger(__name__).info("model step compiled in %.1f s", seconds)
    spec = SpecConfig(num_tokens=lookahead, adaptive=s.adaptive, disable_by_batch_size=s.disable_by_batch_size)
    # a runner handed in (a shard group's) keeps its own blocks and prefix caching
    scheduler = dataclasses.replace(scheduler_config(cfg, lookahead), block_size=runner.block_size,
                                    share_prefill=runner.prefix_caching)
    return LLMEngine(runner, tokenizer, scheduler=scheduler, proposer=proposer, spec=spec)
