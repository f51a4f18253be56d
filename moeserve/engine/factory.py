"""Build an engine from checkpoint folders: the one place that wires model, tokenizer and proposer."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from moeserve.engine.engine import LLMEngine, SpecConfig
from moeserve.engine.model_runner import ModelRunner
from moeserve.engine.scheduler import SchedulerConfig

SPECULATION = ("none", "ngram", "draft")


def checkpoints_dir() -> Path:
    """`$MOESERVE_CHECKPOINTS`, else the repository's `checkpoints/` folder."""
    env = os.environ.get("MOESERVE_CHECKPOINTS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "checkpoints"


def demo_checkpoint(name: str) -> str:
    return str(checkpoints_dir() / name)


@dataclass(frozen=True)
class EngineConfig:
    model: str = ""  # checkpoint folder of the target; default: the demo MoE
    draft_model: str = ""  # checkpoint folder of the draft; default: the demo draft
    speculation: str = "ngram"  # none | ngram | draft
    num_spec_tokens: int = 4
    adaptive_k: bool = False
    spec_disable_by_batch_size: int = 0  # no speculation while this many sequences run (0: never)
    max_num_seqs: int = 32
    max_model_len: int = 1024
    max_num_batched_tokens: int = 4096
    kv_budget_tokens: int = 0  # 0: every slot may fill to max_model_len
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.model:
            object.__setattr__(self, "model", demo_checkpoint("demo-moe"))
        if not self.draft_model:
            object.__setattr__(self, "draft_model", demo_checkpoint("demo-draft"))
        if self.speculation not in SPECULATION:
            raise ValueError(f"speculation: must be one of {SPECULATION}, got {self.speculation!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: must be float32, bfloat16 or float16, got {self.dtype!r}")
        SpecConfig(num_tokens=self.num_spec_tokens, disable_by_batch_size=self.spec_disable_by_batch_size)
        self.scheduler()  # validates the scheduler limits

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig(
            self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len, kv_budget_tokens=self.kv_budget_tokens
        )


def build_proposer(cfg: EngineConfig):
    """The proposer named by `cfg.speculation` (None for "none")."""
    from moeserve.spec.proposer import make_proposer

    if cfg.speculation == "none":
        return None
    if cfg.speculation == "ngram":
        return make_proposer("ngram")
    from model_shards import load_checkpoint

    draft = load_checkpoint(cfg.draft_model, cfg.torch_dtype)
    return make_proposer("draft", model=draft, max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len)


def build_engine(cfg: EngineConfig, runner=None, proposer=None) -> LLMEngine:
    """An engine on `runner` (default: the whole target in this process) with the configured
    speculation; `proposer` overrides it (e.g. a remote draft deployment)."""
    from model_shards import load_checkpoint
    from moeserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    if runner is None:
        runner = ModelRunner(load_checkpoint(cfg.model, cfg.torch_dtype), cfg.max_num_seqs, cfg.max_model_len)
    proposer = proposer if proposer is not None else build_proposer(cfg)
    spec = SpecConfig(num_tokens=cfg.num_spec_tokens if proposer is not None else 0, adaptive=cfg.adaptive_k,
                      disable_by_batch_size=cfg.spec_disable_by_batch_size)
    return LLMEngine(runner, tokenizer, scheduler=cfg.scheduler(), proposer=proposer, spec=spec)
