"""Build an engine from checkpoint folders: the one place that wires model, tokenizer and proposer."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model_shards.device import DEVICES, DTYPES, resolve_device, resolve_dtype
from model_shards.kv_cache import PagedKVCache
from moeserve.config import (
    AppConfig,
    EngineSection,
    GrammarSection,
    ModelSection,
    RoutingSection,
    SpeculativeSection,
    default_of,
    resolve_path,
)
from moeserve.engine.engine import LLMEngine
from moeserve.engine.model_runner import ModelRunner
from moeserve.engine.scheduler import SchedulerConfig
from moeserve.grammar.compiler import GrammarConfig
from moeserve.spec.policy import SpecConfig

SPECULATION = ("none", "ngram", "model")


def demo_checkpoint(name: str) -> str:
    """A shipped demo checkpoint folder (`checkpoints/NAME`, in the checkout or the installed package)."""
    return resolve_path(f"checkpoints/{name}")


@dataclass(frozen=True)
class EngineConfig:
    """What the engine core builds itself from: the engine's part of the config tree (`from_app`)."""

    model: str = ""  # checkpoint folder of the target; default: the demo MoE
    draft_model: str = ""  # checkpoint folder of the draft; default: the demo draft
    speculation: str = default_of(SpeculativeSection, "draft")  # none | ngram | model | auto (resolved here)
    num_spec_tokens: int = default_of(SpeculativeSection, "num_tokens")
    adaptive_k: bool = default_of(SpeculativeSection, "adaptive")
    spec_disable_by_batch_size: int = default_of(SpeculativeSection, "disable_by_batch_size")
    max_num_seqs: int = default_of(EngineSection, "max_num_seqs")
    max_model_len: int = default_of(EngineSection, "max_model_len")
    max_num_batched_tokens: int = default_of(EngineSection, "max_num_batched_tokens")
    kv_budget_tokens: int = default_of(EngineSection, "kv_budget_tokens")
    kv_cache_memory: int = default_of(EngineSection, "kv_cache_memory")  # bytes; 0: kv_budget_tokens decides
    block_size: int = default_of(EngineSection, "block_size")
    prefix_caching: bool = default_of(EngineSection, "prefix_caching")
    dtype: str = default_of(ModelSection, "dtype")  # auto: bfloat16 on a GPU, float32 on the CPU
    device: str = default_of(EngineSection, "device")  # auto | cpu | cuda
    compile: bool = default_of(EngineSection, "compile")
    routing: RoutingSection = field(default_factory=RoutingSection)  # expert capacity and overflow
    grammar: GrammarConfig = field(default_factory=lambda: GrammarSection().grammar_config())  # JSON style, limits

    def __post_init__(self) -> None:
        if not self.model:
            object.__setattr__(self, "model", resolve_path(default_of(ModelSection, "path")))
        if not self.draft_model:
            object.__setattr__(self, "draft_model", resolve_path(default_of(SpeculativeSection, "draft_path")))
        if self.speculation == "draft":  # the older name of "model"
            object.__setattr__(self, "speculation", "model")
        if self.speculation == "auto":
            object.__setattr__(self, "speculation", "model" if same_tokenizer(self.model, self.draft_model) else "ngram")
        if self.speculation not in SPECULATION:
            raise ValueError(f"speculation: must be one of {SPECULATION}, got {self.speculation!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device: must be one of {DEVICES}, got {self.device!r}")
        SpecConfig(num_tokens=self.num_spec_tokens, disable_by_batch_size=self.spec_disable_by_batch_size)
        self.scheduler()  # validates the scheduler limits

    @classmethod
    def from_app(cls, cfg: AppConfig) -> EngineConfig:
        """The engine's part of the whole config tree, paths resolved."""
        e, s = cfg.engine, cfg.speculative
        return cls(
            model=resolve_path(cfg.model.path),
            draft_model=resolve_path(s.draft_path) if s.draft_path else "",
            speculation=s.draft,
            num_spec_tokens=s.num_tokens,
            adaptive_k=s.adaptive,
            spec_disable_by_batch_size=s.disable_by_batch_size,
            max_num_seqs=e.max_num_seqs,
            max_model_len=e.max_model_len,
            max_num_batched_tokens=e.max_num_batched_tokens,
            kv_budget_tokens=e.kv_budget_tokens,
            kv_cache_memory=e.kv_cache_memory,
            block_size=e.block_size,
            prefix_caching=e.prefix_caching,
            dtype=cfg.model.dtype,
            device=e.device,
            compile=e.compile,
            routing=cfg.routing,
            grammar=cfg.grammar.grammar_config(),
        )

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.torch_device)

    def kv_blocks(self, lookahead: int = 0) -> int:
        """Blocks of the KV cache, the scratch block included: as many as kv_cache_memory holds, or
        kv_budget_tokens in blocks plus the scratch one (0: max_num_seqs sequences of max_model_len
        and `lookahead` draft tokens each)."""
        bs = self.block_size
        if self.kv_cache_memory:
            from model_shards.config import ModelConfig

            c = ModelConfig.from_file(self.model)
            return self.kv_cache_memory // PagedKVCache.block_bytes(c, bs, self.torch_dtype)
        if self.kv_budget_tokens:
            return -(-self.kv_budget_tokens // bs) + 1
        return self.max_num_seqs * -(-(self.max_model_len + lookahead) // bs) + 1

    def scheduler(self, lookahead: int = 0) -> SchedulerConfig:
        """The scheduler's limits; its KV budget is the cache's blocks (less the scratch one) in tokens."""
        return SchedulerConfig(
            self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
            kv_budget_tokens=(self.kv_blocks(lookahead) - 1) * self.block_size, lookahead=lookahead,
            block_size=self.block_size, share_prefill=self.prefix_caching,
        )


def same_tokenizer(model: str, draft: str) -> bool:
    """Whether the draft checkpoint folder exists and tokenizes exactly as the target's."""
    files = [Path(folder) / "tokenizer.json" for folder in (model, draft)]
    return all(f.is_file() for f in files) and files[0].read_bytes() == files[1].read_bytes()


def build_proposer(cfg: EngineConfig):
    """The proposer named by `cfg.speculation` (None for "none")."""
    if cfg.speculation == "none":
        return None
    if cfg.speculation == "ngram":
        from moeserve.spec.ngram import NgramProposer

        return NgramProposer()
    from model_shards import load_checkpoint
    from moeserve.engine.draft_model import DraftModelProposer  # loads the draft's model stack only when asked

    draft = load_checkpoint(cfg.draft_model, cfg.torch_dtype, device=cfg.torch_device)
    return DraftModelProposer(model=draft, max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
                              compile=cfg.compile)


def build_engine(cfg: EngineConfig, runner=None, proposer=None) -> LLMEngine:
    """An engine on `runner` (default: the whole target in this process) with the configured
    speculation; `proposer` overrides it (e.g. a remote draft deployment)."""
    from model_shards import load_checkpoint
    from moeserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    proposer = proposer if proposer is not None else build_proposer(cfg)
    lookahead = cfg.num_spec_tokens if proposer is not None else 0
    if runner is None:
        model = load_checkpoint(cfg.model, cfg.torch_dtype, device=cfg.torch_device)
        model.set_routing(cfg.routing)
        runner = ModelRunner(model, cfg.max_num_seqs, cfg.max_model_len, cfg.kv_blocks(lookahead), cfg.block_size,
                             cfg.prefix_caching, compile=cfg.compile)
    if getattr(runner, "compiled", None) is not None:
        # warm the multi-position graph too (verify passes, short prefills after a prefix hit): compiled
        # on first use, it would stall a request
        if proposer is not None:
            multi = (cfg.num_spec_tokens + 1,)
        else:
            multi = (2,) if runner.prefix_caching else ()
        seconds = runner.compiled.warm_up((1, *multi))
        logging.getLogger(__name__).info("model step compiled in %.1f s", seconds)
    spec = SpecConfig(num_tokens=lookahead, adaptive=cfg.adaptive_k, disable_by_batch_size=cfg.spec_disable_by_batch_size)
    # a runner handed in (a shard group's) keeps its own blocks and prefix caching
    scheduler = dataclasses.replace(cfg.scheduler(lookahead), block_size=runner.block_size,
                                    share_prefill=runner.prefix_caching)
    return LLMEngine(runner, tokenizer, scheduler=scheduler, proposer=proposer, spec=spec)
