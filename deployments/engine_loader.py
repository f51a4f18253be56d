"""What one engine replica loads: `EngineServerConfig` and `load_engine` (model, tokenizer,
proposer, and the expert-parallel shard group when the model is split over several ranks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moeserve.engine import LLMEngine
from moeserve.engine.factory import EngineConfig, build_engine


@dataclass(frozen=True)
class EngineServerConfig:
    """What one engine replica loads (`engine`) and how it queues.

    max_queued_requests: requests waiting for a batch slot beyond `engine.max_num_seqs`
        running ones; past it new requests end at once with RESOURCE_EXHAUSTED (backpressure).
    stream_interval_s: every chunk is a message through Serve (engine -> gateway -> proxy);
        under load, per-step chunks cost more than the step, so later tokens are batched into
        chunks at most this often (the first token is never delayed: TTFT is unchanged).
    report_expert_load_s: how often (seconds) the replica pushes its cumulative expert-load
        counters to the router-service actor; 0 turns it off (no Ray needed).
    num_shards: 1 runs the whole model in this process; W > 1 runs an expert-parallel shard
        group (rank 0 in this process, W - 1 shard actors placed with `shard_strategy`, each
        with `gpus_per_shard` GPUs).
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    max_queued_requests: int = 64
    num_shards: int = 1
    shard_strategy: str = "PACK"
    gpus_per_shard: float = 0.0
    torch_threads: int | None = None
    report_expert_load_s: float = 0.0  # > 0: push expert-load counters to the router-service actor this often
    stream_interval_s: float = 0.0  # > 0: a stream's chunks (after the first token) at most this often

    def __post_init__(self) -> None:
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")


def load_engine(cfg: EngineServerConfig, proposer: Any = None) -> tuple[LLMEngine, Any]:
    """The engine `cfg` names, and its shard group (None when the model runs in this process).

    With a shard group, rank 0's ShardedRunner replaces the single-process ModelRunner; the
    group is Ray actors, so this path needs a running Ray (deployments/shard_group.py).
    """
    if cfg.num_shards == 1:
        return build_engine(cfg.engine, proposer=proposer), None
    from deployments.shard_group import ShardGroup, ShardGroupConfig

    per_rank = -(-cfg.engine.max_num_seqs // cfg.num_shards)  # sequences are spread over the ranks
    group = ShardGroup(ShardGroupConfig(
        cfg.engine.model, world_size=cfg.num_shards, max_num_seqs=per_rank, max_model_len=cfg.engine.max_model_len,
        strategy=cfg.shard_strategy, gpus_per_shard=cfg.gpus_per_shard,
    ))  # fmt: skip
    return build_engine(cfg.engine, runner=group.start(), proposer=proposer), group
