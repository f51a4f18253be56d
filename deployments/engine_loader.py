"""What one engine replica loads: `EngineServerConfig` and `load_engine` (model, tokenizer,
proposer, and the expert-parallel shard group when the model is split over several ranks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from model_shards.device import resolve_device
from moeserve.config import EngineSection, ShardsSection, default_of
from moeserve.engine import LLMEngine
from moeserve.engine.factory import EngineConfig, build_engine


@dataclass(frozen=True)
class EngineServerConfig:
    """What one engine replica loads (`engine`) and how it queues.

    max_queued_requests: requests waiting for a batch slot beyond `engine.max_num_seqs`
        running ones; past it new requests end at once with RESOURCE_EXHAUSTED (backpressure).
    stream_interval_s, stream_interval_max_s: every chunk is a message through Serve
        (engine -> gateway -> proxy); under load, per-step chunks cost more than the step, so
        later tokens are batched into chunks at most this often: stream_interval_s with one
        live request, growing linearly to stream_interval_max_s (default: the same) when
        `engine.max_num_seqs` are live. The first token is never delayed: TTFT is unchanged.
    report_expert_load_s: how often (seconds) the replica pushes its cumulative expert-load
        counters to the router-service actor; 0 turns it off (no Ray needed).
    num_shards: 1 runs the whole model in the core; W > 1 runs an expert-parallel shard
        group (rank 0 in the replica's process, W - 1 shard actors placed with `shard_strategy`,
        each with `gpus_per_shard` GPUs).
    core_process: run the engine core (the step loop) in a process of its own, so it never
        shares a GIL with Serve's event loop. A shard group's rank 0 needs the replica's Ray
        connection, so with one the core runs on a thread.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    max_queued_requests: int = default_of(EngineSection, "max_queued_requests")
    num_shards: int = default_of(ShardsSection, "num_shards")
    shard_strategy: str = default_of(ShardsSection, "strategy")
    gpus_per_shard: float = default_of(ShardsSection, "gpus_per_shard")
    torch_threads: int | None = default_of(EngineSection, "torch_threads")
    # Off unless the app config turns it on (engine.expert_load_report_s): reporting needs Ray.
    report_expert_load_s: float = 0.0
    # None: every step's tokens are a chunk (an engine server built in-process); the app config's
    # engine.stream_interval_s coalesces them.
    stream_interval_s: float | None = None
    stream_interval_max_s: float | None = None  # the interval with a full batch (None: stream_interval_s)
    core_process: bool = default_of(EngineSection, "core_process")
    live_replacement: bool = default_of(ShardsSection, "live_replacement")
    replacement_min_gain: float = default_of(ShardsSection, "replacement_min_gain")

    def __post_init__(self) -> None:
        if self.stream_interval_s is None:
            object.__setattr__(self, "stream_interval_s", 0.0)
        top = self.stream_interval_max_s
        if self.stream_interval_s < 0 or (top is not None and top < self.stream_interval_s):
            raise ValueError(f"need 0 <= stream_interval_s <= stream_interval_max_s, got "
                             f"{self.stream_interval_s}, {top}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")

    def stream_interval(self, live: int) -> float:
        """Seconds between a stream's chunks while `live` requests are in the replica."""
        top = self.stream_interval_s if self.stream_interval_max_s is None else self.stream_interval_max_s
        load = min(1.0, max(0, live - 1) / max(1, self.engine.max_num_seqs - 1))
        return self.stream_interval_s + (top - self.stream_interval_s) * load


def load_engine(cfg: EngineServerConfig, proposer: Any = None) -> tuple[LLMEngine, Any]:
    """The engine `cfg` names, and its shard group (None when the model runs in this process).

    With a shard group, rank 0's ShardedRunner replaces the single-process ModelRunner; the
    group is Ray actors, so this path needs a running Ray (deployments/shard_group.py).
    """
    if cfg.num_shards == 1:
        return build_engine(cfg.engine, proposer=proposer), None
    from deployments.router_actor import proposed_placement
    from deployments.shard_group import ShardGroup, ShardGroupConfig

    per_rank = -(-cfg.engine.max_num_seqs // cfg.num_shards)  # sequences are spread over the ranks
    group_cfg = ShardGroupConfig(
        cfg.engine.model, world_size=cfg.num_shards, max_num_seqs=per_rank, max_model_len=cfg.engine.max_model_len,
        block_size=cfg.engine.block_size, prefix_caching=cfg.engine.prefix_caching, compile=cfg.engine.compile, routing=cfg.engine.routing, dtype=cfg.engine.dtype, strategy=cfg.shard_strategy,
        gpus_per_shard=cfg.gpus_per_shard,
    )  # fmt: skip
    if cfg.engine.device != "auto" and resolve_device(cfg.engine.device) != group_cfg.device:
        raise ValueError(f"engine.device {cfg.engine.device!r} and shards.gpus_per_shard {cfg.gpus_per_shard} "
                         f"disagree: a shard group runs every rank on {group_cfg.device}")
    group = ShardGroup(group_cfg, placement=proposed_placement(cfg.num_shards))
    return build_engine(cfg.engine, runner=group.start(), proposer=proposer), group
